"""Multi-process harness of the ring tests: spawns ``world`` CPU processes joined by a gloo process group on a
free localhost port, runs a list of cases in each (in the same order on every rank), and returns every rank's
results.  Bounded everywhere: the process group has a short timeout, the parent kills the processes at a
deadline, and a rank that fails writes its traceback, which the parent raises.

The parent prepares the full-sequence inputs; each rank cuts its own shard with ``positions`` (derived here as
ring-flash-attention's tests do, independently of flash_ext.distributed) and the parent puts the shards' results
back at the same positions.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.multiprocessing as mp

PG_TIMEOUT_S = 20.0


def positions(rank: int, world: int, s_local: int, zigzag: bool) -> torch.Tensor:
    """Global positions of a rank's local rows: ``chunk(W)[r]``, or zigzag chunks ``r`` and ``2W - 1 - r``."""
    seq = torch.arange(world * s_local)
    if not zigzag:
        return seq.chunk(world)[rank]
    c = seq.chunk(2 * world)
    return torch.cat([c[rank], c[2 * world - 1 - rank]])


def shard(x: torch.Tensor, rank: int, world: int, zigzag: bool, dim: int = 1) -> torch.Tensor:
    return x.index_select(dim, positions(rank, world, x.shape[dim] // world, zigzag)).contiguous()


def unshard(parts: List[torch.Tensor], zigzag: bool, dim: int = 1) -> torch.Tensor:
    """Full-sequence tensor from every rank's shard (``dim``: the sequence dimension)."""
    world = len(parts)
    s_local = parts[0].shape[dim]
    shape = list(parts[0].shape)
    shape[dim] = world * s_local
    full = parts[0].new_full(shape, float("nan"))
    for r, p in enumerate(parts):
        idx = [slice(None)] * len(shape)
        idx[dim] = positions(r, world, s_local, zigzag)
        full[tuple(idx)] = p
    return full


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, workdir: str, targets: List[str]) -> None:
    import importlib

    err_path = os.path.join(workdir, f"rank{rank}.err")
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        import flash_ext
        flash_ext._C.set_poison_outputs(True)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        payloads = torch.load(os.path.join(workdir, "in.pt"), weights_only=False)
        for stage, (target, payload) in enumerate(zip(targets, payloads)):
            module, func = target.rsplit(".", 1)
            result = getattr(importlib.import_module(module), func)(rank, world, payload)
            torch.save(result, os.path.join(workdir, f"rank{rank}.stage{stage}.pt"))
        try:
            dist.destroy_process_group()
        except Exception:  # a group broken on purpose by a failure test
            pass
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def run(world: int, stages: List[tuple], deadline_s: float = 120.0,
        expected_exit: Optional[Dict[int, int]] = None) -> List[List[Any]]:
    """Runs the ``stages`` ``[(target, payload), ...]`` one after the other on ``world`` spawned ranks (``target``
    a "module.function" importable from tests/, called as ``target(rank, world, payload)``) and returns
    ``results[stage][rank]``.  A rank listed in ``expected_exit`` ({rank: code}) must end with that exit code; its
    results are None from the stage it left in.  Raises AssertionError with every failing rank's traceback, or
    when the ranks have not finished within ``deadline_s`` (they are killed)."""
    expected_exit = expected_exit or {}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="flash_ext_ring_") as workdir:
        torch.save([payload for _, payload in stages], os.path.join(workdir, "in.pt"))
        port = _free_port()
        targets = [target for target, _ in stages]
        procs = [ctx.Process(target=_worker, args=(r, world, port, workdir, targets), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r, p in enumerate(procs):
            path = os.path.join(workdir, f"rank{r}.err")
            if r in expected_exit:
                if p.exitcode != expected_exit[r]:
                    errors.append(f"--- rank {r}: exit code {p.exitcode}, expected {expected_exit[r]} ---")
            elif os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- rank {r} (exit code {p.exitcode}) ---\n{f.read()}")
            elif p.exitcode != 0 and r not in hung:
                errors.append(f"--- rank {r}: exit code {p.exitcode} without a traceback ---")
        if hung:
            errors.insert(0, f"ranks {hung} still running after {deadline_s:.0f} s: killed")
        if errors:
            raise AssertionError("ring worker failure:\n" + "\n".join(errors))

        def load(stage, r):
            path = os.path.join(workdir, f"rank{r}.stage{stage}.pt")
            return torch.load(path, weights_only=False) if os.path.exists(path) else None
        return [[load(i, r) for r in range(world)] for i in range(len(stages))]


# ---------------------------------------------------------------------------------------------------------------
# Rank side of the correctness cases.

def run_cases(rank: int, world: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every case on this rank, in order.  A case: ``fn`` (a flash_ext.distributed function name), ``zigzag``,
    ``packing`` ("qkv", "kv" or None), ``strided`` (inputs with a strided last dimension), full-sequence ``q``, ``k``, ``v``, ``dout`` (or per-subgroup lists of
    them with ``subgroups``: lists of global ranks, each its own ring), ``kwargs``, ``backward`` (``lse_grad``:
    the loss also uses the LSE, with upstream gradient ``dlse``).  Returns per
    case ``out``, ``lse`` and (backward) ``dq``, ``dk``, ``dv`` of this rank's shards, or ``error``
    (type name and message) when the call raised and the case has ``expect_error``."""
    import torch.distributed as dist

    import flash_ext.distributed as fxd

    results = []
    groups: Dict[tuple, Any] = {}
    for case in cases:
        group, g_rank, g_world, data = None, rank, world, case
        if case.get("subgroups"):
            for members in case["subgroups"]:  # every rank creates every subgroup, in the same order
                key = tuple(members)
                if key not in groups:
                    groups[key] = dist.new_group(list(members), timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
            idx = next(i for i, m in enumerate(case["subgroups"]) if rank in m)
            members = case["subgroups"][idx]
            group, g_rank, g_world, data = groups[tuple(members)], members.index(rank), len(members), case["data"][idx]
        zz = case["zigzag"]
        q, k, v = (shard(data[n], g_rank, g_world, zz) for n in ("q", "k", "v"))
        perturb = case.get("perturb", {}).get(rank)  # one rank's bad or mismatched arguments
        if perturb == "shorter_q":
            q = q[:, :-2]
        elif perturb == "head_dim_plus_2":  # pads to the same multiple of 8: same K/V bytes, other meaning
            q, k, v = (torch.cat([t, torch.zeros(*t.shape[:-1], 2, dtype=t.dtype)], dim=-1) for t in (q, k, v))
        elif perturb == "head_dim_300":
            q, k, v = (torch.zeros(*t.shape[:-1], 300, dtype=t.dtype) for t in (q, k, v))
        elif perturb is not None and perturb != "no_grad":
            raise ValueError(f"unknown perturbation {perturb!r}")
        # "no_grad": this rank's inputs record no graph while the others' do (the backward is collective too)
        leaves = [t.clone().requires_grad_(case["backward"] and perturb != "no_grad") for t in (q, k, v)]
        fn = getattr(fxd, case["fn"])
        kwargs = dict(case["kwargs"], return_attn_probs=True, group=group)
        res: Dict[str, Any] = {}
        try:
            if case["packing"] == "qkv":
                qkv = torch.stack([t.detach() for t in leaves], dim=2).requires_grad_(case["backward"])
                out, lse, _ = fn(qkv, **kwargs)
                grad_of = [qkv]
            elif case["packing"] == "kv":
                kv = torch.stack([t.detach() for t in leaves[1:]], dim=2).requires_grad_(case["backward"])
                out, lse, _ = fn(leaves[0], kv, **kwargs)
                grad_of = [leaves[0], kv]
            elif case.get("strided"):  # inputs whose last dimension is strided (stride 2), views of the leaves
                out, lse, _ = fn(*(torch.stack([t, t.detach()], dim=-1)[..., 0] for t in leaves), **kwargs)
                grad_of = leaves
            else:
                out, lse, _ = fn(*leaves, **kwargs)
                grad_of = leaves
        except Exception as exc:
            if not case.get("expect_error"):
                raise
            results.append({"error": (type(exc).__name__, str(exc))})
            continue
        res["out"], res["lse"] = out.detach(), lse.detach()
        if case["backward"]:
            outputs, upstream = [out], [shard(data["dout"], g_rank, g_world, zz)]
            if case.get("lse_grad"):  # a loss that uses the returned LSE too
                outputs.append(lse)
                upstream.append(shard(data["dlse"], g_rank, g_world, zz, dim=2))
            try:
                grads = torch.autograd.grad(outputs, grad_of, upstream)
            except Exception as exc:
                if not case.get("expect_error"):
                    raise
                results.append({"error": (type(exc).__name__, str(exc))})
                continue
            if case["packing"] == "qkv":
                grads = grads[0].unbind(2)
            elif case["packing"] == "kv":
                grads = (grads[0], *grads[1].unbind(2))
            res["dq"], res["dk"], res["dv"] = grads
        results.append(res)
    return results
