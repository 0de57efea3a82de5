"""The PyTorch backend: a per-expert loop over expert-sorted tokens.

Runs anywhere torch runs, accepts every valid config, and is the last resort in the
priority order. It reads the caller's canonical tensors directly (no copy, no prepack),
so it costs no memory and is always a safe fallback.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

import moe_dispatch as md
from moe_dispatch.reference import SWIGLU_ALPHA, SWIGLU_LIMIT

NAME = "torch"
PRIORITY = 0


def gated_activation(h: torch.Tensor, activation: md.Activation) -> torch.Tensor:
    """The canonical gated activations with torch's fused kernels; ``[N, 2I] -> [N, I]``."""
    if activation is md.Activation.SWIGLUOAI:
        gate, up = h[:, 0::2], h[:, 1::2]
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    gate, up = h.chunk(2, dim=-1)
    if activation is md.Activation.SILU:
        return F.silu(gate) * up
    if activation is md.Activation.GELU:
        return F.gelu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


class TorchLoopBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        return md.accept("portable per-expert loop; runs every valid config")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> Any:
        # No copy: the loop reads the canonical tensors as they are (F.linear takes
        # any strides). Holding references keeps them alive for the layer's lifetime.
        return weights

    def apply(self, state: md.LayerWeights, hidden_states: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return moe_loop(state, hidden_states, topk_weights, topk_ids)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def moe_loop(weights: md.LayerWeights, x: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """The per-expert loop on the canonical tensors with ``F.linear``."""
    config = weights.config
    w13, w2, b13, b2 = weights.w13, weights.w2, weights.w13_bias, weights.w2_bias

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = F.linear(xe, w13[e], b13[e] if b13 is not None else None)
        return F.linear(gated_activation(h, config.activation), w2[e],
                        b2[e] if b2 is not None else None)

    return grouped_by_expert(config, x, topk_weights, topk_ids, expert)


class ExpertOrder(NamedTuple):
    """The (token, slot) pairs of a batch sorted by expert (stable)."""

    token_of: torch.Tensor  # int64 [T*K]: the token of each sorted pair
    expert_ids: torch.Tensor  # int64 [T*K]: the expert of each sorted pair (non-decreasing)
    weights: torch.Tensor  # float32 [T*K]: the router weight of each sorted pair
    counts: torch.Tensor  # int64 [E]: pairs per expert


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int) -> ExpertOrder:
    """Sort a batch's (token, slot) pairs by expert: the common first step of every
    per-expert and grouped-GEMM backend."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    if flat_ids.numel() == 1:  # decode with top-1: nothing to sort
        order = torch.zeros(1, dtype=torch.int64)
    else:
        order = torch.argsort(flat_ids, stable=True)
    return ExpertOrder(order // top_k, flat_ids[order],
                       topk_weights.reshape(-1).to(torch.float32)[order],
                       torch.bincount(flat_ids, minlength=num_experts))


def grouped_by_expert(config: md.MoEConfig, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert: ExpertFn) -> torch.Tensor:
    """Group tokens by expert, run ``expert(e, rows)`` once per active expert, and
    scatter-add the weighted rows. Shared by every per-expert backend.

    Accumulates in float32 and casts back once, so bf16 results round only at the end.
    With ``apply_router_weight_on_input`` the weight scales the rows before the expert
    and is not applied again on the way out.
    """
    tokens = topk_ids.shape[0]
    token_of, _, sorted_w, counts_t = sort_by_expert(topk_ids, topk_weights, config.num_experts)
    counts = counts_t.tolist()
    out = torch.zeros(tokens, config.hidden_size, dtype=torch.float32)
    on_input = config.apply_router_weight_on_input
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start:start + count]
        w = sorted_w[start:start + count].unsqueeze(1)
        start += count
        xe = x[rows]
        if on_input:
            xe = (xe.to(torch.float32) * w).to(x.dtype)
        y = expert(e, xe).to(torch.float32)
        out.index_add_(0, rows, y if on_input else y * w)
    return out.to(x.dtype)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, TorchLoopBackend(),
                           description="per-expert PyTorch loop (portable reference path)",
                           version=torch.__version__)]
