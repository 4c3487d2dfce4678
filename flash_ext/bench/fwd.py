"""``fwd`` mode: forward TFLOP/s of flash_ext against each torch SDPA backend and naive attention."""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from .common import (
    DTYPES, DTYPE_NAMES, HEADLINE, ImplResult, SDPA_BACKENDS, attention_flops, check_against_sdpa_math,
    cpu_would_exhaust_ram, fmt, format_table, free_device_memory, is_oom, matmul_peak_tflops, naive_attention,
    short_error, time_impl,
)

@dataclass(frozen=True)
class FwdConfig:
    """One attention problem: q, k, v of shape ``(batch, seqlen, nheads, head_dim)``."""

    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"{DTYPE_NAMES[self.dtype]} b={self.batch} s={self.seqlen} h={self.nheads} d={self.head_dim} "
                f"{'causal' if self.causal else 'non-causal'}")


@dataclass
class FwdRow:
    dtype: str
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    flops: float
    check: str = "-"  # PASS | FAIL | ERR | -
    max_err: Optional[float] = None
    atol: Optional[float] = None
    impls: Dict[str, ImplResult] = field(default_factory=dict)
    best_sdpa: Optional[str] = None
    ratio_best_sdpa: Optional[float] = None
    ratio_sdpa_flash: Optional[float] = None
    ratio_best_sdpa_cpu_time: Optional[float] = None  # CPU device: same ratio from process CPU time
    model_ms: Optional[float] = None  # CUDA: the static roofline's predicted time (flash_ext.roofline)
    model_bound: Optional[str] = None  # and the resource it says limits the call
    serial_ms: Optional[float] = None  # the model's serial estimate (no overlap of its terms)


def bench_fwd_config(cfg: FwdConfig, device: torch.device, backends: Sequence[str], with_naive: bool,
                     warmup: int, repeats: int, sdpa_layout: str, notes: List[str]) -> FwdRow:
    """Checks and times flash_ext, each SDPA backend and the naive implementation on one problem."""
    flops = attention_flops(cfg.batch, cfg.seqlen, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal)
    row = FwdRow(DTYPE_NAMES[cfg.dtype], cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal, flops)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype) for _ in range(3))
    score_elems = float(cfg.batch) * cfg.nheads * cfg.seqlen * cfg.seqlen

    # The static model's prediction for this GPU, printed next to the measurement so that the first GPU run
    # calibrates it (None for a GPU the model does not know).
    if device.type == "cuda":
        model = flash_ext.explain(q, k, v, causal=cfg.causal, verbose=False).roofline
        if model is not None:
            row.model_ms, row.model_bound, row.serial_ms = model.time * 1e3, model.bound, model.serial * 1e3

    # flash_ext: correctness guard first; a wrong result gets no speed.
    try:
        out = flash_ext.flash_attn_func(q, k, v, causal=cfg.causal)
        ok, row.max_err, row.atol = check_against_sdpa_math(q, k, v, out, cfg.causal)
        del out
    except Exception as exc:  # noqa: BLE001
        free_device_memory(device)
        row.check = "ERR"
        row.impls["flash_ext"] = ImplResult(status="OOM" if is_oom(exc) else "ERR", note=short_error(exc))
        notes.append(f"{cfg.describe()}: flash_ext {row.impls['flash_ext'].status}: {short_error(exc)}")
    else:
        row.check = "PASS" if ok else "FAIL"
        if ok:
            row.impls["flash_ext"] = time_impl(lambda: flash_ext.flash_attn_func(q, k, v, causal=cfg.causal),
                                                device, flops, warmup, repeats)
        else:
            row.impls["flash_ext"] = ImplResult(status="FAIL", note=f"max err {row.max_err:.3g} > tol")
    free_device_memory(device)

    if sdpa_layout == "bhsd":
        qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    else:
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    for name in backends:
        key = f"sdpa:{name}"
        backend = SDPA_BACKENDS[name]
        if device.type == "cpu" and name == "math" and cpu_would_exhaust_ram(3 * 4 * score_elems):
            row.impls[key] = ImplResult(status="skip", note="would exhaust RAM")
            continue

        def call(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=cfg.causal)

        try:  # probe: a backend that cannot run this device/dtype/shape raises here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
        except Exception as exc:  # noqa: BLE001
            free_device_memory(device)
            status = "OOM" if is_oom(exc) else "skip"
            row.impls[key] = ImplResult(status=status, note=short_error(exc))
            msg = f"{key} {status} on {device.type} {DTYPE_NAMES[cfg.dtype]} d={cfg.head_dim}: {short_error(exc)}"
            if status == "skip" and not any(n.startswith(f"{key} skip on {device.type}") for n in notes):
                notes.append(msg)
            elif status != "skip":
                notes.append(f"{cfg.describe()}: {msg}")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.impls[key] = time_impl(call, device, flops, warmup, repeats)
        free_device_memory(device)
    del qs, ks, vs

    if with_naive:
        elem = torch.tensor([], dtype=cfg.dtype).element_size()
        if device.type == "cpu" and cpu_would_exhaust_ram(2 * elem * score_elems):
            row.impls["naive"] = ImplResult(status="skip", note="would exhaust RAM")
        else:
            row.impls["naive"] = time_impl(lambda: naive_attention(q, k, v, causal=cfg.causal), device, flops,
                                            warmup, repeats)
        free_device_memory(device)

    sdpa_ok = {k_: r for k_, r in row.impls.items() if k_.startswith("sdpa:") and r.tflops is not None}
    if sdpa_ok:
        row.best_sdpa = max(sdpa_ok, key=lambda k_: sdpa_ok[k_].tflops or 0.0)
    fl = row.impls.get("flash_ext")
    if fl is not None and fl.tflops is not None:
        if row.best_sdpa is not None:
            row.ratio_best_sdpa = fl.tflops / sdpa_ok[row.best_sdpa].tflops
        if "sdpa:flash" in sdpa_ok:
            row.ratio_sdpa_flash = fl.tflops / sdpa_ok["sdpa:flash"].tflops
        best = sdpa_ok.get(row.best_sdpa) if row.best_sdpa else None
        if fl.cpu_median_s and best is not None and best.cpu_median_s:
            row.ratio_best_sdpa_cpu_time = best.cpu_median_s / fl.cpu_median_s
    return row


def fwd_configs(args: argparse.Namespace, device: torch.device) -> List[FwdConfig]:
    dtype = DTYPES[args.dtype]
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    if args.quick:
        return [FwdConfig(HEADLINE["batch"], HEADLINE["seqlen"], HEADLINE["nheads"], HEADLINE["head_dim"],
                          HEADLINE["causal"], dtype)]
    cuda = device.type == "cuda"
    head_dims = args.headdims or [64, 128]
    seqlens = args.seqlens or ([512, 1024, 2048, 4096, 8192, 16384] if cuda else [512, 1024, 2048])
    configs = []
    for d in head_dims:
        for causal in causals:
            for s in seqlens:
                if args.batch is not None:
                    b = args.batch
                elif cuda:
                    b = max(1, args.tokens // s)
                else:
                    b = 1
                h = args.nheads if args.nheads is not None else (max(1, args.hidden // d) if cuda else 8)
                configs.append(FwdConfig(b, s, h, d, causal, dtype))
    return configs


def _fwd_table(rows: Sequence[FwdRow], device: torch.device, matmul_peak: Optional[float] = None) -> str:
    impl_cols = ["flash_ext"] + [f"sdpa:{n}" for n in SDPA_BACKENDS] + ["naive"]
    # Only columns in which something was measured (or which failed in an interesting way).
    shown = [c for c in impl_cols if any(c in r.impls and r.impls[c].status not in ("skip",) for r in rows)]
    cpu = device.type == "cpu"
    model = any(r.model_ms is not None for r in rows)
    headers = ["dtype", "b", "s", "h", "d", "causal", "flash ms"] + (
        ["model ms", "model bound", "x model", "serial ms", "x serial"] if model else []) + [f"{c} TF/s" for c in shown] + [
        "best sdpa", "x best", "x sdpa:flash"] + (["x best (cpu time)"] if cpu else []) + (
        ["/ matmul"] if matmul_peak else []) + ["max err", "check"]
    table_rows = []
    for r in rows:
        cells = [r.dtype, str(r.batch), str(r.seqlen), str(r.nheads), str(r.head_dim), "Y" if r.causal else "N"]
        fl = r.impls.get("flash_ext")
        cells.append(fmt(fl.median_s * 1e3, 4) if fl is not None and fl.median_s is not None else "-")
        if model:  # x model = measured / overlap bound (1.0: the bound is reached); x serial = measured /
            # serial estimate (below 1.0: the kernel overlaps its units that much)
            measured = fl.median_s * 1e3 if fl is not None and fl.median_s is not None else None
            cells += [fmt(r.model_ms, 4), r.model_bound or "-",
                      fmt(measured / r.model_ms) if measured is not None and r.model_ms else "-",
                      fmt(r.serial_ms, 4) if r.serial_ms else "-",
                      fmt(measured / r.serial_ms) if measured is not None and r.serial_ms else "-"]
        for c in shown:
            ir = r.impls.get(c)
            if ir is None:
                cells.append("-")
            elif ir.tflops is not None:
                cells.append(fmt(ir.tflops))
            else:
                cells.append(ir.status)
        cells += [r.best_sdpa.replace("sdpa:", "") if r.best_sdpa else "-", fmt(r.ratio_best_sdpa),
                  fmt(r.ratio_sdpa_flash)] + ([fmt(r.ratio_best_sdpa_cpu_time)] if cpu else []) + (
                  [fmt(fl.tflops / matmul_peak if fl is not None and fl.tflops else None)] if matmul_peak else []) + [
                  fmt(r.max_err, 2), r.check]
        table_rows.append(cells)
    return format_table(headers, table_rows)


def run_fwd(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    backends = args.backends or list(SDPA_BACKENDS)
    warmup = args.warmup if args.warmup is not None else (10 if device.type == "cuda" else 1)
    repeats = args.repeats if args.repeats is not None else (30 if device.type == "cuda" else 5)
    configs = fwd_configs(args, device)
    notes: List[str] = []
    rows: List[FwdRow] = []
    print(f"fwd: {len(configs)} configurations, warmup {warmup}, median of {repeats}; "
          f"TF/s = TFLOP/s with FLOPs = 4*b*s^2*h*d (/2 causal)", flush=True)
    # The machine's own GEMM rate in this run: the "/ matmul" column divides flash_ext's TF/s by the faster of
    # the benchmark dtype's and fp32's torch.matmul (CPU, 2048^3) or by the benchmark dtype's (CUDA, 8192^3:
    # cuBLAS, on Hopper through wgmma), measured before and after the grid (the max).
    cuda = device.type == "cuda"
    mm_dtypes = [DTYPES[args.dtype]] if cuda else list(dict.fromkeys([DTYPES[args.dtype], torch.float32]))
    mm_n = 8192 if cuda else 2048
    matmul = matmul_peak_tflops(device, mm_dtypes, warmup, repeats, n=mm_n)
    print(f"  torch.matmul ({mm_n}^3 unless @size): " + ", ".join(f"{k} {fmt(v)} TF/s" for k, v in matmul.items()),
          flush=True)
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        row = bench_fwd_config(cfg, device, backends, not args.no_naive, warmup, repeats, args.sdpa_layout, notes)
        rows.append(row)
        fl = row.impls.get("flash_ext")
        print(f"  [{i + 1}/{len(configs)}] {cfg.describe()}: check {row.check}, flash_ext "
              f"{fmt(fl.tflops) if fl and fl.tflops else (fl.status if fl else '-')} TF/s, x best sdpa "
              f"{fmt(row.ratio_best_sdpa)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    after = matmul_peak_tflops(device, mm_dtypes, warmup, repeats, n=mm_n)
    matmul = {k: max(v, after.get(k, 0.0)) for k, v in matmul.items()}
    matmul_peak = max(matmul.values())
    notes.append(f"torch.matmul {mm_n}^3 (unless @size) in this run (best of before/after the grid): "
                 + ", ".join(f"{k} {fmt(v)} TF/s" for k, v in matmul.items())
                 + "; '/ matmul' = flash_ext TF/s over the faster")
    return {
        "results": [asdict(r) for r in rows],
        "matmul_tflops": matmul,
        "notes": notes,
        "timing": {"warmup": warmup, "repeats": repeats, "statistic": "median",
                   "clock": "cuda events" if device.type == "cuda" else "time.perf_counter",
                   "sdpa_layout": args.sdpa_layout},
        "_table": _fwd_table(rows, device, matmul_peak),
        "_rows": rows,
    }
