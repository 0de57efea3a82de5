"""Expert-parallel MoE with moe-dispatch on torch.distributed.

One machine:      torchrun --nproc-per-node=2 examples/expert_parallel.py
Several machines: torchrun --nnodes=2 --node-rank=R --nproc-per-node=1 \\
                      --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 examples/expert_parallel.py

Every rank builds the same random model (seeded), keeps only its own experts' weights,
computes its partial sum, and all-reduces. Rank 0 checks the result against a single-process
layer and the float64 reference.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch.distributed import ep_forward, setup_expert_parallel
from moe_dispatch.reference import moe_reference


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=10)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--placement", default="contiguous", choices=["contiguous", "round_robin"])
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dtype = getattr(torch, args.dtype)
    config = md.MoEConfig(args.experts, args.top_k, args.hidden, args.intermediate, dtype=dtype,
                          ep_size=world, ep_rank=rank, placement=args.placement)
    g = torch.Generator().manual_seed(0)  # the same full model and batch on every rank
    w13 = (torch.randn(args.experts, 2 * args.intermediate, args.hidden, generator=g) / args.hidden ** 0.5).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.intermediate, generator=g) / args.intermediate ** 0.5).to(dtype)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
    tw, ids = md.select_experts(torch.randn(args.tokens, args.experts, generator=g), args.top_k)
    mine = list(config.local_expert_ids)
    layer = setup_expert_parallel(config, w13[mine], w2[mine])
    print(f"rank {rank}/{world}: experts {mine} on backend {layer.backend!r}", flush=True)
    out = ep_forward(layer, x, tw, ids)
    if rank == 0:
        full = md.MoELayer(md.MoEConfig(args.experts, args.top_k, args.hidden, args.intermediate,
                                        dtype=dtype)).load_weights(w13, w2).prepare()
        single = full(x, tw, ids)
        ref = moe_reference(full.config, x, w13, w2, tw, ids)
        err = float((out.double() - ref).norm() / ref.norm())
        err1 = float((out.double() - single.double()).norm() / single.double().norm())
        print(f"rank 0: relative error vs float64 reference {err:.2e}, vs single process {err1:.2e}")
        print(layer.explain())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
