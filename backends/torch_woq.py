"""torch's own weight-only quantized matmuls, per expert: the portable fast path for int8 and
int4 weights with bf16 activations.

``aten::_weight_int8pack_mm(x, w int8 [N, K], scales [N])`` computes ``x @ (w * s).T`` for
per-channel int8; ``aten::_weight_int4pack_mm_for_cpu(x, packed, g, sz [K/g, N, 2])``
computes ``x @ ((q - 8) * scale + zero).T`` for group-wise uint4 ``q`` packed by
``aten::_convert_weight_to_int4pack_for_cpu``. This project's int4 maps exactly: stored
nibble ``u``, value ``(u - z) * s`` = ``(u - 8) * s + (8 - z) * s``, so ``zero = (8 - z) * s``
(0 when symmetric). The kernels take the scales in the activations' dtype (bf16): a scale
rounds to bf16, a relative 2^-9, inside the bf16 tolerance. Both kernels are vectorised for
AVX2 and AVX-512 with bf16 activations; measured on a Zen 4 (AVX-512), 8 experts of C2's w13
at M=1: 1.0 ms each, against 6.5 ms for bf16 ``F.linear``. int8 per group of 32 is not a
layout these kernels take: that scheme is left to the other backends, as are int8 layers
whose H or I is not a multiple of 16 (the int8 kernel is wrong there, or crashes).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import gated_activation, grouped_by_expert, op_problem

NAME = "torch_woq"
PRIORITY = 100
INT8_OP, INT4_OP, PACK_OP = ("aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
                             "aten::_convert_weight_to_int4pack_for_cpu")
OPS = {INT8_OP: (("self", "Tensor"), ("mat2", "Tensor"), ("scales", "Tensor")),
       INT4_OP: (("self", "Tensor"), ("mat2", "Tensor"), ("qGroupSize", "int"),
                 ("qScaleAndZeros", "Tensor")),
       PACK_OP: (("self", "Tensor"), ("innerKTiles", "int"))}


@attrs.frozen(slots=True, eq=False)
class _Projection:
    """One projection of every expert, in the kernel's form."""

    weights: tuple[torch.Tensor, ...]  # per expert: int8 [N, K], or packed int4
    scales: torch.Tensor  # int8: [E, N]; int4: [E, K/g, N, 2] (scale, zero)
    group: int  # int4 group size; 0 for int8

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.group:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weights[e], self.group,
                                                              self.scales[e])
        return torch.ops.aten._weight_int8pack_mm(x, self.weights[e], self.scales[e])


def _pack(t: md.QuantizedTensor, dtype: torch.dtype) -> _Projection:
    e, n, _ = t.shape
    if t.scheme.bits == 8:
        # The kernel reads its weight as contiguous (it raises on a transposed one).
        return _Projection(tuple(t.qweight[i].contiguous() for i in range(e)),
                           t.scales.reshape(e, n).to(dtype).contiguous(), 0)
    g = t.scheme.group_size
    assert g is not None
    # One expert at a time: the int32 nibbles the converter takes are 8x the packed bytes
    # (all experts at once measured a 3.3x-of-bf16 peak at C2).
    weights = tuple(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        t.stored(i, torch.int32).contiguous(), 1) for i in range(e))
    s = t.scales.to(torch.float32)  # [E, N, K/g]
    z = torch.zeros_like(s) if t.zeros is None else (8 - t.zeros.to(torch.float32)) * s
    sz = torch.stack((s, z), dim=-1).transpose(1, 2).to(dtype).contiguous()  # [E, K/g, N, 2]
    return _Projection(weights, sz, g)


@attrs.frozen(slots=True, eq=False)
class WoqState:
    config: md.MoEConfig
    w13: _Projection
    w2: _Projection
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None


class TorchWoqBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        scheme = config.weight_scheme
        if scheme is None:
            return md.reject("quantized weights only")
        op = INT8_OP if scheme.bits == 8 else INT4_OP
        for name in (op, PACK_OP) if scheme.bits == 4 else (op,):
            problem = op_problem(capabilities, name, OPS[name], source=f"torch {torch.__version__}")
            if problem:
                return md.reject(problem)
        if config.dtype != torch.bfloat16:
            return md.reject(f"torch's weight-only kernels are vectorised for bfloat16 activations "
                             f"only; the config has {md.kernels.dtype_name(config.dtype)}")
        if scheme.bits == 8 and scheme.group_size is not None:
            return md.reject("int8 per group is not a layout torch's int8 kernel takes (per "
                             "output channel only)")
        if scheme.bits == 8:
            # Measured (torch 2.13, Zen 4): with a reduction length K that is not a multiple
            # of 16 the int8 kernel returns garbage (relative error 1e37 at K=24 and 200,
            # one token) or crashes the process (K=72, five tokens). K is H for w13, I for w2.
            for field, k in (("hidden_size", config.hidden_size),
                             ("intermediate_size", config.intermediate_size)):
                if k % 16:
                    return md.reject(f"{field}={k}: torch's int8 kernel needs a reduction "
                                     "length that is a multiple of 16 (others give wrong "
                                     "results or crash)")
        return md.accept(f"torch weight-only {scheme.describe()} matmuls per expert")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> WoqState:
        q = weights.quantized
        assert q is not None
        dtype = weights.config.dtype
        return WoqState(weights.config, _pack(q.w13, dtype), _pack(q.w2, dtype),
                        md.kernels.owned_copy(q.w13_bias), md.kernels.owned_copy(q.w2_bias))

    def apply(self, state: WoqState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> Any:
        act, b13, b2 = state.config.activation, state.w13_bias, state.w2_bias

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            h = state.w13(e, xe.contiguous())
            if b13 is not None:
                h = h + b13[e]
            y = state.w2(e, gated_activation(h, act).contiguous())
            return y + b2[e] if b2 is not None else y

        return grouped_by_expert(state.config, hidden_states, topk_weights, topk_ids, expert)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, TorchWoqBackend(),
                           description="torch's weight-only int8/int4 matmuls per expert",
                           version=torch.__version__, weights=("int8", "int4"),
                           # measured (bench_memory.py): int8 uses the layer's canonical
                           # values, int4 a packed copy (0.27x of bf16, 1.05 copies)
                           weight_copies={"int8": 0.0, "int4": 1.1},
                           ops={n: str(getattr(torch.ops.aten, n.split("::")[1]).default._schema)
                                for n in OPS})]
