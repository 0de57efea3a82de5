"""Token grouping and the combine step: the parts every per-expert or grouped-GEMM kernel
shares, written once so that the router weight is applied exactly once everywhere."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .._config import MoEConfig

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


class ExpertOrder(NamedTuple):
    """The (token, slot) pairs of a batch sorted by expert (stable)."""

    token_of: torch.Tensor  # int64 [T*K]: the token of each sorted pair
    expert_ids: torch.Tensor  # int64 [T*K]: the expert of each sorted pair (non-decreasing)
    weights: torch.Tensor  # float32 [T*K]: the router weight of each sorted pair
    counts: torch.Tensor  # int64 [E]: pairs per expert


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int) -> ExpertOrder:
    """Sort a batch's (token, slot) pairs by expert."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    if flat_ids.numel() == 1:  # decode with top-1: nothing to sort
        order = torch.zeros(1, dtype=torch.int64)
    else:
        order = torch.argsort(flat_ids, stable=True)
    return ExpertOrder(order // top_k, flat_ids[order],
                       topk_weights.reshape(-1).to(torch.float32)[order],
                       torch.bincount(flat_ids, minlength=num_experts))


def scale_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``rows * weights`` computed in float32 and rounded once to the rows' dtype: the
    router weight applied to the input (``apply_router_weight_on_input``). ``weights`` is
    ``[N]`` or ``[N, 1]``."""
    w = weights.reshape(-1, 1).to(torch.float32)
    return (rows.to(torch.float32) * w).to(rows.dtype)


def combine(config: MoEConfig, rows_out: torch.Tensor, order: ExpertOrder, tokens: int,
            dtype: torch.dtype) -> torch.Tensor:
    """The finalize step: scatter-add each sorted pair's expert output into its token, in
    float32, weighted by the router weight unless it was applied to the input already, and
    round once to ``dtype``. ``rows_out`` is ``[T*K, H]`` in sorted order."""
    y = rows_out.to(torch.float32)
    if not config.apply_router_weight_on_input:
        y = y * order.weights.unsqueeze(1)
    out = torch.zeros(tokens, config.hidden_size, dtype=torch.float32)
    out.index_add_(0, order.token_of, y)
    return out.to(dtype)


def grouped_by_expert(config: MoEConfig, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert: ExpertFn) -> torch.Tensor:
    """Group tokens by expert, run ``expert(e, rows)`` once per active expert, and
    scatter-add the weighted rows in float32 (rounded once at the end).

    With ``apply_router_weight_on_input`` the weight scales the rows before the expert
    and is not applied again on the way out.
    """
    tokens = topk_ids.shape[0]
    order = sort_by_expert(topk_ids, topk_weights, config.num_experts)
    counts = order.counts.tolist()
    out = torch.zeros(tokens, config.hidden_size, dtype=torch.float32)
    on_input = config.apply_router_weight_on_input
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = order.token_of[start:start + count]
        w = order.weights[start:start + count].unsqueeze(1)
        start += count
        xe = scale_rows(x[rows], w) if on_input else x[rows]
        y = expert(e, xe).to(torch.float32)
        out.index_add_(0, rows, y if on_input else y * w)
    return out.to(x.dtype)
