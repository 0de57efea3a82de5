"""Fresh random layers and batches: the one generator for tuning, benchmarks and tests.

Never zeros: weights are scaled so activations stay O(1) and a layout bug shows up as a
large error against the reference.
"""

from __future__ import annotations

import torch

from ._config import MoEConfig
from .routing import select_experts

BIAS_SCALE = 0.5


def random_weights(config: MoEConfig, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """``w13``, ``w2`` (and the biases when the config has them) in the config's dtype."""
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    out: dict[str, torch.Tensor | None] = {
        "w13": (torch.randn(*config.w13_shape, generator=g) * (2 / h ** 0.5)).to(config.dtype),
        "w2": (torch.randn(*config.w2_shape, generator=g) / i ** 0.5).to(config.dtype),
        "w13_bias": None, "w2_bias": None}
    if config.has_bias:
        out["w13_bias"] = (torch.randn(*config.w13_bias_shape, generator=g) * BIAS_SCALE).to(config.dtype)
        out["w2_bias"] = (torch.randn(*config.w2_bias_shape, generator=g) * BIAS_SCALE).to(config.dtype)
    return out


def random_inputs(config: MoEConfig, tokens: int, pool: int = 4, seed: int = 1
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``pool`` batches of (hidden_states, topk_weights float32, topk_ids int32)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pool):
        x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
        tw, ids = select_experts(torch.randn(tokens, config.num_experts, generator=g), config.top_k)
        out.append((x, tw, ids))
    return out
