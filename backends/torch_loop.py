"""The PyTorch backend: a per-expert loop over expert-sorted tokens.

Runs anywhere torch runs, accepts every valid config, and is the last resort in the
priority order. It reads the caller's canonical tensors directly (no copy, no prepack),
so it costs no memory and is always a safe fallback. The kernel is the toolkit's
``moe_dispatch.kernels.expert_loop``; for quantized weights (int8, int4: every scheme),
``quantized_expert_loop``, which dequantizes each active expert as it runs.
"""

from __future__ import annotations

from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.kernels import expert_loop, quantized_expert_loop

NAME = "torch"
PRIORITY = 0


class TorchLoopBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        return md.accept("portable per-expert loop; runs every valid config")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> Any:
        # No copy: the loop reads the canonical tensors as they are (F.linear takes
        # any strides). Holding references keeps them alive for the layer's lifetime.
        return weights

    def apply(self, state: md.LayerWeights, hidden_states: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if state.quantized is not None:
            return quantized_expert_loop(state, hidden_states, topk_weights, topk_ids)
        return expert_loop(state, hidden_states, topk_weights, topk_ids)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, TorchLoopBackend(),
                           description="per-expert PyTorch loop (portable reference path)",
                           version=torch.__version__, weights=("float", "int8", "int4"),
                           weight_copies=0,  # it reads the layer's canonical weights
                           differentiable=True)]  # F.linear on them: tests/test_autograd.py
