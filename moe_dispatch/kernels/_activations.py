"""Gated activations by their exact math (docs/architecture.md), with torch's fused ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._config import Activation
from ..reference import SWIGLU_ALPHA, SWIGLU_LIMIT


def gated_activation(h: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``[N, 2I] -> [N, I]`` in the canonical layout: gate rows first, interleaved for
    ``swigluoai`` (whose gate is clamped from above only, as gpt-oss does)."""
    if activation is Activation.SWIGLUOAI:
        gate, up = h[:, 0::2], h[:, 1::2]
        gate = gate.clamp(max=SWIGLU_LIMIT)
        up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    gate, up = h.chunk(2, dim=-1)
    if activation is Activation.SILU:
        return F.silu(gate) * up
    if activation is Activation.GELU:
        return F.gelu(gate) * up
    return F.gelu(gate, approximate="tanh") * up
