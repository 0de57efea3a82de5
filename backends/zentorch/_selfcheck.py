"""The warm-up self-check: the op's first call packs every expert (seconds), so prepare()
makes it, and compares its output with an independent float32 loop on the caller's
weights: a stale cache entry or a layout bug never reaches a forward."""

from __future__ import annotations

import torch

import moe_dispatch as md
from moe_dispatch.kernels import expert_loop, quantized_expert_loop

from ._calls import ZentorchState, run_op
from ._quant import ERROR_BOUND

# Relative Frobenius error allowed against the float32 loop, by dtype.
SELF_CHECK_TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4, torch.float16: 1e-2}


def warm_up_and_check(state: ZentorchState, weights: md.LayerWeights) -> float | None:
    """None when the op agrees with the loop on a batch that touches every expert, else
    the relative error."""
    config = state.config
    k, e = config.top_k, config.num_experts
    tokens = -(-e // k)
    ids = (torch.arange(tokens * k, dtype=torch.int32) % e).reshape(tokens, k)
    gen = torch.Generator().manual_seed(0x5EED)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(config.dtype)
    tw = torch.rand(tokens, k, generator=gen) + 0.5
    got = run_op(state, x, tw, ids).to(torch.float64)
    if weights.quantized is not None:  # the dequantized weights, in float32
        want = quantized_expert_loop(weights, x.float(), tw, ids).to(torch.float64)
        tol = 2 * ERROR_BOUND  # the op quantizes its activations too (_quant)
    else:
        want = expert_loop(weights, x, tw, ids, float32=True).to(torch.float64)
        tol = SELF_CHECK_TOL[config.dtype]
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    return None if err <= tol else err
