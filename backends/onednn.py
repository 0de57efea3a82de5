"""The oneDNN backend: a per-expert loop over weights prepacked once into oneDNN's layout.

``prepare()`` reorders each expert's ``w13[e]`` and ``w2[e]`` with
``torch.ops.mkldnn._reorder_linear_weight`` into opaque blocked tensors the backend owns;
``apply`` runs ``torch.ops.mkldnn._linear_pointwise`` per active expert. The caller's
tensors are read once and never written.

Fused post-ops (``"swish"`` on the gate GEMM and ``_linear_pointwise.binary(..., "mul")``
on the up GEMM) were measured side by side against one joined GEMM plus the activation in
torch, fp32 on Zen 3, H=2048, I=768: no gain at any M (1: 0.457 vs 0.403 ms; 64: 4.80 vs
4.29; 512: 26.2 vs 23.2), so the backend uses the joined GEMM, which also serves
``swigluoai``'s interleaved layout unchanged.
"""

from __future__ import annotations

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import dtype_name, gated_activation, grouped_by_expert, op_problem, owned_copy

NAME = "onednn"
PRIORITY = 200
REORDER = "mkldnn::_reorder_linear_weight"
LINEAR = "mkldnn::_linear_pointwise"
# The arguments this backend passes to each op, by name and type (torch 2.13).
OP_ARGS = {
    REORDER: (("self", "Tensor"), ("batch_size", "Optional[int]")),
    LINEAR: (("X", "Tensor"), ("W", "Tensor"), ("B", "Optional[Tensor]"), ("attr", "str"),
             ("scalars", "List[Optional[number]]"), ("algorithm", "Optional[str]")),
}
# Their full schemas in torch 2.13, for simulated machines (the support matrix, tests).
OP_SCHEMAS = {
    REORDER: "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y",
    LINEAR: "mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, "
            "str? algorithm) -> Tensor Y",
}


@attrs.frozen(slots=True, eq=False)
class OneDNNState:
    config: md.MoEConfig
    w13: tuple[torch.Tensor, ...]  # per expert, opaque mkldnn blocked layout [2I, H]
    w2: tuple[torch.Tensor, ...]  # per expert, [H, I]
    b13: torch.Tensor | None  # private contiguous copies
    b2: torch.Tensor | None


class OneDNNBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        caps = capabilities
        if not caps.mkldnn:
            return md.reject("torch cannot use oneDNN (mkldnn) on this machine")
        for op, args in OP_ARGS.items():
            problem = op_problem(caps, op, args, source=f"torch {caps.torch_version}")
            if problem:
                return md.reject(problem)
        if config.dtype == torch.bfloat16 and not (caps.avx512_bf16 or caps.amx_tile):
            return md.reject("bfloat16 through oneDNN needs AVX512-BF16 or AMX, which this CPU "
                             "lacks (the reorder refuses it, or it runs emulated)")
        if config.dtype == torch.float16:
            return md.reject("float16 through oneDNN is not validated by this backend; use "
                             "bfloat16 or float32")
        return md.accept(f"oneDNN prepacked per-expert GEMMs ({dtype_name(config.dtype)})")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> OneDNNState:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        e = weights.config.num_experts
        # contiguous() makes a temporary copy only where the caller's expert slice is strided.
        w13 = tuple(reorder(weights.w13[i].contiguous(), None) for i in range(e))
        w2 = tuple(reorder(weights.w2[i].contiguous(), None) for i in range(e))
        return OneDNNState(weights.config, w13, w2, owned_copy(weights.w13_bias),
                           owned_copy(weights.w2_bias))

    def apply(self, state: OneDNNState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        act = state.config.activation
        b13, b2 = state.b13, state.b2

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            h = linear(xe.contiguous(), state.w13[e], b13[e] if b13 is not None else None,
                       "none", [], "")
            a = gated_activation(h, act).contiguous()
            return linear(a, state.w2[e], b2[e] if b2 is not None else None, "none", [], "")

        return grouped_by_expert(state.config, hidden_states, topk_weights, topk_ids, expert)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, OneDNNBackend(),
                           description="oneDNN prepacked per-expert GEMMs",
                           version=torch.__version__, ops=OP_SCHEMAS)]
