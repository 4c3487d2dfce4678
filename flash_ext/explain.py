"""``flash_ext.explain``: which specialisation a call would run, and why — or every reason it cannot run."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch

from . import _C, _ops  # noqa: F401
from .interface import _prepare_qkv, _python_arg_errors, _stand_ins, refusal_reasons
from .roofline import Roofline, gpu_spec, predict_plan

__all__ = ["explain", "explain_call", "Explanation"]


@dataclasses.dataclass
class Explanation:
    """The plan for one call (see ``explain`` and ``explain_call``).  ``ok`` is False when nothing can run;
    ``reasons`` then lists every unmet requirement.  An empty ``plan`` with ``ok``: nothing to compute."""

    ok: bool
    reasons: list
    plan: dict
    hbm_bytes: int = 0
    naive_hbm_bytes: int = 0
    roofline: Optional[Roofline] = None  # the static model's prediction on a named GPU (explain(gpu=...))
    roofline_note: str = ""  # why a requested roofline is absent

    def __str__(self) -> str:
        if not self.ok:
            return "flash_ext: this call cannot run:\n" + "\n".join(f"  - {r}" for r in self.reasons)
        if not self.plan:
            return "flash_ext: no kernel would run (nothing to compute, or a function that calls no flash_ext op)"
        p = self.plan
        flags = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in p["flags"].items())
        kp = p.get("kernel_problem", {})
        lines = [
            f"device      {p['device']}",
            f"backend     {p['backend']}",
            *([f"problem     batch {kp['b']}, {kp['h']} query heads on {kp['h_k']} K/V heads, "
               f"seqlen_q {kp['seqlen_q']}, seqlen_k {kp['seqlen_k']} as the kernel sees it"
               + (" (varlen: per-sequence lengths up to these)" if p.get("varlen") else "")] if kp else []),
            *([f"cpu isa     {p['cpu_isa']} (micro-kernels chosen at run time; FLASH_EXT_CPU_ISA forces a level)"]
              if p.get("cpu_isa") else []),
            f"head dim    {p['head_dim']} -> tile {p['head_dim_tile']}"
            + ("" if p["head_dim"] == p["head_dim_tile"] else " (padding predicated, even_k=no)"),
            f"tile        {p['block_m']} x {p['block_n']} (query rows x keys), {p['threads_per_cta']} threads/CTA"
            + ("" if p["backend"].startswith("host") else f", {p['ctas_per_sm']} CTA(s) resident per SM"),
            f"variant     {p['variant']}",
            f"flags       {flags}",
            f"window      {tuple(p['window'])} (after FA2 normalisation; -1 = unbounded)",
            f"smem        {p['smem_bytes']} bytes per CTA",
            f"grid        {tuple(p['grid'])} = "
            + ("(m_blocks, batch, heads x splits) work items" if p["backend"].startswith("host")
               else "CTAs: x = m_blocks; (batch, head, split) folded over y and z"),
            f"kv splits   {p['num_splits']}",
            f"HBM bytes   ~{self.hbm_bytes / 2**20:.1f} MiB estimated (naive attention materialising S and P: "
            f"~{self.naive_hbm_bytes / 2**20:.1f} MiB, {self.naive_hbm_bytes / max(self.hbm_bytes, 1):.1f}x)",
        ]
        if self.roofline_note:
            lines.append(f"roofline    n/a: {self.roofline_note}")
        if self.roofline is not None:
            r = self.roofline
            lines += [
                f"roofline    {r.gpu.name} (static model; measured on an H200 only): tile {r.block_m} x "
                f"{r.block_n}, {r.num_warps} warps, {r.num_splits} split(s), {r.ctas} CTAs, {r.ctas_per_sm} per SM",
                f"            {r.time * 1e6:.1f} us if the units overlap fully, {r.serial * 1e6:.1f} us if not at "
                f"all; bound by {r.bound}; tensor cores {r.t_tensor * 1e6:.1f} us, shared memory "
                f"{r.t_smem * 1e6:.1f} us ({r.fma_per_smem_byte:.1f} FMA/B, bar {r.gpu.fma_per_smem_byte_bar:.1f}), "
                f"special functions {r.t_sfu * 1e6:.1f} us, HBM {r.t_hbm * 1e6:.1f} us, CTA schedule "
                f"{r.t_schedule * 1e6:.1f} us",
            ]
        return "\n".join(lines)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 0,
    *,
    gpu: Optional[str] = None,
    verbose: bool = True,
) -> Explanation:
    """Describe what ``flash_attn_func`` would run for these arguments, without running it.

    Reports the device path (on the CPU also the instruction-set level whose micro-kernels run), the traits
    (tile M/N, threads), the flag values the kernel is specialised on
    and the compiled variant chosen, shared memory, grid, number of KV splits, and estimated HBM traffic vs
    naive attention.  If the call cannot run, ``ok`` is False and ``reasons`` lists every reason.  Prints
    the explanation unless ``verbose=False``.  Set ``FLASH_EXT_LOG=1`` to log the plan of every call;
    ``explain_call`` explains varlen, KV-cache and packed calls.

    ``gpu`` ("A100", "H100", "H200") adds the static roofline of ``flash_ext.roofline`` for the plan on that
    GPU: the limiting resource (tensor cores, shared memory, HBM, waves/occupancy) and the predicted time.
    On a CPU tensor it uses the tile and split count the op would choose on that GPU.  On a CUDA tensor
    the device's own model is used when it is one of those GPUs.
    """
    # What flash_attn_func checks in Python first; the plan below is then made with neutral stand-ins for
    # those arguments, so that the op's reasons are listed beside them.
    reasons = _python_arg_errors(dropout_p, window_size, softmax_scale)
    dropout_p, window_size, softmax_scale = _stand_ins(reasons, dropout_p, window_size, softmax_scale)
    q, k, v, softmax_scale, _ = _prepare_qkv(q, k, v, softmax_scale, rank=4)
    # The plan is the C++ dispatcher's own decision (the same code the op runs), not a re-derivation.
    plan: dict[str, Any] = _C.plan_fwd(q, k, v, softmax_scale, bool(causal), int(window_size[0]),
                                       int(window_size[1]), float(softcap), alibi_slopes, int(num_splits),
                                       float(dropout_p))
    reasons += plan.get("reasons", [])
    return _explanation(plan, reasons, q, gpu, int(num_splits), verbose)


def _explanation(plan: dict, reasons: list, q: torch.Tensor, gpu: Optional[str], num_splits: int,
                 verbose: bool) -> Explanation:
    """The Explanation of a plan (with the roofline on a named GPU, or on q's own when it is a known one)."""
    ok = plan.get("ok", False) and not reasons
    roofline = None
    if gpu is not None:
        spec = gpu_spec(gpu)  # ValueError naming the known GPUs
    elif q.is_cuda:
        try:
            spec = gpu_spec(torch.cuda.get_device_name(q.device))
        except ValueError:
            spec = None
    else:
        spec = None
    note = ""
    if ok and spec is not None:
        if q.dtype in (torch.float16, torch.bfloat16):
            roofline = predict_plan(plan, spec, requested_splits=num_splits)
        else:
            note = f"the GPU kernels take float16/bfloat16, not {q.dtype}"
    result = Explanation(ok=ok, reasons=reasons, plan=plan, hbm_bytes=plan.get("hbm_bytes", 0),
                         naive_hbm_bytes=plan.get("naive_hbm_bytes", 0), roofline=roofline, roofline_note=note)
    if verbose:
        print(result)
    return result


def explain_call(fn: Callable[..., Any], *args: Any, gpu: Optional[str] = None, verbose: bool = True,
                 **kwargs: Any) -> Explanation:
    """Describe what ``fn(*args, **kwargs)`` would run, for any flash_ext forward function —
    ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache`` (decode included) and the packed
    variants — without running it.

    The call goes through its real path (Python checks, the op's checks and index values, the decisions of the
    dispatcher: padding, the decode query-group swap, KV splits) with the ops in plan-only mode
    (``_C.plan_only``): the launch records its plan instead of running a kernel, a KV cache is not appended to,
    and no random generator is drawn.  Returns the Explanation of the last launch (``ok`` False with every
    reason when the call is refused; a call that launches nothing, such as an empty batch, reports ``ok``
    with an empty plan).  ``gpu`` as in ``explain``; for varlen the roofline models every sequence at
    the maximum length.
    """
    q = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if q is None:
        raise TypeError("explain_call: no tensor among the arguments")
    try:
        with torch.no_grad():
            plan = _C.plan_only(fn, *args, **kwargs)
    except (ValueError, RuntimeError) as e:
        result = Explanation(ok=False, reasons=refusal_reasons(e), plan={})
        if verbose:
            print(result)
        return result
    if plan is None:
        result = Explanation(ok=True, reasons=[], plan={})
        if verbose:
            print(result)
        return result
    return _explanation(plan, [], q, gpu, int(kwargs.get("num_splits", 0) or 0), verbose)
