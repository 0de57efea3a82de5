"""Calls rewritten into the form the op needs, exactly: int32 ids, float32 weights,
contiguous tensors, no id repeated in a row, the single-active-expert refusal avoided."""

from __future__ import annotations

from typing import Callable

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import SMALL_IDS, has_duplicate_in_row, id_range, scale_rows


@attrs.frozen(slots=True, eq=False)
class ZentorchState:
    """Backend-owned weights. Private: nothing else ever reads or writes them."""

    config: md.MoEConfig
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    act: str
    # The serialised op call (op_caller), resolved once: lookups on torch.ops cost per call.
    call: Callable[..., None] = attrs.field(repr=False)
    # Quantized weights: the scales in the op's layout (_quant); None for float weights.
    w13_scales: torch.Tensor | None = None
    w2_scales: torch.Tensor | None = None
    # torch's thread count when the op reordered these weights (prepare()): every call runs
    # with it (_ledger.op_caller says why).
    threads: int = 0
    # top_k > 1 and the router weight applied after the experts: no call needs rewriting
    # for the op's single-active-expert refusal or for skip_weighted.
    plain: bool = attrs.field(init=False)
    top_k: int = attrs.field(init=False)

    @plain.default
    def _plain(self) -> bool:
        return self.config.top_k > 1 and not self.config.apply_router_weight_on_input

    @top_k.default
    def _top_k(self) -> int:
        return self.config.top_k


_I32, _F32 = torch.int32, torch.float32


def run_op(state: ZentorchState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> torch.Tensor:
    """Call the op with every argument in the form it needs (T > 0, ids in range)."""
    # The common case in as few distinct torch entry points as possible: right after the op
    # has streamed its weights through the caches, each one costs microseconds (measured at
    # E=64 H=2048 T=1: the general path below costs ~110 us more than a bare call of the
    # op, this one ~30 us). Anything unusual takes the general path.
    k = state.top_k
    if (state.plain and topk_ids.dtype is _I32 and topk_weights.dtype is _F32
            and hidden_states.shape[0] * k <= SMALL_IDS and hidden_states.is_contiguous()
            and topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        for row in topk_ids.tolist():  # has_duplicate_in_row's small case, inlined (cost)
            if len(set(row)) != k:
                break
        else:  # int32, float32, contiguous, no repeated id in a row, top_k > 1: as is
            out = torch.empty_like(hidden_states)
            state.call(out, hidden_states, state.w13, state.w2, state.w13_bias, state.w2_bias,
                       topk_weights, topk_ids, False, state.act, state.w13_scales, state.w2_scales,
                       state.threads)
            return out
    return _run_op_general(state, hidden_states, topk_weights, topk_ids)


def _run_op_general(state: ZentorchState, hidden_states: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    if topk_ids.dtype is not _I32:
        # The op checks the range of int32 ids (validates_ids), but an int64 id past 2**31
        # would wrap into range here: check before narrowing.
        lo, hi = id_range(topk_ids)
        if lo < 0 or hi >= state.config.num_experts:
            raise IndexError(f"topk_id value {lo if lo < 0 else hi} is outside "
                             f"[0, {state.config.num_experts})")
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if has_duplicate_in_row(ids):
        ids, weights = dedupe_rows(ids, weights, state.config.num_experts)
    x = hidden_states.contiguous()
    skip = state.config.apply_router_weight_on_input
    if skip:
        x = scale_rows(x, weights)
    tokens = x.shape[0]
    if ids.shape[1] == 1:
        # The op refuses a call where a single expert receives every token ("requires at
        # least 2 active experts"). Add one zero row routed to another expert and drop its
        # output: the real rows are computed exactly as before.
        lo, hi = id_range(ids)
        if lo == hi:
            other = (lo + 1) % state.config.num_experts
            x = torch.cat([x, x.new_zeros(1, x.shape[1])])
            ids = torch.cat([ids, ids.new_full((1, 1), other)])
            weights = torch.cat([weights, weights.new_zeros(1, 1)])
    out = torch.empty_like(x)
    state.call(out, x, state.w13, state.w2, state.w13_bias, state.w2_bias, weights, ids, skip,
               state.act, state.w13_scales, state.w2_scales, state.threads)
    return out if out.shape[0] == tokens else out[:tokens]


def dedupe_rows(ids: torch.Tensor, weights: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rewrite of rows with repeated ids: repeats' weights are summed onto the first
    occurrence; each repeat slot gets an expert unused in that row, with weight 0."""
    ids, weights = ids.clone(), weights.clone()
    ordered = ids.sort(dim=1).values
    rows = torch.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(dim=1)).flatten().tolist()
    for r in rows:
        seen: dict[int, int] = {}
        row = ids[r].tolist()
        unused = iter(sorted(set(range(num_experts)) - set(row)))
        for k, e in enumerate(row):
            if e in seen:
                weights[r, seen[e]] += weights[r, k]
                weights[r, k] = 0.0
                ids[r, k] = next(unused)  # exists: K <= E and this row repeats an id
            else:
                seen[e] = k
    return ids, weights
