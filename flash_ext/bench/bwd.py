"""``bwd`` and ``fwd+bwd`` modes: the training side of attention, flash_ext against each torch SDPA backend and
naive attention (autograd through materialised S and P).

``bwd`` times the backward alone: the forward runs once, untimed, and each timed call is
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` (gradients returned, not accumulated into
``.grad``).  ``fwd+bwd`` times ``torch.autograd.grad(attn(q, k, v), (q, k, v), dout)``, a training step's
attention.  FLOPs: the backward's five matmuls are 2.5x the forward's two (FlashAttention-2's convention),
so ``bwd`` counts 2.5x and ``fwd+bwd`` 3.5x the forward FLOPs of ``attention_flops``.

Before a configuration is timed, flash_ext's gradients are compared with SDPA's MATH backend run in fp32 on
the same (rounded) inputs (when that fits in memory; else with the fastest SDPA backend in the input dtype):
max|g - g_ref| <= tol * max|g_ref| for dq, dk and dv (bf16 3e-2, fp16 5e-3, fp32 1e-3), else FAIL and no speed.
"""
from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from .common import (
    DTYPE_NAMES, ImplResult, SDPA_BACKENDS, attention_flops, cpu_would_exhaust_ram, fmt, free_device_memory, is_oom,
    naive_attention, short_error, time_impl,
)
from .fwd import FwdConfig, FwdRow, _fwd_table, fwd_configs

#: Backward FLOPs per forward FLOP (five matmuls against two).
BWD_FLOP_FACTOR = 2.5

#: Relative tolerance of the gradient guard (max error / max magnitude).
GRAD_GUARD_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def step_flops(cfg: FwdConfig, mode: str) -> float:
    fwd = attention_flops(cfg.batch, cfg.seqlen, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal)
    return fwd * (BWD_FLOP_FACTOR if mode == "bwd" else 1.0 + BWD_FLOP_FACTOR)


def grad_step(attn: Attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
              mode: str) -> Callable[[], Tuple[torch.Tensor, ...]]:
    """The timed callable: the backward of a retained graph (``bwd``) or forward + backward (``fwd+bwd``)."""
    if mode == "bwd":
        out = attn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), dout)


def _leaves(tensors: Sequence[torch.Tensor], layout: str) -> List[torch.Tensor]:
    if layout == "bshd":
        return [t.detach().clone().requires_grad_() for t in tensors]
    return [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in tensors]


def _reference_grads(q, k, v, dout, causal: bool, backends: Sequence[str]) -> Tuple[Optional[tuple], str]:
    """Gradients in (b, s, h, d) from SDPA MATH in fp32 when it fits in memory, else from the first SDPA
    backend that runs in the input dtype; (None, why) if none does."""
    b, s, h, d = q.shape
    candidates = []
    math_bytes = 6 * 4 * b * h * s * s  # S, P, their gradients and temporaries in fp32
    fits = (torch.cuda.mem_get_info(q.device)[0] > 2 * math_bytes if q.device.type == "cuda"
            else not cpu_would_exhaust_ram(math_bytes))
    if fits:
        candidates.append(("math", torch.float32))
    candidates += [(n, q.dtype) for n in backends if n != "math"]
    for name, dtype in candidates:
        try:
            qs, ks, vs = (t.detach().to(dtype).transpose(1, 2).requires_grad_() for t in (q, k, v))
            with warnings.catch_warnings(), sdpa_kernel(SDPA_BACKENDS[name]):
                warnings.simplefilter("ignore")
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                grads = torch.autograd.grad(out, (qs, ks, vs), dout.to(dtype).transpose(1, 2))
            return tuple(g.transpose(1, 2) for g in grads), f"sdpa:{name} {DTYPE_NAMES[dtype]}"
        except Exception:  # noqa: BLE001 - try the next reference
            free_device_memory(q.device)
    return None, "no reference ran"


def bench_bwd_config(cfg: FwdConfig, device: torch.device, mode: str, backends: Sequence[str], with_naive: bool,
                     warmup: int, repeats: int, sdpa_layout: str, notes: List[str]) -> FwdRow:
    flops = step_flops(cfg, mode)
    row = FwdRow(DTYPE_NAMES[cfg.dtype], cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim, cfg.causal, flops)
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (cfg.batch, cfg.seqlen, cfg.nheads, cfg.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(device=device, dtype=cfg.dtype) for _ in range(4))
    score_elems = float(cfg.batch) * cfg.nheads * cfg.seqlen * cfg.seqlen

    def flash(q_, k_, v_):
        return flash_ext.flash_attn_func(q_, k_, v_, causal=cfg.causal)

    leaves = _leaves((q, k, v), "bshd")
    try:
        grads = grad_step(flash, *leaves, dout, "fwd+bwd")()
        ref, ref_name = _reference_grads(q, k, v, dout, cfg.causal, backends)
        if ref is None:
            row.check, row.impls["flash_ext"] = "ERR", ImplResult(status="ERR", note=ref_name)
            notes.append(f"{cfg.describe()}: no reference gradient: {ref_name}")
        else:
            errs = [float((g.float() - r.float()).abs().max()) / max(float(r.float().abs().max()), 1e-30)
                    for g, r in zip(grads, ref)]
            row.max_err, row.atol = max(errs), GRAD_GUARD_TOL[cfg.dtype]
            ok = all(torch.isfinite(g).all() for g in grads) and row.max_err <= row.atol
            row.check = "PASS" if ok else "FAIL"
            if ok:
                row.impls["flash_ext"] = time_impl(grad_step(flash, *leaves, dout, mode), device, flops, warmup,
                                                    repeats)
            else:
                row.impls["flash_ext"] = ImplResult(status="FAIL", note=f"max rel err {row.max_err:.3g} vs {ref_name}")
        del grads, ref
    except Exception as exc:  # noqa: BLE001
        row.check = "ERR"
        row.impls["flash_ext"] = ImplResult(status="OOM" if is_oom(exc) else "ERR", note=short_error(exc))
        notes.append(f"{cfg.describe()}: flash_ext {row.impls['flash_ext'].status}: {short_error(exc)}")
    free_device_memory(device)

    sdpa_leaves = _leaves((q, k, v), "bshd" if sdpa_layout == "bshd-view" else "bhsd")
    sdpa_dout = dout.transpose(1, 2) if sdpa_layout == "bshd-view" else dout.transpose(1, 2).contiguous()
    if sdpa_layout == "bshd-view":
        sdpa_leaves = [t.transpose(1, 2) for t in sdpa_leaves]  # views of (b, s, h, d) leaves
    for name in backends:
        key = f"sdpa:{name}"
        if device.type == "cpu" and name == "math" and cpu_would_exhaust_ram(6 * 4 * score_elems):
            row.impls[key] = ImplResult(status="skip", note="would exhaust RAM")
            continue

        def sdpa(q_, k_, v_, backend: SDPBackend = SDPA_BACKENDS[name]):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=cfg.causal)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                grad_step(sdpa, *sdpa_leaves, sdpa_dout, "fwd+bwd")()
        except Exception as exc:  # noqa: BLE001
            free_device_memory(device)
            status = "OOM" if is_oom(exc) else "skip"
            row.impls[key] = ImplResult(status=status, note=short_error(exc))
            msg = f"{key} {status} on {device.type} {DTYPE_NAMES[cfg.dtype]} d={cfg.head_dim}: {short_error(exc)}"
            if not any(n.startswith(f"{key} {status} on {device.type}") for n in notes):
                notes.append(msg)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.impls[key] = time_impl(grad_step(sdpa, *sdpa_leaves, sdpa_dout, mode), device, flops, warmup, repeats)
        free_device_memory(device)
    del sdpa_leaves, sdpa_dout

    if with_naive:
        elem = torch.tensor([], dtype=cfg.dtype).element_size()
        if device.type == "cpu" and cpu_would_exhaust_ram(4 * elem * score_elems):
            row.impls["naive"] = ImplResult(status="skip", note="would exhaust RAM")
        else:
            row.impls["naive"] = time_impl(
                grad_step(lambda a, b, c: naive_attention(a, b, c, causal=cfg.causal), *_leaves((q, k, v), "bshd"),
                          dout, mode), device, flops, warmup, repeats)
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


def run_bwd(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    mode = args.mode
    backends = args.backends or list(SDPA_BACKENDS)
    warmup = args.warmup if args.warmup is not None else (10 if device.type == "cuda" else 1)
    repeats = args.repeats if args.repeats is not None else (30 if device.type == "cuda" else 5)
    configs = fwd_configs(args, device)
    notes: List[str] = []
    rows: List[FwdRow] = []
    factor = BWD_FLOP_FACTOR if mode == "bwd" else 1 + BWD_FLOP_FACTOR
    print(f"{mode}: {len(configs)} configurations, warmup {warmup}, median of {repeats}; TF/s = TFLOP/s with "
          f"FLOPs = {factor} x 4*b*s^2*h*d (/2 causal)", flush=True)
    for i, cfg in enumerate(configs):
        t0 = time.perf_counter()
        row = bench_bwd_config(cfg, device, mode, backends, not args.no_naive, warmup, repeats, args.sdpa_layout,
                               notes)
        rows.append(row)
        fl = row.impls.get("flash_ext")
        print(f"  [{i + 1}/{len(configs)}] {cfg.describe()}: check {row.check}, flash_ext "
              f"{fmt(fl.tflops) if fl and fl.tflops else (fl.status if fl else '-')} TF/s, x best sdpa "
              f"{fmt(row.ratio_best_sdpa)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {
        "results": [asdict(r) for r in rows],
        "notes": notes,
        "timing": {"warmup": warmup, "repeats": repeats, "statistic": "median", "flop_factor": factor,
                   "clock": "cuda events" if device.type == "cuda" else "time.perf_counter",
                   "sdpa_layout": args.sdpa_layout},
        "_table": _fwd_table(rows, device),
        "_rows": rows,
    }
