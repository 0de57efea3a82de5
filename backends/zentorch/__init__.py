"""The zentorch backend: ``torch.ops.zentorch.zentorch_fused_moe`` on AMD Zen.

The op's measured contract and traps are in docs/backends/zentorch.md. This package makes
every trap unreachable, one module per concern:

- ``_gate``: the op's schema (by argument names and types), AMD Zen, bf16 only with
  AVX512-BF16 (wrong or crashing without it: measured on Zen 3), fp16 only with avx512fp16,
  gelu_tanh and swigluoai only in bf16 (the op's math differs), E >= 2, router weight on
  the input only with top_k == 1, the weight cache not disabled;
- ``_ledger``: the op rewrites bf16 weights in place and keys its cache by address: it only
  ever sees private copies at addresses it has never seen; calls are serialised;
- ``_calls``: int32 ids, float32 weights, contiguous inputs, repeated ids rewritten exactly,
  the single-active-expert refusal avoided; out-of-range ids make the op raise
  (``validates_ids``);
- ``_selfcheck``: prepare() makes the first (packing) call and checks it;
- ``_quant``: int8 / int4 weights (the op's scales arguments): its gate and layout;
- ``native``: a C++ entry for plain calls (checks and the op under one mutex, GIL released),
  built on first use.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Mapping

import torch

import moe_dispatch as md

from . import _gate, _ledger, _quant, native
from ._calls import ZentorchState, dedupe_rows, run_op
from ._selfcheck import warm_up_and_check

NAME = "zentorch"
PRIORITY = 400
OP_NAME = _gate.OP_NAME
EXPECTED_SCHEMA = _gate.EXPECTED_SCHEMA
schema_problem = functools.partial(md.kernels.schema_problem, expected=_gate.EXPECTED_ARGS)

__all__ = ["NAME", "OP_NAME", "PRIORITY", "ZentorchBackend", "ZentorchState", "avoided_hosts", "dedupe_rows",
           "library_status", "run_op", "schema_problem"]


def library_status() -> tuple[str | None, str]:
    """(version, text): zentorch imported (which registers its op), or why it was not. The
    switch is read on every call, not cached with the import: unsetting it later in the
    process brings zentorch back."""
    if _gate._disabled():
        return None, f"not imported: {_gate.NO_ZENTORCH} is set"
    return _imported()


@functools.lru_cache(maxsize=1)
def _imported() -> tuple[str | None, str]:
    try:
        import zentorch  # noqa: F401  (importing registers torch.ops.zentorch)
    except Exception as exc:  # ImportError, or a broken build raising anything else
        return None, f"not importable ({type(exc).__name__}: {exc})"
    version = str(getattr(zentorch, "__version__", "") or _dist_version() or "unknown")
    return version, version


def _dist_version() -> str:
    try:
        return importlib.metadata.version("zentorch")
    except importlib.metadata.PackageNotFoundError:
        return ""


class ZentorchBackend(md.BackendBase):
    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        decision = _gate.supports_config(config, capabilities, library_status()[1])
        if decision.accepted and config.weight_scheme is not None:
            return _quant.supports_config(config, capabilities, library_status()[1])
        return decision

    def supports_layer(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> md.Decision:
        return _gate.supports_layer(weights)

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> ZentorchState:
        library_status()  # registers the op (a no-op after the first call)
        config = weights.config
        call = _ledger.op_caller()  # before the ledger lock: the first one may compile (~30 s)
        q = weights.quantized
        with _ledger.LEDGER_LOCK:
            for attempt in range(2):
                own = _ledger.private_copy if attempt or q is not None else _ledger.shared_or_copy
                if q is not None:
                    # Made afresh for each attempt (the op may rewrite what it was handed) and
                    # adopted as they are: they are already private.
                    w13, w2, s13, s2 = (_ledger.adopt(t) for t in _quant.op_tensors(q))
                else:
                    w13, w2, s13, s2 = own(weights.w13), own(weights.w2), None, None
                b13, b2 = (own(b) if b is not None else None
                           for b in (weights.w13_bias, weights.w2_bias))
                state = ZentorchState(config, w13, w2, b13, b2, config.activation.value, call,
                                      s13, s2, torch.get_num_threads())
                _ledger.burn(state.w13, state.w2, state.w13_bias, state.w2_bias,
                             state.w13_scales, state.w2_scales)
                error = warm_up_and_check(state, weights)
                if error is None:
                    return state
        raise RuntimeError(f"the zentorch warm-up output does not match the reference "
                           f"(relative error {error:.3g}); the op is not used for this layer")

    def apply(self, state: ZentorchState, hidden_states: Any, topk_weights: Any,
              topk_ids: Any) -> Any:
        return run_op(state, hidden_states, topk_weights, topk_ids)

    def fast_call(self, state: ZentorchState, guard: md.FastGuard) -> Any:
        """The C++ entry for plain calls (int32 / int64 ids, float weights, contiguous, no id
        repeated in a row), or None without the native module or for a config whose calls
        need rewriting (top_k == 1, router weight on input)."""
        module = native.load()
        if module is None or not state.plain:
            return None
        c = state.config
        return module.FastCall(state.w13, state.w2, state.w13_bias, state.w2_bias, state.act,
                               c.hidden_size, c.top_k, c.num_experts, c.dtype,
                               list(guard.watched), list(guard.versions),
                               state.w13_scales, state.w2_scales, state.threads).entry()

    def diagnostics(self) -> Mapping[str, str]:
        version, text = library_status()
        out = {"zentorch": text}
        if version is not None:
            out["C++ decode entry"] = native.describe()
        return out


# The copies of the weights a prepared layer keeps besides the caller's (docs/performance.md,
# "Memory (Zen 4)", bench_memory.py): the op's cache of every expert, keyed by the address
# of the buffer it was handed, and that buffer (a private copy; in fp32 the caller's own
# tensor): bf16 2.05x, int8 2.03x, int4 g128 2.2x.
WEIGHT_COPIES = {"float": 2.1, "int8": 2.1, "int4": 2.3}


def avoided_hosts(caps: md.Capabilities) -> tuple[str, ...]:
    """The hosts whose layers leave zentorch out of their routing by default (docs/vllm.md,
    "Backends left out inside vLLM"), as measured per kind of CPU, C2-shaped checkpoints,
    the plugin against vLLM's own path in one driver:

    - without AVX512-BF16 (Zen 3): routed inside vLLM's CPU worker it slowed the whole
      engine, the other kernels' calls included (fp32 decode 0.18-0.81x of vLLM's own path,
      prefill 0.73-0.94x; left out: 1.10x and 1.05x): left out of vLLM's layers;
    - with AVX512-BF16 (Zen 4): no such slowdown, and left out the engine lost to vLLM's
      own path (bf16 decode batch 8 0.92x, prefill 512 0.82x; fp32 prefill 0.98x) where
      with it bf16 was 1.04-1.08x and fp32 prefill 1.04x: it competes.

    Other CPUs without AVX512-BF16 (Zen 1) are not measured and keep Zen 3's answer."""
    return () if caps.avx512_bf16 else ("vllm",)


@md.hookimpl
def moe_dispatch_backends() -> list[md.BackendSpec]:
    version, _ = library_status()  # imports zentorch now: its op is registered from here on
    # validates_ids: the op raises "topk_id value 64 is outside [0, 8)" for any id out of
    # range, negative ones included (tests/test_bad_input.py::test_bad_ids_on_every_backend_
    # and_policy checks it through the layer), so the layer leaves the range check to it.
    return [md.BackendSpec(NAME, PRIORITY, ZentorchBackend(),
                           description="AMD zentorch fused MoE op (zentorch_fused_moe)",
                           version=version or _dist_version(), validates_ids=True,
                           ops={OP_NAME: EXPECTED_SCHEMA},
                           env_vars=_gate.ENV_VARS + (native.ENV, native.DIR_ENV),
                           weights=("float", "int8", "int4"),
                           avoid_hosts=avoided_hosts(md.Capabilities.detect()),
                           weight_copies=WEIGHT_COPIES)]
