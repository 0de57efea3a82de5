"""The AMX grouped-GEMM backend: one grouped GEMM per projection over expert-sorted tokens.

As vLLM and SGLang do on Intel AMX: sort the (token, slot) pairs by expert, gather the rows,
run one grouped GEMM for ``w13`` over all active experts, the activation, one grouped GEMM
for ``w2``, then the weighted scatter-add. The kernel is ``torch._grouped_mm`` with ``offs``
(oneDNN brgemm on AMX machines).

``prepare()`` prepacks the weights into the ``[E, K, N]`` (K-major) layout the grouped GEMM
consumes: ``w13t [E, H, 2I]`` and ``w2t [E, I, H]``, copies the backend owns.

The gate is exactly what the kernel needs: ``amx_tile`` (torch's own probe), bf16, hidden and
intermediate sizes divisible by 32 (vLLM's AMX alignment), and ``aten::_grouped_mm`` taking
``(self, mat2, offs)``. The math runs on any CPU, so tests exercise it here with injected
capabilities.
"""

from __future__ import annotations

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import combine, gated_activation, op_problem, owned_copy, scale_rows, sort_by_expert

NAME = "amx_grouped"
PRIORITY = 300
ALIGN = 32
OP = "aten::_grouped_mm"
OP_ARGS = (("self", "Tensor"), ("mat2", "Tensor"), ("offs", "Optional[Tensor]"))
OP_SCHEMA = ("aten::_grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, Tensor? bias=None, "
             "ScalarType? out_dtype=None) -> Tensor")


@attrs.frozen(slots=True, eq=False)
class GroupedState:
    config: md.MoEConfig
    w13t: torch.Tensor  # [E, H, 2I]
    w2t: torch.Tensor  # [E, I, H]
    b13: torch.Tensor | None  # [E, 2I]
    b2: torch.Tensor | None  # [E, H]


class AMXGroupedBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        caps = capabilities
        if not caps.amx_tile:
            return md.reject("needs Intel AMX (amx_tile), which this CPU lacks")
        if config.dtype != torch.bfloat16:
            return md.reject(f"AMX grouped GEMM runs bfloat16 only, not {config.dtype}")
        problem = op_problem(caps, OP, OP_ARGS, source=f"torch {caps.torch_version}")
        if problem:
            return md.reject(problem)
        for name in ("hidden_size", "intermediate_size"):
            value = getattr(config, name)
            if value % ALIGN:
                return md.reject(f"{name}={value} is not a multiple of {ALIGN} (AMX tile alignment)")
        return md.accept("AMX grouped GEMM over expert-sorted tokens")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> GroupedState:
        return GroupedState(weights.config, weights.w13.transpose(1, 2).contiguous(),
                            weights.w2.transpose(1, 2).contiguous(),
                            owned_copy(weights.w13_bias), owned_copy(weights.w2_bias))

    def apply(self, state: GroupedState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return grouped_moe(state, hidden_states, topk_weights, topk_ids)


def grouped_moe(state: GroupedState, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    config = state.config
    order = sort_by_expert(topk_ids, topk_weights, config.num_experts)
    offs = order.counts.cumsum(0).to(torch.int32)
    rows = x[order.token_of]
    if config.apply_router_weight_on_input:
        rows = scale_rows(rows, order.weights)
    h = torch._grouped_mm(rows, state.w13t, offs=offs)
    if state.b13 is not None:
        h = h + state.b13[order.expert_ids]
    y = torch._grouped_mm(gated_activation(h, config.activation).contiguous(), state.w2t, offs=offs)
    if state.b2 is not None:
        y = y + state.b2[order.expert_ids]
    return combine(config, y, order, topk_ids.shape[0], x.dtype)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, AMXGroupedBackend(),
                           description="AMX grouped GEMM (torch._grouped_mm) over expert-sorted tokens",
                           version=torch.__version__, ops={OP: OP_SCHEMA})]
