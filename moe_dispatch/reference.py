"""The float64 reference: the canonical MoE math, written for clarity, not speed.

Every backend is tested against this. It is deliberately independent of the backends:
activations are spelled out as formulas, not taken from ``torch.nn.functional``.
"""

from __future__ import annotations

import math

import torch

from ._config import Activation, MoEConfig

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def activate(h: torch.Tensor, activation: Activation | str) -> torch.Tensor:
    """Gated activation of ``h [..., 2I]`` in the canonical layout; returns ``[..., I]``."""
    activation = Activation(activation)
    inter = h.shape[-1] // 2
    if activation is Activation.SWIGLUOAI:
        gate, up = h[..., 0::2], h[..., 1::2]  # interleaved
        g = torch.clamp(gate, max=SWIGLU_LIMIT)  # gpt-oss clamps the gate from above only
        u = torch.clamp(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (u + 1.0) * g * (1.0 / (1.0 + torch.exp(-SWIGLU_ALPHA * g)))
    gate, up = h[..., :inter], h[..., inter:]
    if activation is Activation.SILU:
        act = gate / (1.0 + torch.exp(-gate))
    elif activation is Activation.GELU:
        act = 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0)))
    else:  # GELU_TANH
        act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                             * (gate + 0.044715 * gate ** 3)))
    return act * up


def moe_reference(config: MoEConfig, hidden_states: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer in float64: returns ``[T, H]`` float64.

    ``out[t] = sum_k w[t,k] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])`` with
    ``e = topk_ids[t,k]``; with ``apply_router_weight_on_input`` the weight scales ``x``
    instead. Duplicate ids in a row simply contribute twice.
    """
    f64 = torch.float64
    x = hidden_states.to(f64)
    tw = topk_weights.to(f64)
    ids = topk_ids.to(torch.int64)
    out = torch.zeros(x.shape[0], config.hidden_size, dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        weight = tw[rows, slots].unsqueeze(1)
        xe = x[rows]
        if config.apply_router_weight_on_input:
            xe = xe * weight
        # Convert one expert at a time: a whole model's weights in float64 would not fit.
        h = xe @ w13[e].to(f64).T
        if w13_bias is not None:
            h = h + w13_bias[e].to(f64)
        y = activate(h, config.activation) @ w2[e].to(f64).T
        if w2_bias is not None:
            y = y + w2_bias[e].to(f64)
        if not config.apply_router_weight_on_input:
            y = y * weight
        out.index_add_(0, rows, y)
    return out
