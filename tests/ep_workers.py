"""Worker processes for the expert-parallel tests (spawned: must be importable)."""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch.distributed import ExpertParallelError, ep_forward, setup_expert_parallel

CASES = [(dtype, bias, placement) for dtype in ("float32", "bfloat16") for bias in (False, True)
         for placement in ("contiguous", "round_robin")]


def _model(dtype, bias, experts=10, hidden=64, inter=32, tokens=9, top_k=4):
    g = torch.Generator().manual_seed(1234)
    w = {"w13": (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype),
         "w2": (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype),
         "w13_bias": (torch.randn(experts, 2 * inter, generator=g) * 0.3).to(dtype) if bias else None,
         "w2_bias": (torch.randn(experts, hidden, generator=g) * 0.3).to(dtype) if bias else None}
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    tw, ids = md.select_experts(torch.randn(tokens, experts, generator=g), top_k)
    return w, x, tw, ids


def _init(rank, world, port, timeout_s=60):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _attempt(seen, name, fn):
    """Records the ExpertParallelError's message (and its cause's type), or what went wrong."""
    try:
        fn()
        seen[name] = "no error"
    except ExpertParallelError as exc:
        cause = f" [cause: {type(exc.__cause__).__name__}]" if exc.__cause__ is not None else ""
        seen[name] = f"{exc}{cause}"
    except Exception as exc:  # any other error type is a test failure
        seen[name] = f"WRONG TYPE {type(exc).__name__}: {exc}"


def parity_worker(rank, world, port, outdir):
    _init(rank, world, port)
    results = {}
    try:
        for dtype_name, bias, placement in CASES:
            dtype = getattr(torch, dtype_name)
            w, x, tw, ids = _model(dtype, bias)
            config = md.MoEConfig(10, 4, 64, 32, dtype=dtype, has_bias=bias, ep_size=world,
                                  ep_rank=rank, placement=placement)
            mine = list(config.local_expert_ids)
            layer = setup_expert_parallel(config, w["w13"][mine], w["w2"][mine],
                                          w["w13_bias"][mine] if bias else None,
                                          w["w2_bias"][mine] if bias else None)
            out = ep_forward(layer, x, tw, ids)
            key = f"{dtype_name}-{bias}-{placement}"
            torch.save(out, os.path.join(outdir, f"{key}-rank{rank}.pt"))
            results[key] = dict(backend=layer.backend, local=mine,
                                expected=md.resolve(config.local_config()).backend,
                                explain_has_rank=f"rank {rank} of {world}" in layer.explain())
        # Grad mode: the all-reduce is not recorded, so backward must raise, not give x this
        # rank's share of its gradient.
        xg = x.clone().requires_grad_(True)
        out = ep_forward(layer, xg, tw, ids)
        try:
            (out.float() + xg.float()).sum().backward()
            results["grad"] = "backward ran"
        except md.NotDifferentiableError:
            results["grad"] = "raised"
    except Exception:
        results["error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


def error_worker(rank, world, port, outdir):
    _init(rank, world, port)
    seen = {}
    w, x, tw, ids = _model(torch.float32, False)
    good = md.MoEConfig(10, 4, 64, 32, dtype=torch.float32, ep_size=world, ep_rank=rank)
    mine = list(good.local_expert_ids)

    def attempt(name, fn):
        _attempt(seen, name, fn)

    # 1. An expert id owned by no rank (>= E): rejected on every rank, before the all-reduce.
    layer = setup_expert_parallel(good, w["w13"][mine], w["w2"][mine])
    bad_ids = ids.clone()
    bad_ids[0, 0] = 10
    attempt("unowned_id", lambda: ep_forward(layer, x, tw, bad_ids))
    # 2. One rank gets weights of the wrong shape.
    w13 = w["w13"][mine] if rank != 1 else w["w13"][mine][:, :, :-1]
    attempt("wrong_shape", lambda: setup_expert_parallel(good, w13, w["w2"][mine]))
    # 3. A mismatched ep_size on one rank.
    cfg = good if rank != 0 else md.MoEConfig(10, 4, 64, 32, dtype=torch.float32, ep_size=world + 1,
                                              ep_rank=rank)
    mine3 = list(cfg.local_expert_ids)
    attempt("ep_size", lambda: setup_expert_parallel(cfg, w["w13"][mine3], w["w2"][mine3]))
    # 4. Rank 1 places experts round robin, rank 0 contiguously.
    cfg4 = md.MoEConfig(10, 4, 64, 32, dtype=torch.float32, ep_size=world, ep_rank=rank,
                        placement="round_robin" if rank == 1 else "contiguous")
    mine4 = list(cfg4.local_expert_ids)
    attempt("placement", lambda: setup_expert_parallel(cfg4, w["w13"][mine4], w["w2"][mine4]))
    # The group still works afterwards.
    out = ep_forward(layer, x, tw, ids)
    seen["after"] = "ok" if out.shape == x.shape else "bad"
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def mismatch_worker(rank, world, port, outdir):
    """Rank 1 differs from rank 0 in one way per case; every rank must raise, none may hang.

    The process-group timeout is short so that a regression (a rank left waiting in a
    collective) fails in seconds. Cases that left ranks out of step before the fix come last.
    """
    _init(rank, world, port, timeout_s=20)
    seen = {}
    w, x, tw, ids = _model(torch.float32, False)
    good = md.MoEConfig(10, 4, 64, 32, dtype=torch.float32, ep_size=world, ep_rank=rank)
    mine = list(good.local_expert_ids)
    layer = setup_expert_parallel(good, w["w13"][mine], w["w2"][mine])
    try:
        one = rank == 1
        # Routing that differs: before the fix, silently wrong sums. The flipped ids keep the
        # same sum, so a plain sum of ids would not see them.
        _attempt(seen, "ids_differ", lambda: ep_forward(layer, x, tw, ids.flip(0) if one else ids))
        tw2 = tw.clone()
        tw2[2, 0] += 0.25
        _attempt(seen, "weights_differ", lambda: ep_forward(layer, x, tw2 if one else tw, ids))
        # Errors that are not MoEDispatchErrors, on rank 1 only.
        _attempt(seen, "config_dict", lambda: setup_expert_parallel(
            {"num_experts": 10} if one else good, w["w13"][mine], w["w2"][mine]))
        _attempt(seen, "misspelled_option", lambda: setup_expert_parallel(
            good, w["w13"][mine], w["w2"][mine], **({"tuning_cach": False} if one else {})))
        broken = setup_expert_parallel(good, w["w13"][mine], w["w2"][mine])
        if one:  # a kernel failing at run time on one rank
            def boom(*args, **kwargs):
                raise RuntimeError("simulated kernel failure")
            broken.forward = boom
        _attempt(seen, "kernel_failure", lambda: ep_forward(broken, x, tw, ids))
        # Different token counts: before the fix, a hang (0 vs 5) or a crash (3 vs 5).
        for n in (0, 3):
            t = n if one else 5
            _attempt(seen, f"tokens_{n}", lambda: ep_forward(layer, x[:t], tw[:t], ids[:t]))
        # The group still works afterwards.
        _attempt(seen, "after", lambda: ep_forward(layer, x, tw, ids))
    finally:  # what each case gave, even when one broke the group
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(seen, fh)
    dist.destroy_process_group()
