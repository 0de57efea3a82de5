"""The native backend: moe-dispatch's own fused MoE decode kernel (``kernel.cpp``).

Decode reads each active expert's weights once per call, so its speed is the bandwidth at
which the weights stream. This kernel fuses w13, the activation, w2 and the weighted
combine, splits every expert's rows between the cores, and runs bf16 weights (widened in
registers) and int8 / int4 weights (integer dot products on activations quantized on the
fly, in pairs of 16-row blocks: one ``vpdpbusd`` for 16 rows in the avx512 build, a
``maddubs`` per 8 rows in the avx2 build; inputs per 32 values up to 16 tokens, as
llama.cpp's blocks, x per 128 values above). docs/architecture.md, "The native decode
kernel", has the layouts and the schedule.

With bf16 weights it serves decode: ``max_tokens`` keeps it to buckets of up to 16 tokens
(a GEMV per token and expert loses to the bf16 GEMM kernels beyond that); larger calls
route to the next backend. With int8 / int4 weights it has no limit: the other quantized
paths (torch's weight-only kernels, the dequantizing loop) were slower at T=128 and 512 as
well (C2 int8 T=128 on a Zen 3: 99 ms against 189 for torch_woq), so the default routing
measures it at every bucket. Forced (``backend="native"``), it runs every T, correctly. Its
state holds one copy of the weights in its layout (padded: K to 32 values, rows to pairs of
16-row blocks for int8 and int4): ``weight_copies`` declares 1.05 / 1.1, above what it
measures (C2: 1.02 / 1.05 of the quantized bytes).

The kernel is built on first use for the ISA the machine has (``kernel``); without a
compiler or after a failed build the backend rejects with the reason, and the others run.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

import attrs
import torch

import moe_dispatch as md
from moe_dispatch.kernels import check_id_range, dtype_name

from . import kernel
from ._pack import experts_args

NAME = "native"
PRIORITY = 375
MAX_TOKENS = 16  # bf16 weights; int8 / int4: no limit (module docstring)
_I32, _F32 = torch.int32, torch.float32
# int8/int4 weights: activations quantized per 32 values (x per 128 values in the blocks
# above 16 tokens: forward_blocks.h). Measured on random layers of H=1024-2048:
# 1.1-1.3e-2, which AIM_BOUND holds the kernel to there (tests/test_native_blocks.py). The
# error of one token's output grows as H and I shrink (fewer products average the inputs'
# rounding): Hypothesis found 2.9e-2 on E=1 H=192 I=64 int4 g64 zero points at T=1, in both
# builds; ERROR_BOUND holds for the test suite's random layers (moe_dispatch.testing), not
# for any data: one value far above the rest of its group of 32 sets the group's scale and
# leaves the others few levels (measured on E=1 T=1, weights N(0, 0.1), x N(0, 1), where
# one intermediate unit dominated: 0.37 at H=64 I=4, 5.8e-2 at H=512 I=32; 2e-2 at I=64).
ERROR_BOUND = 3e-2
AIM_BOUND = 1.6e-2


@attrs.frozen(slots=True, eq=False)
class NativeState:
    config: md.MoEConfig
    experts: Any  # the kernel's Experts object
    module: Any
    isa: str


def _format(config: md.MoEConfig) -> str:
    s = config.weight_scheme
    return "bf16" if s is None else s.describe()


class NativeBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        if kernel.disabled():
            return md.reject(f"{kernel.SWITCH}={os.environ.get(kernel.SWITCH)}: the native "
                             "backend is off")
        isa, why = kernel.isa_for(capabilities)
        if isa is None:
            return md.reject(why)
        if config.weight_scheme is None and config.dtype != torch.bfloat16:
            return md.reject(f"float weights: the kernel streams bfloat16 weights; the config has "
                             f"{dtype_name(config.dtype)} (left to the other backends)")
        if config.weight_scheme is not None and config.dtype not in (torch.bfloat16, torch.float32):
            return md.reject(f"quantized weights with {dtype_name(config.dtype)} activations: the "
                             "kernel takes bfloat16 or float32 activations")
        return md.accept(f"fused decode kernel ({why}, {_format(config)} weights)")

    def supports_layer(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> md.Decision:
        for name, t in weights.tensors():
            if t.device.type != "cpu" or t.layout != torch.strided:
                return md.reject(f"{name} must be a dense CPU tensor (got {t.device}, {t.layout})")
        isa, why = kernel.isa_for(capabilities)
        if isa is None:
            return md.reject(why)
        if kernel.load(isa) is None:  # built here on first use
            return md.reject(f"the {isa} build is unavailable: {kernel.status(isa)}")
        return md.accept(f"private copies in the kernel's layout ({isa} build)")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> NativeState:
        isa, why = kernel.isa_for(capabilities)
        module = kernel.load(isa) if isa is not None else None
        if module is None:
            raise RuntimeError(f"the native kernel is unavailable: {why}")
        experts = module.Experts(*experts_args(weights.config, weights))
        return NativeState(weights.config, experts, module, isa)

    def apply(self, state: NativeState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        c = state.config
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states)
        check_id_range(topk_ids, c.num_experts)  # the kernel checks too, before reading any weight
        ids = topk_ids if topk_ids.dtype is _I32 and topk_ids.is_contiguous() else \
            topk_ids.to(_I32).contiguous()
        tw = topk_weights if topk_weights.dtype is _F32 and topk_weights.is_contiguous() else \
            topk_weights.to(_F32).contiguous()
        # The kernel reads bytes: a lazily negated view's bytes are its value's negation.
        return state.experts.forward(hidden_states.resolve_neg().contiguous(), tw.resolve_neg(),
                                     ids, c.apply_router_weight_on_input)

    def fast_call(self, state: NativeState, guard: md.FastGuard) -> Any:
        c = state.config
        return state.module.FastCall(state.experts, c.apply_router_weight_on_input, c.hidden_size,
                                     c.top_k, c.num_experts, c.dtype, list(guard.watched),
                                     list(guard.versions)).entry()

    def diagnostics(self) -> Mapping[str, str]:
        return {"native kernel": kernel.describe()}


def _version() -> str:
    # The kernel's source hash: a tuning table measured with another kernel is not reused.
    return "src-" + hashlib.sha256(b"".join(p.read_bytes() for p in (kernel.SOURCE, *kernel.HEADERS))).hexdigest()[:12]


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    return [md.BackendSpec(NAME, PRIORITY, NativeBackend(),
                           description="moe-dispatch's fused MoE decode kernel (bf16, int8, int4)",
                           version=_version(), validates_ids=True,
                           weights=("float", "int8", "int4"),
                           weight_copies={"float": 1.0, "int8": 1.05, "int4": 1.1},
                           max_tokens={"float": MAX_TOKENS, "int8": None, "int4": None},
                           env_vars=(kernel.SWITCH, kernel.ISA_ENV, kernel.DIR_ENV))]


__all__ = ["AIM_BOUND", "ERROR_BOUND", "NAME", "PRIORITY", "NativeBackend", "NativeState"]
