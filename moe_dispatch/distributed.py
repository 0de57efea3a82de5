"""Expert parallelism over ``torch.distributed``: each rank computes its local experts, then
an all-reduce sums the partial outputs.

Every step that can fail on one rank (config checks, weight loading, input validation, the
kernels) is followed by a collective agreement: an all-reduce of each rank's status (with its
config fields, or its batch shape and routing fingerprints), so that an error of any type on
any rank, or ranks that disagree, becomes an error on **every** rank instead of a hang in the
next collective or a silently wrong sum. No Python objects cross ranks (tensors only: nothing
is pickled).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NoReturn

import attrs
import torch
import torch.distributed as dist

from ._config import PLACEMENTS, SUPPORTED_DTYPES, Activation, MoEConfig
from ._autograd import forward_only, grad_enabled, wants_grad
from ._errors import InvalidTypeError, MoEDispatchError
from ._quant import KINDS
from ._expert_parallel import ExpertParallelLayer


class ExpertParallelError(MoEDispatchError, RuntimeError):
    """A step failed on one or more ranks; raised on every rank."""


def _gather(row: list[int], group: Any) -> list[list[int]]:
    """Every rank's ``row`` (the same length on every rank), by rank: a SUM all-reduce of a
    [world, n] int64 tensor that is zero but for this rank's row, so the sum is exact."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = torch.zeros(world, len(row), dtype=torch.int64)
    rows[rank] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows.tolist()


def _describe(error: BaseException) -> str:
    # moe_dispatch's own messages name the argument; anything else is named by its type
    return str(error) if isinstance(error, MoEDispatchError) else f"{type(error).__name__}: {error}"


def _raise_failed(failed: list[int], what: str, rank: int, error: BaseException | None,
                  detail: str = "") -> NoReturn:
    mine = f": {_describe(error)}" if error is not None else detail
    raise ExpertParallelError(f"{what} failed on rank(s) {failed} (this is rank {rank}){mine}") \
        from error


def _agree(error: BaseException | None, group: Any, what: str) -> None:
    """All ranks learn which ranks failed ``what``; every rank raises if any did."""
    rows = _gather([int(error is not None)], group)
    failed = [r for r, (flag,) in enumerate(rows) if flag]
    if failed:
        _raise_failed(failed, what, dist.get_rank(group), error)


def _spread(values: list[int], show: Callable[[int], str] = str) -> str:
    """[5, 0, 5] -> "5 on rank(s) [0, 2], 0 on rank(s) [1]"."""
    ranks: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        ranks.setdefault(v, []).append(r)
    return ", ".join(f"{show(v)} on rank(s) {rs}" for v, rs in ranks.items())


def _disagreement(names: list[str], rows: list[list[int]],
                  shows: dict[str, Callable[[int], str]] | None = None) -> str:
    """One "ranks disagree on NAME: VALUE on rank(s) [...], ..." per column of ``rows`` (one
    row per rank) that differs across ranks, joined by "; "; empty if none does."""
    parts = []
    for i, name in enumerate(names):
        column = [row[i] for row in rows]
        if len(set(column)) > 1:
            show = (shows or {}).get(name, str)
            parts.append(f"ranks disagree on {name}: {_spread(column, show)}")
    return "; ".join(parts)


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


# The order in which ranks send config_fields (every field but the rank itself).
_FIELD_NAMES = [f.name for f in attrs.fields(MoEConfig) if f.name != "ep_rank"]
# Config codes back to what the user wrote, for the error message.
_SHOW_CODE: dict[str, Callable[[int], str]] = {
    "activation": lambda c: list(Activation)[c].value,
    "dtype": lambda c: str(SUPPORTED_DTYPES[c]), "placement": lambda c: PLACEMENTS[c]}


def _check_consistent(config: MoEConfig, group: Any) -> None:
    """Every rank has the same global layer, ep_size equals the group size, ranks match."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error: Exception | None = None
    fields = [0] * len(_FIELD_NAMES)  # a failed rank's row must have every rank's length
    # Anything raised here (a dict for a config, say) must still reach the collective below,
    # or the other ranks wait in it until the process-group timeout.
    try:
        if not isinstance(config, MoEConfig):
            raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
        named = config_fields(config)
        fields = [named[n] for n in _FIELD_NAMES]
        if config.ep_size != world:
            raise ExpertParallelError(
                f"config.ep_size={config.ep_size} but the process group has {world} ranks")
        if config.ep_rank != rank:
            raise ExpertParallelError(
                f"config.ep_rank={config.ep_rank} but this process is rank {rank}")
    except Exception as exc:
        error = exc
    rows = _gather([int(error is not None)] + fields, group)
    what = "the expert-parallel config check"
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        _raise_failed(failed, what, rank, error)
    problem = _disagreement(_FIELD_NAMES, [row[1:] for row in rows], _SHOW_CODE)
    if problem:
        _raise_failed(list(range(world)), what, rank, None, f": {problem}")


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
    except Exception as exc:  # any type: a misspelled option must not leave the others waiting
        error = exc
    _agree(error, group, "loading and preparing the local experts")
    assert layer is not None
    return layer


# What ep_forward compares across ranks, after its failure flag: the shapes first, so a
# different token count is named as such rather than as different routing.
_BATCH = ["tokens (hidden_states.shape[0])", "hidden_size (the partial sums' width)",
          "top_k (topk_ids.shape[1])"]
_ROUTING = ["topk_ids", "topk_weights"]
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: the 64-bit golden-ratio constant


def _fingerprint(values: torch.Tensor) -> int:
    """A hash of an integer tensor that depends on each element and its position, O(numel).
    Integer arithmetic wraps the same way in any order, so every machine gets the same hash
    for the same tensor (a float sum could differ between CPUs); the mixing step makes
    swapped tokens, or ids moved between tokens, change it, which a plain sum would not."""
    x = values.reshape(-1).to(torch.int64) * _MIX + torch.arange(values.numel(), dtype=torch.int64)
    x = x ^ (x >> 29)
    return int((x * _MIX).sum())


def _batch_row(partial: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> list[int]:
    """This rank's shapes and routing fingerprints (``_BATCH`` then ``_ROUTING``); the weights
    are hashed by their bits, so the comparison is exact."""
    bits = topk_weights.contiguous().view(_INT_OF_WIDTH[topk_weights.element_size()])
    return [partial.shape[0], partial.shape[1], topk_ids.shape[1], _fingerprint(topk_ids),
            _fingerprint(bits)]


def ep_forward(layer: ExpertParallelLayer, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The whole expert-parallel step: the local float32 partial sum, an all-reduce in
    float32, and one rounding to the layer dtype.

    Collective: every rank calls it with the same tokens and routing (global ids). An error
    on any rank, or ranks whose token counts or routing (``topk_ids``, ``topk_weights``)
    differ, raise ``ExpertParallelError`` on every rank.
    """
    partial, error, recorded = None, None, False
    row = [0] * (len(_BATCH) + len(_ROUTING))
    # Any exception (a kernel failing at run time included) must still reach the agreement
    # below, or the other ranks wait in it until the process-group timeout.
    try:
        # autograd records neither the in-place all-reduce nor the other ranks' experts: a
        # gradient would hold this rank's share only (moe_dispatch/_autograd.py).
        recorded = (grad_enabled() and isinstance(hidden_states, torch.Tensor)
                    and isinstance(topk_weights, torch.Tensor)
                    and wants_grad(hidden_states, topk_weights, lambda: ()))
        with torch.no_grad() if recorded else contextlib.nullcontext():
            partial = layer(hidden_states, topk_weights, topk_ids)
        row = _batch_row(partial, topk_weights, topk_ids)
    except Exception as exc:
        error = exc
    # One collective carries the failure flags, the shapes and the routing fingerprints: the
    # data all-reduce below needs the same shape on every rank (gloo hangs or aborts
    # otherwise), and different routing would sum partials of different layers.
    rows = _gather([int(error is not None)] + row, group)
    what, rank = "the expert-parallel forward", dist.get_rank(group)
    failed = [r for r, other in enumerate(rows) if other[0]]
    if failed:
        _raise_failed(failed, what, rank, error)
    everyone = list(range(len(rows)))
    problem = _disagreement(_BATCH, [other[1:1 + len(_BATCH)] for other in rows])
    if problem:
        _raise_failed(everyone, what, rank, None, f": {problem}; every rank must pass the same "
                      "tokens (ep_forward does not support a different batch per rank)")
    problem = _disagreement(_ROUTING, [other[1 + len(_BATCH):] for other in rows],
                            {name: lambda h: f"fingerprint {h:#x}" for name in _ROUTING})
    if problem:
        _raise_failed(everyone, what, rank, None, f": {problem}; every rank must pass the same "
                      "routing (topk_ids and topk_weights, from the same router output)")
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
