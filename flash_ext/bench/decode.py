"""``decode`` mode: one query token per sequence against a KV cache; GB/s of K/V read per step."""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import flash_ext
from .common import (
    DTYPES, check_against_sdpa_math, fmt, format_table, free_device_memory, read_bandwidth_gbs, repeats_for,
    time_fn,
)



#: Decode steps cycle through this many bytes of K/V caches by default (``--kv-layers 0``): more than the
#: last-level cache of the machines measured (CPU L3 32 MiB, H200 L2 60 MB), so each step reads its cache
#: from memory, as one layer's step of a model does.
ROTATE_BYTES = 512 << 20

#: At most this many caches per row (a short cache of a big model would otherwise need thousands).
MAX_LAYERS = 256

#: Without ``--repeats``, each side of a row is timed for at least this long (repeats_for): a CPU step of a 4k
#: cache takes ~0.3 ms, so the default 5 calls were a 1.5 ms sample of a VM whose speed moves by 30% from one
#: moment to the next (docs/perf.md).
MIN_TIMED_SECONDS = 0.25


def kv_layers(requested: int, kv_bytes: int) -> int:
    """Caches a decode row cycles through: ``requested`` when positive, else enough for ROTATE_BYTES."""
    if requested > 0:
        return requested
    return max(1, min(MAX_LAYERS, -(-ROTATE_BYTES // kv_bytes)))


@dataclass
class DecodeRow:
    """One decode step (one query token per sequence) against a KV cache of seqlen_k keys."""

    seqlen_k: int
    kv_bytes: int
    layers: int = 1
    num_splits: int = 1
    steps: Tuple[int, int] = (0, 0)  # timed calls of flash_ext and of SDPA
    read_gbs: Optional[float] = None  # the read bandwidth measured just before and after flash_ext's steps
    flash_s: Optional[float] = None
    sdpa_s: Optional[float] = None
    check: str = "-"
    max_err: Optional[float] = None
    model_s: Optional[float] = None  # CUDA: the static roofline's predicted step time (flash_ext.roofline)
    model_bound: Optional[str] = None

    @property
    def flash_gbs(self) -> Optional[float]:
        return self.kv_bytes / self.flash_s / 1e9 if self.flash_s else None

    @property
    def sdpa_gbs(self) -> Optional[float]:
        return self.kv_bytes / self.sdpa_s / 1e9 if self.sdpa_s else None


def copy_bandwidth_gbs(device: torch.device, nbytes: int, warmup: int, repeats: int) -> float:
    """Device copy bandwidth, counting bytes read plus bytes written, measured in this run: the ceiling a
    memory-bound decode step can approach."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def run_decode(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    """GB/s of K/V read per decode step for flash_ext.flash_attn_with_kvcache (split-KV by the heuristic)
    and torch SDPA (default backend choice, GQA), against the device copy bandwidth."""
    cuda = device.type == "cuda"
    b = args.batch or (8 if cuda else 1)
    h = args.nheads or (32 if cuda else 8)
    hk = args.kv_heads or max(1, h // 4)
    if h % hk:
        print(f"error: --kv-heads: got {hk}; must divide the {h} query heads (--nheads)", file=sys.stderr)
        raise SystemExit(2)
    d = (args.headdims or [128])[0]
    seqlens = args.seqlens or ([4096, 8192, 16384, 32768, 65536, 131072] if cuda else [4096, 16384])
    dtype = DTYPES[args.dtype]
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    repeats = args.repeats if args.repeats is not None else (30 if cuda else 5)
    ceiling_bytes = (1 << 31) if cuda else (1 << 28)  # far past the last-level cache: read from memory
    copy_gbs = copy_bandwidth_gbs(device, ceiling_bytes, warmup, repeats)
    read_src = torch.empty(ceiling_bytes // 4, dtype=torch.float32, device=device).normal_()
    read_gbs = read_bandwidth_gbs(read_src, warmup, repeats)
    rows: List[DecodeRow] = []
    for sk in seqlens:
        kv_bytes = 2 * b * sk * hk * d * torch.tensor([], dtype=dtype).element_size()
        row = DecodeRow(seqlen_k=sk, kv_bytes=kv_bytes, layers=kv_layers(args.kv_layers, kv_bytes))
        q = torch.randn(b, 1, h, d, dtype=dtype, device=device)
        caches = [(torch.randn(b, sk, hk, d, dtype=dtype, device=device),
                   torch.randn(b, sk, hk, d, dtype=dtype, device=device)) for _ in range(row.layers)]
        k_cache, v_cache = caches[0]
        explained = flash_ext.explain(q, k_cache, v_cache, verbose=False)
        row.num_splits = explained.plan.get("num_splits", 1)
        if explained.roofline is not None:  # a GPU the model knows: its prediction next to the measurement
            row.model_s, row.model_bound = explained.roofline.time, explained.roofline.bound

        # Each call reads the next cache (both sides the same sequence of caches).
        step = {"flash": 0, "sdpa": 0}

        def next_cache(who: str) -> Tuple[torch.Tensor, torch.Tensor]:
            step[who] += 1
            return caches[step[who] % len(caches)]

        def flash() -> torch.Tensor:
            k, v = next_cache("flash")
            return flash_ext.flash_attn_with_kvcache(q, k, v, cache_seqlens=sk)

        qt = q.transpose(1, 2)

        def sdpa() -> torch.Tensor:
            k, v = next_cache("sdpa")
            return F.scaled_dot_product_attention(qt, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

        out = flash_ext.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=sk)
        ok, err, _ = check_against_sdpa_math(q, k_cache, v_cache, out, causal=False)
        row.check, row.max_err = ("PASS" if ok else "FAIL"), err
        flash_steps = sdpa_steps = 0
        if ok:
            time_fn(flash, device, warmup, 0)
            flash_steps = repeats_for(flash, device, args.repeats, repeats, MIN_TIMED_SECONDS)
            # The ceiling measured around the steps, not once per run: this VM's memory moved between 29 and
            # 42 GB/s from one run to the next (docs/perf.md), and a share is only meaningful against its own.
            before = read_bandwidth_gbs(read_src, 1, repeats)
            row.flash_s = statistics.median(time_fn(flash, device, 0, flash_steps))
            row.read_gbs = (before + read_bandwidth_gbs(read_src, 1, repeats)) / 2
        try:
            time_fn(sdpa, device, warmup, 0)
            sdpa_steps = repeats_for(sdpa, device, args.repeats, repeats, MIN_TIMED_SECONDS)
            row.sdpa_s = statistics.median(time_fn(sdpa, device, 0, sdpa_steps))
        except RuntimeError:
            row.sdpa_s = None
        row.steps = (flash_steps, sdpa_steps)
        rows.append(row)
        print(f"  decode b={b} h={h} hk={hk} d={d} sk={sk}: {row.layers} cache(s), splits {row.num_splits}, "
              f"check {row.check}, steps {row.steps[0]}/{row.steps[1]}, "
              f"flash_ext {fmt(row.flash_gbs)} GB/s, sdpa {fmt(row.sdpa_gbs)} GB/s", flush=True)
        del q, k_cache, v_cache, caches
        free_device_memory(device)
    headers = ["b", "h", "hk", "d", "seqlen_k", "caches", "splits", "flash GB/s", "model GB/s", "model bound", "sdpa GB/s",
               "read GB/s", "copy GB/s", "flash/read", "flash/sdpa", "check"]
    table_rows = [[str(b), str(h), str(hk), str(d), str(r.seqlen_k), str(r.layers), str(r.num_splits), fmt(r.flash_gbs),
                   fmt(r.kv_bytes / r.model_s / 1e9 if r.model_s else None), r.model_bound or "-",
                   fmt(r.sdpa_gbs), fmt(r.read_gbs or read_gbs), fmt(copy_gbs),
                   fmt(r.flash_gbs / (r.read_gbs or read_gbs) if r.flash_gbs else None),
                   fmt(r.flash_gbs / r.sdpa_gbs if r.flash_gbs and r.sdpa_gbs else None), r.check] for r in rows]
    return {"_table": format_table(headers, table_rows), "_rows": rows, "copy_gbs": copy_gbs, "read_gbs": read_gbs,
            "rows": [dict(seqlen_k=r.seqlen_k, layers=r.layers, num_splits=r.num_splits, steps=list(r.steps),
                          flash_gbs=r.flash_gbs, sdpa_gbs=r.sdpa_gbs, read_gbs=r.read_gbs,
                          check=r.check, max_err=r.max_err, model_s=r.model_s, model_bound=r.model_bound)
                     for r in rows],
            "method": ("GB/s = bytes of K and V read / median step time (without --repeats: of as many steps as "
                       "fill %.2f s per side, at least the default count); each step reads the next of `layers` "
                       "caches (by default enough for %d MiB, so that a step reads from memory as one layer of a "
                       "model does); read GB/s: a large tensor.sum() (the ceiling of a memory-bound step), the mean of "
                       "its medians just before and just after flash_ext's steps of the row; copy GB/s counts read + write" % (MIN_TIMED_SECONDS, ROTATE_BYTES >> 20))}
