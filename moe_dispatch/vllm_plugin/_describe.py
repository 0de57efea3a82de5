"""What of a vLLM MoE layer moe-dispatch serves exactly, read off the layer's attributes.

Kept free of vLLM imports: it reads the attributes vLLM's ``RoutedExperts`` layer and its
``FusedMoEConfig`` carry, so the rules are tested without an engine. Anything not mapped
exactly is a :class:`NotServed` with the reason, and the layer stays on vLLM's own path.
"""

from __future__ import annotations

from typing import Any

import torch

from .._config import SUPPORTED_DTYPES, Activation, MoEConfig

# vLLM's MoEActivation values that are moe-dispatch's activations with the same math.
# swigluoai is interleaved in both (vLLM's swigluoai_uninterleave is not).
ACTIVATIONS: dict[str, Activation] = {
    "silu": Activation.SILU,
    "gelu": Activation.GELU,
    "gelu_tanh": Activation.GELU_TANH,
    "swigluoai": Activation.SWIGLUOAI,
}
# swigluoai's constants in moe-dispatch (gpt-oss): a layer with others is not served.
SWIGLUOAI_PARAMS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0}


class NotServed(Exception):
    """A layer moe-dispatch does not run exactly; ``str()`` is the reason."""


def _activation_name(layer: Any) -> str:
    act = getattr(layer, "activation", None)
    if act is None:
        act = getattr(layer.moe_config, "activation", None)
    return str(getattr(act, "value", act)).lower()


def describe(layer: Any) -> tuple[MoEConfig, dict[str, torch.Tensor | None]]:
    """The MoEConfig and canonical weights (detached views, never copies) of a vLLM layer
    whose weights are loaded, or :class:`NotServed`."""
    moe = layer.moe_config
    if getattr(layer, "expert_map", None) is not None:
        raise NotServed("expert parallelism (an expert_map: local experts of "
                        f"{getattr(layer, 'global_num_experts', '?')}) is not mapped")
    if getattr(moe, "is_lora_enabled", False):
        raise NotServed("LoRA on the experts is not supported")
    if not getattr(moe, "is_act_and_mul", True):
        raise NotServed(f"ungated experts (activation {_activation_name(layer)!r}): "
                        "moe-dispatch runs gated experts")
    name = _activation_name(layer)
    if name not in ACTIVATIONS:
        raise NotServed(f"activation {name!r} (supported: {', '.join(sorted(ACTIVATIONS))})")
    activation = ACTIVATIONS[name]
    if activation is Activation.SWIGLUOAI:
        for attr, value in SWIGLUOAI_PARAMS.items():
            got = getattr(layer, attr, None)
            if got is not None and float(got) != value:
                raise NotServed(f"swigluoai with {attr}={got}; moe-dispatch's swigluoai "
                                f"fixes {attr}={value}")
    w13 = layer.w13_weight.detach()  # shares storage and version counter
    w2 = layer.w2_weight.detach()
    if w13.dtype not in SUPPORTED_DTYPES:
        raise NotServed(f"weights of dtype {w13.dtype} (a quantization method's storage?); "
                        "served: bfloat16, float16, float32")
    if w13.dim() != 3 or w2.dim() != 3:
        raise NotServed(f"weights of shapes {tuple(w13.shape)} / {tuple(w2.shape)}; expected "
                        "w13 [E, 2I, H] and w2 [E, H, I]")
    experts, two_i, hidden = w13.shape
    top_k = int(moe.experts_per_token)
    if getattr(layer, "apply_router_weight_on_input", False) and top_k != 1:
        raise NotServed(f"router weight on the input with top_k={top_k} (vLLM allows it for "
                        "top_k=1 only)")
    has_bias = bool(getattr(moe, "has_bias", False))
    config = MoEConfig(experts, top_k, hidden, two_i // 2, activation=activation,
                       dtype=w13.dtype, has_bias=has_bias)
    weights: dict[str, torch.Tensor | None] = {
        "w13": w13, "w2": w2,
        "w13_bias": layer.w13_bias.detach() if has_bias else None,
        "w2_bias": layer.w2_bias.detach() if has_bias else None}
    return config, weights


def summary(layer: Any) -> str:
    """One line: the backend per token count a prepared MoELayer runs, and every skip."""
    table = layer.tuned_table
    groups: list[list[Any]] = []  # [winner, first T, last bucket]
    for bucket, name in sorted((table or {}).items()):
        if groups and groups[-1][0] == name:
            groups[-1][2] = bucket
        else:
            groups.append([name, groups[-1][2] + 1 if groups else 1, bucket])
    if len(groups) > 1:
        *head, (name, first, _) = groups
        chosen = ", ".join(f"{n} (T={a}..{b})" if a != b else f"{n} (T={a})"
                           for n, a, b in head) + f", {name} (T>={first})"
    else:
        chosen = f"{layer.backend} (every T)"
    skips = [f"{c.name}: {c.reason}" for c in layer.resolution.candidates
             if str(c.status) not in ("chosen", "standby", "not forced")]
    forced = layer.resolution.forced
    how = f"forced: {forced}" if forced else f"policy={layer.policy}"
    line = f"{layer.config.describe()} -> {chosen} [{how}]"
    return line + (f"; not used: {'; '.join(skips)}" if skips else "")
