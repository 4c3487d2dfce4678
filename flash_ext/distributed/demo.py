"""``torchrun --nproc_per_node=2 -m flash_ext.distributed.demo``: ring attention over every launched rank.

Each rank builds the same full sequence (fixed seed), keeps its zigzag shard, runs
``zigzag_ring_flash_attn_func`` forward (and backward when the build has it), and rank 0 compares the gathered
result with single-process ``flash_attn_func`` on the full sequence.  gloo on CPU tensors by default; NCCL on
one GPU per rank with ``--device cuda``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import flash_ext
from flash_ext.distributed import shard_sequence, unshard_sequence, zigzag_ring_flash_attn_func
from flash_ext.distributed.ring import _bwd_op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seqlen", type=int, default=2048, help="global sequence length (divisible by 2 * world)")
    p.add_argument("--nheads", type=int, default=8)
    p.add_argument("--nheads-k", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)  # the same full sequence on every rank, for the comparison below
    dtype = torch.bfloat16
    full = [torch.randn(1, args.seqlen, h, args.head_dim, dtype=dtype)
            for h in (args.nheads, args.nheads_k, args.nheads_k)]
    dout_full = torch.randn(1, args.seqlen, args.nheads, args.head_dim, dtype=dtype)
    q, k, v = (shard_sequence(t, rank, world, zigzag=True).to(device).requires_grad_() for t in full)

    t0 = time.perf_counter()
    out = zigzag_ring_flash_attn_func(q, k, v, causal=True)
    has_bwd = _bwd_op() is not None
    if has_bwd:
        out.backward(shard_sequence(dout_full, rank, world, zigzag=True).to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out.detach().contiguous())
    if has_bwd:
        grads = []
        for g in (q.grad, k.grad, v.grad):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous())
            grads.append(unshard_sequence([t.cpu() for t in parts], zigzag=True))
    if rank == 0:
        ring_out = unshard_sequence([t.cpu() for t in gathered], zigzag=True)
        leaves = [t.clone().requires_grad_() for t in full]
        ref = flash_ext.flash_attn_func(*leaves, causal=True)
        print(f"world {world}, seqlen {args.seqlen} ({args.seqlen // world} per rank), bf16, causal zigzag ring on "
              f"{device.type}: {'forward + backward' if has_bwd else 'forward'} {elapsed * 1e3:.1f} ms on rank 0")
        print(f"max |ring - single-process flash_attn_func| out: {(ring_out.float() - ref.float()).abs().max():.3e}")
        if has_bwd:
            ref_grads = torch.autograd.grad(ref, leaves, dout_full)
            for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
                print(f"max |ring - single-process| {name}: {(g.float() - r.float()).abs().max():.3e}")
        kv_bytes = 2 * k.numel() * k.element_size()
        print(f"bytes sent per rank per step: forward {kv_bytes} (K/V shard) x {world - 1} steps"
              + (f"; backward {kv_bytes} + {2 * k.numel() * 4} (fp32 dK/dV) per step" if has_bwd else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
