"""Optional plots of a mode's results (needs matplotlib)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional


from .common import MiB
from .fwd import FwdRow
from .memory import MemRow



def plot(mode: str, result: Dict[str, Any], meta: Dict[str, Any], path: str) -> Optional[str]:
    """Draws the results to ``path``; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: --plot skipped"
    title = f"{meta['device_name']}, torch {meta['torch_version']}, {meta['git_commit']}"
    if mode in ("fwd", "bwd", "fwd+bwd"):
        rows: List[FwdRow] = result["_rows"]
        groups = sorted({(r.dtype, r.head_dim, r.causal) for r in rows})
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
        for ax, (dt, d, causal) in zip(axes[0], groups):
            sub = [r for r in rows if (r.dtype, r.head_dim, r.causal) == (dt, d, causal)]
            names = sorted({n for r in sub for n in r.impls})
            for name in names:
                pts = [(r.seqlen, r.impls[name].tflops) for r in sub
                       if name in r.impls and r.impls[name].tflops is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                            linewidth=2.5 if name == "flash_ext" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{dt} d={d} {'causal' if causal else 'non-causal'}")
            ax.legend(fontsize=7)
    else:
        rows_m: List[MemRow] = result["_rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        method = "cuda_alloc" if meta["device"].startswith("cuda") else "rss"
        for label, attr in (("naive", "naive"), ("flash_ext", "flash_ext")):
            pts = [(r.seqlen, getattr(r, attr).get(method)) for r in rows_m]
            pts = [(s, b / MiB) for s, b in pts if b is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_ylabel(f"peak extra memory, MiB ({method})")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None
