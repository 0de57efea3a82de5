"""``example_bmm``: every active expert in two batched GEMMs over padded token groups.

The two checks:
- ``supports_config``: the vendor's op ``example_vendor::padded_bmm`` is registered with the
  arguments this backend passes (``capabilities.op_schema``, checked by argument names and
  types with the toolkit's ``op_problem``); float32 or bfloat16, silu/gelu/gelu_tanh, no
  bias (each rejection says why), and a padding budget: E at most 64.
- ``supports_layer``: the tensors are the config's dtype on the CPU (the layer validated
  shapes already).

Weight ownership: ``process_weights`` builds transposed copies (``[E, H, 2I]`` and
``[E, I, H]``, the layout ``torch.bmm`` wants) that the backend owns; the caller's tensors
are never written. It uses only the public API: ``moe_dispatch`` and ``moe_dispatch.kernels``.
"""

from __future__ import annotations

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import combine, gated_activation, op_problem, scale_rows, sort_by_expert

from . import ops  # registers example_vendor::padded_bmm

NAME = "example_bmm"
PRIORITY = -10  # below the built-in "torch" (0): installing the example changes no choice
MAX_EXPERTS = 64
_ACTIVATIONS = (md.Activation.SILU, md.Activation.GELU, md.Activation.GELU_TANH)


@attrs.frozen(eq=False)
class State:
    config: md.MoEConfig
    w13t: torch.Tensor  # [E, H, 2I], owned
    w2t: torch.Tensor  # [E, I, H], owned


class BatchedGemmBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        problem = op_problem(capabilities, ops.OP_NAME, ops.OP_ARGS)
        if problem:
            return md.reject(problem)
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
        return md.accept(f"padded batched GEMM over active experts ({ops.OP_NAME})")

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
        order = sort_by_expert(topk_ids, topk_weights, config.num_experts)  # prepare
        active = torch.nonzero(order.counts).flatten()
        rows = int(order.counts.max())
        # Slot of each sorted pair inside its expert's padded block.
        starts = torch.cumsum(order.counts, 0) - order.counts
        slot = torch.arange(order.expert_ids.numel()) - starts[order.expert_ids]
        group = torch.searchsorted(active, order.expert_ids)
        x = hidden_states[order.token_of]
        if config.apply_router_weight_on_input:
            x = scale_rows(x, order.weights)
        padded = hidden_states.new_zeros(len(active), rows, config.hidden_size)
        padded[group, slot] = x
        h = ops.padded_bmm(padded, state.w13t, active)  # experts
        a = gated_activation(h.reshape(-1, h.shape[-1]), config.activation).reshape(h.shape[0], rows, -1)
        y = ops.padded_bmm(a.contiguous(), state.w2t, active)[group, slot]
        return combine(config, y, order, topk_ids.shape[0], hidden_states.dtype)  # finalize


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, BatchedGemmBackend(),
                           description="example vendor plugin: padded batched GEMM", version="0.1.0",
                           ops={ops.OP_NAME: ops.SCHEMA})]
