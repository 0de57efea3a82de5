"""What the op needs before any weight exists: its schema, the ISA, dtype and activation.

Each rule is a trap of the op measured on these machines (docs/backends/zentorch.md). The
gate is a pure function of (config, capabilities, the env variables in ENV_VARS).
"""

from __future__ import annotations

import os

import torch

import moe_dispatch as md
from moe_dispatch.kernels import dtype_name, op_problem

OP_NAME = "zentorch::zentorch_fused_moe"
NO_ZENTORCH = "MOE_DISPATCH_NO_ZENTORCH"
WEIGHT_CACHE = "ZENDNNL_MATMUL_WEIGHT_CACHE"
ENV_VARS = (NO_ZENTORCH, WEIGHT_CACHE)
INSTALL_HINT = "install zentorch==2.13.0.2 (x86_64 Linux, matching torch 2.13.0)"

# The positional arguments this backend passes, by name and type (zentorch 2.13).
EXPECTED_ARGS: tuple[tuple[str, str], ...] = (
    ("output", "Tensor"), ("input", "Tensor"), ("w13", "Tensor"), ("w2", "Tensor"),
    ("w13_bias", "Optional[Tensor]"), ("w2_bias", "Optional[Tensor]"),
    ("topk_weights", "Tensor"), ("topk_id", "Tensor"), ("skip_weighted", "bool"),
    ("act", "str"),
)

# The full schema of zentorch 2.13.0.2, for simulated machines (docs, tests).
EXPECTED_SCHEMA = (
    "zentorch::zentorch_fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2, "
    "Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, bool skip_weighted, "
    "str act, Tensor? w13_scales=None, Tensor? w2_scales=None, *, "
    "str zentorch_op_name=\"zentorch::zentorch_fused_moe\") -> ()")


def _disabled() -> bool:
    return os.environ.get(NO_ZENTORCH, "").strip() not in ("", "0")


def supports_config(config: md.MoEConfig, caps: md.Capabilities, library: str) -> md.Decision:
    """``library``: the zentorch version this process imported, or why it could not."""
    if _disabled():
        return md.reject(f"{NO_ZENTORCH} is set: the zentorch backend is off")
    problem = op_problem(caps, OP_NAME, EXPECTED_ARGS, source=f"zentorch: {library}",
                         hint=INSTALL_HINT)
    if problem:
        return md.reject(problem)
    if not caps.is_amd_zen:
        return md.reject(f"zentorch's fused MoE runs on AMD Zen CPUs; this CPU is "
                         f"{caps.cpu_vendor} {caps.cpu_model or '(unknown model)'}".rstrip())
    if config.dtype == torch.bfloat16 and not caps.avx512_bf16:
        # Measured on a Zen 3 (AVX2 only) with zentorch 2.13.0.2: bf16 returns NaN or
        # garbage for H >= 1024 or I >= 768, and segfaults at H=1024, I=1408. A
        # self-check cannot catch a segfault, so the gate is the exact ISA feature.
        return md.reject("bfloat16 needs AVX512-BF16, which this CPU lacks (Zen "
                         f"{caps.zen_generation or '?'}): without it zentorch's bf16 MoE "
                         "returns wrong numbers or crashes; float32 is accepted")
    if config.dtype == torch.float16 and not caps.avx512_fp16:
        return md.reject("float16 needs avx512fp16, which this CPU lacks; use bfloat16")
    name = dtype_name(config.dtype)
    if config.activation is md.Activation.GELU_TANH and config.dtype != torch.bfloat16:
        return md.reject(f"the op computes erf GELU for 'gelu_tanh'; the tanh approximation "
                         f"differs by up to 4.7e-4, above {name} tolerance (accepted for "
                         "bfloat16 only)")
    if config.activation is md.Activation.SWIGLUOAI and config.dtype != torch.bfloat16:
        return md.reject("the op clamps the swigluoai gate at -7 as well as +7; gpt-oss "
                         "clamps only from above, which differs by up to ~5e-5*|up+1| where "
                         f"gate < -7, above {name} tolerance (accepted for bfloat16 only)")
    if config.num_experts < 2:
        return md.reject("the op needs at least 2 experts (it refuses a call in which a "
                         "single expert receives every token); num_experts=1")
    if config.apply_router_weight_on_input and config.top_k != 1:
        return md.reject("router weight on input maps to skip_weighted, which the op "
                         "supports only with top_k == 1")
    if os.environ.get(WEIGHT_CACHE, "").strip() == "0":
        return md.reject(f"{WEIGHT_CACHE}=0 disables zentorch's weight cache: every call "
                         "repacks all experts (20-30x slower); unset it")
    note = " (gelu_tanh runs as erf GELU: invisible in bfloat16)" \
        if config.activation is md.Activation.GELU_TANH else ""
    return md.accept(f"zentorch fused MoE on AMD Zen {caps.zen_generation}{note}")


def supports_layer(weights: md.LayerWeights) -> md.Decision:
    config = weights.config
    for name, t in weights.tensors():
        if t.device.type != "cpu":
            return md.reject(f"{name} is on {t.device}; the op runs on CPU tensors only")
        if weights.quantized is not None and name not in ("w13_bias", "w2_bias"):
            continue  # quantized values and scales: their dtypes are the scheme's (checked)
        if t.dtype != config.dtype:
            return md.reject(f"{name} has dtype {t.dtype}, the config says {config.dtype}")
        if t.is_sparse or t.layout != torch.strided:
            return md.reject(f"{name} has layout {t.layout}; the op needs dense strided tensors")
    return md.accept("the op runs on private contiguous copies made at prepare()")
