"""``dropout`` mode: the cost of dropout in the forward pass, time with dropout / time without, same run.

For each configuration ``flash_attn_func`` runs with ``dropout_p=0`` and with ``--dropout-p`` (default 0.1)
on the same inputs, the two calls alternating within one loop (so that a change of machine load hits both
sides alike); the medians and their ratio are reported, from wall time and, on the CPU, from process CPU
time.  SDPA's own dropout (default backend choice, same ``dropout_p``) is timed alongside for context.

Correctness guard: before timing, the dropout output of a call with an explicit ``rng_state`` is compared
with a reference built from the element-wise mask of that state (``flash_ext.dropout.dropout_mask``) over
up to 64 evenly spaced query rows: fp32 probabilities, dropped ones zeroed, ``/ (1 - p)``, ``@ v``.  A
configuration that fails is marked FAIL and reports no flash_ext time.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

import flash_ext
from flash_ext.dropout import dropout_mask
from .common import DTYPES, GUARD_TOL, fmt, format_table, free_device_memory, time_fn


@dataclass
class DropoutRow:
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    plain_s: Optional[float] = None
    dropout_s: Optional[float] = None
    plain_cpu_s: Optional[float] = None
    dropout_cpu_s: Optional[float] = None
    sdpa_plain_s: Optional[float] = None
    sdpa_dropout_s: Optional[float] = None
    check: str = "-"
    max_err: Optional[float] = None

    @property
    def ratio(self) -> Optional[float]:
        return self.dropout_s / self.plain_s if self.dropout_s and self.plain_s else None

    @property
    def cpu_ratio(self) -> Optional[float]:
        return self.dropout_cpu_s / self.plain_cpu_s if self.dropout_cpu_s and self.plain_cpu_s else None


def check_dropout_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool,
                         max_rows: int = 64) -> tuple:
    """(ok, max_abs_err): the op's output with an explicit rng_state against the masked fp32 reference on up
    to ``max_rows`` evenly spaced query rows."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    rs = torch.tensor([0x5EED, 8], dtype=torch.int64, device=q.device)
    out, _, _ = torch.ops.flash_ext.fwd(q, k, v, d ** -0.5, causal, -1, -1, 0.0, None, 0, p, rs)
    rows = torch.linspace(0, sq - 1, steps=min(sq, max_rows), device=q.device).round().long().unique()
    keep = dropout_mask(rs, p, b, h, sq, sk)[:, :, rows]                                   # (b, h, r, sk)
    qs = q[:, rows].float().transpose(1, 2)
    kf = k.float().repeat_interleave(h // hk, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(h // hk, dim=2).transpose(1, 2)
    s = qs @ kf.transpose(-1, -2) * d ** -0.5
    if causal:
        cols = torch.arange(sk, device=q.device)
        s = s.masked_fill(cols.view(1, -1) > rows.view(-1, 1) + (sk - sq), float("-inf"))
    probs = torch.softmax(s, dim=-1)
    ref = (torch.where(keep, probs, torch.zeros_like(probs)) / (1 - p)) @ vf
    got = out[:, rows].float().transpose(1, 2)
    atol, rtol = GUARD_TOL[q.dtype]
    err = (got - ref).abs()
    ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * ref.abs()).all())
    return ok, float(err.max()) if err.numel() else 0.0


def run_dropout(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    p = args.dropout_p
    dtype = DTYPES[args.dtype]
    headdims = args.headdims or ([64] if args.quick else [64, 128])
    seqlens = args.seqlens or (([1024] if args.quick else [1024, 4096, 16384]) if cuda else
                               ([512] if args.quick else [512, 1024, 2048]))
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 7)
    rows: List[DropoutRow] = []
    for d in headdims:
        for s in seqlens:
            for causal in causals:
                h = args.nheads or ((args.hidden // d) if cuda else 8)
                b = args.batch or (max(1, args.tokens // s) if cuda else 1)
                row = DropoutRow(b, s, h, d, causal)
                q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device) for _ in range(3))
                ok, err = check_dropout_output(q, k, v, p, causal)
                row.check, row.max_err = ("PASS" if ok else "FAIL"), err
                plain = lambda: flash_ext.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
                drop = lambda: flash_ext.flash_attn_func(q, k, v, dropout_p=p, causal=causal)  # noqa: E731
                qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
                sdpa_plain = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)  # noqa: E731
                sdpa_drop = lambda: F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)  # noqa: E731
                if ok:
                    t_plain, t_drop, c_plain, c_drop = [], [], [], []
                    for fn in (plain, drop):
                        time_fn(fn, device, warmup, 0)
                    for _ in range(repeats):  # alternate: load changes hit both sides
                        t_plain += time_fn(plain, device, 0, 1, c_plain)
                        t_drop += time_fn(drop, device, 0, 1, c_drop)
                    row.plain_s, row.dropout_s = statistics.median(t_plain), statistics.median(t_drop)
                    if c_plain:
                        row.plain_cpu_s, row.dropout_cpu_s = statistics.median(c_plain), statistics.median(c_drop)
                if not args.no_sdpa:
                    try:
                        row.sdpa_plain_s = statistics.median(time_fn(sdpa_plain, device, warmup, repeats))
                        row.sdpa_dropout_s = statistics.median(time_fn(sdpa_drop, device, warmup, repeats))
                    except RuntimeError:
                        pass
                rows.append(row)
                print(f"  dropout b={b} s={s} h={h} d={d} causal={causal}: check {row.check}, flash_ext "
                      f"{fmt(row.plain_s and row.plain_s * 1e3)} -> {fmt(row.dropout_s and row.dropout_s * 1e3)} ms "
                      f"(x{fmt(row.ratio)}, cpu time x{fmt(row.cpu_ratio)})", flush=True)
                del q, k, v, qt, kt, vt
                free_device_memory(device)
    headers = ["b", "s", "h", "d", "causal", "flash ms p=0", f"flash ms p={p}", "x (wall)", "x (cpu time)",
               "sdpa ms p=0", f"sdpa ms p={p}", "sdpa x", "check"]
    table = [[str(r.batch), str(r.seqlen), str(r.nheads), str(r.head_dim), "Y" if r.causal else "N",
              fmt(r.plain_s and r.plain_s * 1e3), fmt(r.dropout_s and r.dropout_s * 1e3), fmt(r.ratio),
              fmt(r.cpu_ratio), fmt(r.sdpa_plain_s and r.sdpa_plain_s * 1e3),
              fmt(r.sdpa_dropout_s and r.sdpa_dropout_s * 1e3),
              fmt(r.sdpa_dropout_s / r.sdpa_plain_s if r.sdpa_dropout_s and r.sdpa_plain_s else None), r.check]
             for r in rows]
    return {"_table": format_table(headers, table), "_rows": rows, "dropout_p": p,
            "rows": [dict(batch=r.batch, seqlen=r.seqlen, nheads=r.nheads, head_dim=r.head_dim, causal=r.causal,
                          plain_s=r.plain_s, dropout_s=r.dropout_s, plain_cpu_s=r.plain_cpu_s,
                          dropout_cpu_s=r.dropout_cpu_s, sdpa_plain_s=r.sdpa_plain_s,
                          sdpa_dropout_s=r.sdpa_dropout_s, check=r.check, max_err=r.max_err) for r in rows],
            "method": "alternating calls with and without dropout, medians; ratio = with / without"}
