"""``example_bmm``: every active expert in two batched GEMMs over padded token groups.

The two checks:
- ``supports_config``: float32 or bfloat16, silu/gelu/gelu_tanh, no bias (each rejection says
  why), and a padding budget: E at most 64.
- ``supports_layer``: the tensors are the config's dtype on the CPU (the layer validated
  shapes already).

Weight ownership: ``process_weights`` builds transposed copies (``[E, H, 2I]`` and
``[E, I, H]``, the layout ``torch.bmm`` wants) that the backend owns; the caller's tensors
are never written.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

import moe_dispatch as md

NAME = "example_bmm"
PRIORITY = -10  # below the built-in "torch" (0): installing the example changes no choice
MAX_EXPERTS = 64
_ACTIVATIONS = {md.Activation.SILU: F.silu, md.Activation.GELU: F.gelu,
                md.Activation.GELU_TANH: lambda g: F.gelu(g, approximate="tanh")}


@attrs.frozen(eq=False)
class State:
    config: md.MoEConfig
    w13t: torch.Tensor  # [E, H, 2I], owned
    w2t: torch.Tensor  # [E, I, H], owned


class BatchedGemmBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        if config.dtype not in (torch.float32, torch.bfloat16):
            return md.reject(f"{config.dtype} is not supported (float32 or bfloat16)")
        if config.activation not in _ACTIVATIONS:
            return md.reject(f"activation {config.activation.value!r} is not supported "
                             "(silu, gelu, gelu_tanh)")
        if config.has_bias:
            return md.reject("expert biases are not supported")
        if config.num_experts > MAX_EXPERTS:
            return md.reject(f"num_experts={config.num_experts} exceeds the padding budget "
                             f"({MAX_EXPERTS})")
        return md.accept("padded batched GEMM over active experts")

    def supports_layer(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> md.Decision:
        for name, t in weights.tensors():
            if t.dtype != weights.config.dtype or t.device.type != "cpu":
                return md.reject(f"{name} must be a CPU tensor of {weights.config.dtype}")
        return md.accept()

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> State:
        return State(weights.config, weights.w13.transpose(1, 2).contiguous(),
                     weights.w2.transpose(1, 2).contiguous())

    def apply(self, state: State, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        config = state.config
        tokens, top_k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=config.num_experts)
        active = torch.nonzero(counts).flatten()
        rows = int(counts.max())
        # Slot of each sorted pair inside its expert's padded block.
        starts = torch.cumsum(counts, 0) - counts
        sorted_ids = flat[order]
        slot = torch.arange(flat.numel()) - starts[sorted_ids]
        group = torch.searchsorted(active, sorted_ids)
        token_of = order // top_k
        weight = topk_weights.reshape(-1).to(torch.float32)[order]
        x = hidden_states[token_of]
        if config.apply_router_weight_on_input:
            x = (x.to(torch.float32) * weight.unsqueeze(1)).to(x.dtype)
        padded = hidden_states.new_zeros(len(active), rows, config.hidden_size)
        padded[group, slot] = x
        h = torch.bmm(padded, state.w13t[active])
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(_ACTIVATIONS[config.activation](gate) * up, state.w2t[active])
        y = y[group, slot].to(torch.float32)
        if not config.apply_router_weight_on_input:
            y = y * weight.unsqueeze(1)
        out = torch.zeros(tokens, config.hidden_size, dtype=torch.float32)
        out.index_add_(0, token_of, y)
        return out.to(hidden_states.dtype)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, BatchedGemmBackend(),
                           description="example vendor plugin: padded batched GEMM", version="0.1.0")]
