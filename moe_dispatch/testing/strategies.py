"""Hypothesis strategies shared by the conformance kit and the project's tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import moe_dispatch as md


# How a forward call can differ from the plain case a native entry takes (fast_call).
CALL_VARIANTS = ("plain", "int64_ids", "bf16_weights", "float64_weights", "strided_hidden",
                 "strided_ids", "strided_weights", "repeated_id", "id_too_large", "negative_id",
                 "no_tokens", "parameter_input")
# The variants that break BackendBase.fast_call's contract: every entry must decline them.
MUST_DECLINE = ("id_too_large", "negative_id", "no_tokens", "parameter_input")


@st.composite
def call_variants(draw: st.DrawFn, config: md.MoEConfig, max_tokens: int = 12
                  ) -> tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(variant, (hidden_states, topk_weights, topk_ids)): fresh random routing (int32 ids,
    float32 weights, contiguous) changed in one of the ways of CALL_VARIANTS. Needs
    top_k >= 2 (a repeated id) and num_experts > top_k."""
    variant = draw(st.sampled_from(CALL_VARIANTS))
    tokens = 0 if variant == "no_tokens" else draw(st.integers(1, max_tokens))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
    tw, ids = md.select_experts(torch.randn(tokens, config.num_experts, generator=g), config.top_k)
    row = draw(st.integers(0, max(tokens - 1, 0)))
    if variant == "int64_ids":
        ids = ids.long()
    elif variant == "bf16_weights":
        tw = tw.bfloat16()
    elif variant == "float64_weights":
        tw = tw.double()
    elif variant == "strided_hidden":
        x = torch.cat([x, x], 1)[:, ::2]
    elif variant == "strided_ids":
        ids = ids.t().contiguous().t()
    elif variant == "strided_weights":
        tw = tw.t().contiguous().t()
    elif variant == "repeated_id":
        ids[row, 1] = ids[row, 0]
    elif variant == "id_too_large":
        ids[row, 0] = config.num_experts
    elif variant == "negative_id":
        ids[row, 0] = -1
    elif variant == "parameter_input":
        x = torch.nn.Parameter(x, requires_grad=False)
    return variant, (x, tw, ids)
