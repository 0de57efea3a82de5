"""Expert parallelism over ``torch.distributed``: each rank computes its local experts, then
an all-reduce sums the partial outputs.

Every step that can fail on one rank (config checks, weight loading, input validation) is
followed by a collective agreement: a one-element status all-reduce, so that an error on
any rank becomes an error on **every** rank instead of a hang in the next collective. No
Python objects cross ranks (tensors only: nothing is pickled).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from ._config import PLACEMENTS, SUPPORTED_DTYPES, Activation, MoEConfig
from ._autograd import forward_only, grad_enabled, wants_grad
from ._errors import MoEDispatchError
from ._quant import KINDS
from ._expert_parallel import ExpertParallelLayer


class ExpertParallelError(MoEDispatchError, RuntimeError):
    """A step failed on one or more ranks; raised on every rank."""


def _agree(error: BaseException | None, group: Any, what: str) -> None:
    """All ranks learn which ranks failed ``what``; every rank raises if any did."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    flags = torch.zeros(world, dtype=torch.int32)
    if error is not None:
        flags[rank] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    failed = [r for r in range(world) if flags[r]]
    if failed:
        mine = f": {error}" if error is not None else ""
        raise ExpertParallelError(f"{what} failed on rank(s) {failed} (this is rank {rank}){mine}") \
            from error


def config_fields(config: MoEConfig) -> dict[str, int]:
    """Every field that changes the math, as integers (ranks compare these): shapes, the
    activation, the dtype, biases, where the router weight goes, the placement, the weight
    scheme."""
    return dict(num_experts=config.num_experts, top_k=config.top_k,
                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                ep_size=config.ep_size, activation=list(Activation).index(config.activation),
                dtype=SUPPORTED_DTYPES.index(config.dtype), has_bias=int(config.has_bias),
                apply_router_weight_on_input=int(config.apply_router_weight_on_input),
                placement=PLACEMENTS.index(config.placement),
                weight_scheme=_scheme_code(config))


def _scheme_code(config: MoEConfig) -> int:
    """0 for float weights, else kind, group size and symmetry in one integer."""
    s = config.weight_scheme
    if s is None:
        return 0
    return (1 + KINDS.index(s.kind)) * 1_000_000 + (s.group_size or 0) * 10 + int(s.symmetric)


def _check_consistent(config: MoEConfig, group: Any) -> None:
    """Every rank has the same global layer, ep_size equals the group size, ranks match."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problem = None
    if config.ep_size != world:
        problem = f"config.ep_size={config.ep_size} but the process group has {world} ranks"
    elif config.ep_rank != rank:
        problem = f"config.ep_rank={config.ep_rank} but this process is rank {rank}"
    named = config_fields(config)
    fields = torch.tensor(list(named.values()), dtype=torch.int64)
    lo, hi = fields.clone(), fields.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if problem is None and not torch.equal(lo, hi):
        diff = [n for n, a, b in zip(named, lo.tolist(), hi.tolist()) if a != b]
        problem = f"ranks disagree on {', '.join(diff)}"
    _agree(ExpertParallelError(problem) if problem else None, group, "the expert-parallel config check")


def setup_expert_parallel(config: MoEConfig, w13: torch.Tensor, w2: torch.Tensor,
                          w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                          *, group: Any = None, **layer_kwargs: Any) -> ExpertParallelLayer:
    """Build, load and prepare this rank's layer (local experts' weights only).

    Collective: every rank of ``group`` must call it. Raises on every rank if the ranks
    disagree on the layer, if ``ep_size``/``ep_rank`` do not match the group, or if any
    rank's weights are wrong.
    """
    _check_consistent(config, group)
    layer, error = None, None
    try:
        layer = ExpertParallelLayer(config, **layer_kwargs).load_weights(
            w13, w2, w13_bias, w2_bias).prepare()
    except MoEDispatchError as exc:
        error = exc
    _agree(error, group, "loading and preparing the local experts")
    assert layer is not None
    return layer


def ep_forward(layer: ExpertParallelLayer, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The whole expert-parallel step: the local float32 partial sum, an all-reduce in
    float32, and one rounding to the layer dtype.

    Collective: every rank calls it with the same tokens and routing (global ids). An input
    error on any rank raises on every rank.
    """
    partial, error = None, None
    # autograd records neither the in-place all-reduce nor the other ranks' experts: a
    # gradient would hold this rank's share only (moe_dispatch/_autograd.py).
    recorded = (grad_enabled() and isinstance(hidden_states, torch.Tensor)
                and isinstance(topk_weights, torch.Tensor)
                and wants_grad(hidden_states, topk_weights, lambda: ()))
    try:
        with torch.no_grad() if recorded else contextlib.nullcontext():
            partial = layer(hidden_states, topk_weights, topk_ids)
    except MoEDispatchError as exc:
        error = exc
    _agree(error, group, "the expert-parallel forward")
    assert partial is not None
    total = partial.to(torch.float32)  # already float32: ExpertParallelLayer's contract
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    out = total.to(hidden_states.dtype)
    if recorded:
        return forward_only(out, "an expert-parallel forward (ep_forward)", hidden_states,
                            topk_weights, (), why="its all-reduce of the ranks' partial sums "
                            "is not recorded by autograd", way_out="to train through the "
                            "experts, run them without expert parallelism, on a backend whose "
                            "spec is differentiable (BackendSpec.differentiable)")
    return out
