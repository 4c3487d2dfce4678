"""A transformers model running on flash_ext: ``python -m flash_ext.integrations.demo``.

Needs Hugging Face transformers (``pip install '.[transformers]'``); downloads nothing: the model is a small
Llama-style decoder (grouped-query attention: 8 query heads share 2 K/V heads, head dim 64, rotary
embeddings) built from a config with random weights.

1. Generation: a left-padded batch of three prompts of different lengths, 20 greedy tokens, once with
   transformers' eager attention and once with ``attn_implementation="fx_attention"`` (same weights).  In
   fp32 (the CPU default) the tokens must be identical; in bf16 (CUDA, where flash_ext takes fp16/bf16)
   greedy decoding may legitimately part ways after a near tie, so the agreement is reported and the
   prefill logits are checked instead (cosine >= 0.999).
2. Memory: the peak extra memory of one forward pass of the model (no KV cache, batch 1) at a few
   sequence lengths, eager vs flash_ext, measured as ``python -m flash_ext.bench memory`` measures it
   (CPU: peak RSS; CUDA: ``max_memory_allocated``).  Eager attention holds each layer's
   ``heads x seqlen x seqlen`` score and probability matrices, flash_ext never forms them.

Exit status 1 if a check fails, 2 if transformers is missing.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Optional, Sequence

import torch

import flash_ext
from flash_ext import bench
from flash_ext.bench.common import default_device, device_name

MiB = 1024 * 1024


def build_model(device: torch.device, dtype: torch.dtype, layers: int = 2, attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                         initializer_range=0.1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    model.set_attn_implementation(attn)
    return model


def run_generation(device: torch.device, dtype: torch.dtype, name: str) -> bool:
    eager = build_model(device, dtype)
    fx = copy.deepcopy(eager)
    fx.set_attn_implementation(name)
    lengths = (24, 17, 9)
    seqlen = max(lengths)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (len(lengths), seqlen), generator=gen).to(device)
    mask = torch.zeros(len(lengths), seqlen, dtype=torch.long, device=device)
    for row, n in enumerate(lengths):
        mask[row, seqlen - n:] = 1                    # left padding, as for batched generation
    print(f"Generation: Llama-style decoder (8 query heads, 2 K/V heads, head dim 64, 2 layers, random weights), "
          f"{str(dtype).replace('torch.', '')}, prompts of {lengths} tokens left-padded to {seqlen}, 20 greedy tokens")
    tokens, seconds = {}, {}
    with torch.no_grad():
        for label, model in (("eager", eager), (name, fx)):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                 pad_token_id=0)
            seconds[label] = time.perf_counter() - t0
            tokens[label] = out[:, seqlen:]
        keep = mask.bool()
        ref, got = eager(ids, attention_mask=mask).logits[keep], fx(ids, attention_mask=mask).logits[keep]
    cosine = torch.nn.functional.cosine_similarity(ref.double().flatten(), got.double().flatten(), dim=0).item()
    same = (tokens["eager"] == tokens[name]).float().mean().item()
    for label in tokens:
        print(f"  {label:>12}: {seconds[label]:6.2f} s (after a warm-up call)   first row: "
              f"{tokens[label][0, :10].tolist()} ...")
    exact = dtype == torch.float32
    ok = cosine >= (0.9999 if exact else 0.999) and (same == 1.0 or not exact)
    print(f"  prefill logits cosine vs eager {cosine:.6f}; generated tokens identical: {same * 100:.0f} %"
          f"{'' if exact else ' (bf16: near ties may part ways; not a failure)'}  -> {'ok' if ok else 'FAIL'}")
    return ok


def run_memory(device: torch.device, dtype: torch.dtype, name: str, seqlens: Sequence[int]) -> None:
    model = build_model(device, dtype)
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
           else "peak RSS (VmHWM reset via /proc/self/clear_refs)")
    print(f"\nMemory: peak extra memory of one forward pass of the same model (batch 1, no KV cache), "
          f"measured by {how}")
    print(f"  {'seqlen':>7} {'eager':>12} {name:>14} {'ratio':>8}")
    for seqlen in seqlens:
        ids = torch.randint(3, 256, (1, seqlen), generator=torch.Generator().manual_seed(seqlen)).to(device)
        peaks = {}
        for attn in ("eager", name):
            model.set_attn_implementation(attn)
            with torch.no_grad():
                model.model(ids[:, :8])                                  # warm-up (allocator, thread pools)
                result = bench.measure_peak_extra_memory(lambda x=ids: model.model(x).last_hidden_state, device,
                                                         cross_check=False)
            peaks[attn] = result.get("cuda_alloc", result.get("rss"))
        e, f = peaks["eager"], peaks[name]
        if e is None or f is None:
            print(f"  {seqlen:>7} not measurable here")
            continue
        print(f"  {seqlen:>7} {e / MiB:>9.1f} MiB {f / MiB:>11.1f} MiB {e / max(f, 1):>7.1f}x")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flash_ext.integrations.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if a GPU is visible and the build has CUDA kernels, else cpu")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="memory section sequence lengths (default: CPU 1024 2048 4096; CUDA 2048 4096 8192)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory section")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
        from flash_ext.integrations import transformers as fx_transformers
        name = fx_transformers.register()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device) if args.device else default_device()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    print(f"flash_ext {flash_ext.__version__}, transformers {transformers.__version__}, torch {torch.__version__} "
          f"on {device_name(device)}, {torch.get_num_threads()} threads\n")
    ok = run_generation(device, dtype, name)
    if not args.no_memory:
        seqlens = args.seqlens or ([2048, 4096, 8192] if device.type == "cuda" else [1024, 2048, 4096])
        run_memory(device, dtype, name, seqlens)
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'} ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
