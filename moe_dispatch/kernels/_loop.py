"""The per-expert loop on the canonical weights: the portable kernel and the reference a
backend's self-check can compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._spec import LayerWeights
from ._activations import gated_activation
from ._grouping import grouped_by_expert


def expert_loop(weights: LayerWeights, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, float32: bool = False) -> torch.Tensor:
    """The layer with one ``F.linear`` pair per active expert, reading the canonical
    tensors as they are (any strides). ``float32=True`` computes in float32, converting one
    expert's weights at a time (a whole bf16 layer at once would add 2x its bytes to the
    peak), and returns float32."""
    config = weights.config
    w13, w2, b13, b2 = weights.w13, weights.w2, weights.w13_bias, weights.w2_bias
    cast = (lambda t: t.float()) if float32 else (lambda t: t)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = F.linear(xe, cast(w13[e]), cast(b13[e]) if b13 is not None else None)
        return F.linear(gated_activation(h, config.activation), cast(w2[e]),
                        cast(b2[e]) if b2 is not None else None)

    return grouped_by_expert(config, x.float() if float32 else x, topk_weights, topk_ids, expert)


def quantized_expert_loop(weights: LayerWeights, x: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """The portable kernel for quantized weights (``weights.quantized``): each active expert's
    projections dequantized in float32 (exact), the biases cast to it, one float32
    ``F.linear`` pair; the result in the dtype of ``x``. Holds no dequantized copy between
    calls. Why float32 for bf16 / fp16 ``x`` too: dequantized into bf16 the weights are
    rounded (a Hypothesis case exceeded the bf16 tolerance, 1.1e-2), and where the CPU lacks
    bf16 instructions torch emulates a bf16 GEMM (C2 int8 T=128 on a Zen 3: 675 ms, against
    the float32 GEMM's hundreds of GFLOP/s)."""
    config, q = weights.config, weights.quantized
    assert q is not None, "quantized_expert_loop needs LayerWeights.quantized"
    b13, b2, f32 = q.w13_bias, q.w2_bias, torch.float32

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        h = F.linear(xe, q.w13.dequantize(e, f32), b13[e].to(f32) if b13 is not None else None)
        return F.linear(gated_activation(h, config.activation), q.w2.dequantize(e, f32),
                        b2[e].to(f32) if b2 is not None else None)

    return grouped_by_expert(config, x.to(f32), topk_weights, topk_ids, expert).to(x.dtype)
