"""Hugging Face transformers integration: ``experts_implementation="moe_dispatch"``.

    import moe_dispatch.hf
    moe_dispatch.hf.register()            # once; importing this module does not register
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_dispatch")

transformers 5 routes expert computation through ``transformers.integrations.moe``: experts
classes decorated with ``@use_experts_implementation`` look up
``config._experts_implementation`` in ``ExpertsInterface`` on every forward. This module
registers a function there that builds (once, lazily, cached on the experts module) a prepared
:class:`moe_dispatch.MoELayer` from the module's weights and runs it.

Layouts: Qwen-MoE, Mixtral, OLMoE, DeepSeek and most others store ``gate_up_proj [E, 2I, H]``
(gate rows first) and ``down_proj [E, H, I]``: moe-dispatch's canonical layout, used as is.
gpt-oss stores ``gate_up_proj [E, H, 2I]`` (gate/up interleaved) and ``down_proj [E, I, H]``
with biases: passed as transposed views (the backends copy what they need), activation
``swigluoai`` after checking alpha = 1.702 and limit = 7.0.

The activation is the experts module's own ``act_fn`` (what eager runs), the config's
``hidden_act`` only for a module without one; top-k is the call's ``top_k_index.shape[1]``.

HF's parameters are never modified. A family or activation that cannot be represented
exactly raises :class:`HFIntegrationError` naming the family and the missing feature, before
any number is computed.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._config import Activation, MoEConfig
from ._autograd import forward_only, grad_enabled
from ._errors import InvalidTypeError, MoEDispatchError
from ._layer import MoELayer
from ._spec import storage_id
from .kernels import version_of as _version_of

from .hf_config import HF_ACTIVATIONS as _ACTIVATIONS

NAME = "moe_dispatch"
_LOCK = threading.Lock()
# Options for the layers this integration builds (MoELayer keyword arguments).
LAYER_OPTIONS: dict[str, Any] = {}
# Bumped when register() changes LAYER_OPTIONS; part of every cached layer's key, so a layer
# built with the old options is rebuilt at its next forward instead of running on.
_GENERATION = 0


class HFIntegrationError(MoEDispatchError, ValueError):
    """An HF experts module moe-dispatch cannot represent exactly."""


def register(name: str = NAME, **layer_options: Any) -> None:
    """Register ``name`` in transformers' ExpertsInterface (idempotent).

    ``layer_options`` are passed to every :class:`MoELayer` built (``backend=``,
    ``exclude=``, ``policy=``...). New options also apply to the layers already cached: each
    is rebuilt at its next forward (the same options again rebuild nothing).
    """
    global _GENERATION
    from transformers.integrations.moe import ExpertsInterface
    with _LOCK:
        if layer_options != LAYER_OPTIONS:
            LAYER_OPTIONS.clear()
            LAYER_OPTIONS.update(layer_options)
            _GENERATION += 1
    ExpertsInterface.register(name, experts_forward)


def invalidate(model: torch.nn.Module) -> int:
    """Drop the layers cached on ``model``'s experts modules (``model`` itself included).

    The next forward of each rebuilds its layer from the current weights. Needed after a write
    the cache cannot see: writes through ``.data`` into the same storage
    (``p.data.mul_(2)``, ``p.data.copy_(w)``) move neither the version counter nor the storage.
    Returns how many layers were dropped.
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidTypeError("model", model, "a torch.nn.Module (a transformers model or one "
                               "of its experts modules)")
    dropped = 0
    with _LOCK:
        for module in model.modules():
            cached = module.__dict__.pop("_moe_dispatch_layer", None)
            if cached is not None and cached[1] is not None:  # a copy's placeholder: nothing
                dropped += 1
    return dropped


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ExpertsInterface function: ``[T, H]`` tokens, ``[T, K]`` ids and weights."""
    layer = layer_for(module, top_k_index.shape[1])
    # The layer reads detached views of the parameters: their gradients would be silently
    # missing, whatever the backend, so such a call runs without autograd and its backward
    # raises (moe_dispatch/_autograd.py).
    params = [p for p in module._parameters.values() if p is not None and p.requires_grad] \
        if grad_enabled() else ()
    # The ids and weights as HF gives them (int64, the model's dtype): the layer's native
    # entry takes them so, where a .to() here would be a torch op running cold per call.
    if not params:
        return layer(hidden_states, top_k_weights, top_k_index)
    with torch.no_grad():
        out = layer(hidden_states, top_k_weights, top_k_index)
    return forward_only(out, "moe-dispatch's transformers experts function", hidden_states,
                        top_k_weights, params,
                        why="it reads the experts' parameters as detached views",
                        way_out="to train, switch the model to experts_implementation='eager' "
                                "or 'grouped_mm'")


def _family(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None) or "unknown"
    return f"{model_type} ({type(module).__name__})"


def describe(module: torch.nn.Module, top_k: int | None = None
             ) -> tuple[MoEConfig, dict[str, torch.Tensor | None]]:
    """The MoEConfig and canonical weights (views, no copies) of an HF experts module.

    ``top_k``: the width of the routing the module is called with (``top_k_index.shape[1]``);
    None reads ``config.num_experts_per_tok``, which some families lack or do not use.
    """
    family = _family(module)
    if not getattr(module, "has_gate", True):
        raise HFIntegrationError(f"{family}: experts without a gate projection (has_gate=False) "
                                 "are not supported: moe-dispatch runs gated experts")
    if getattr(module, "has_post_expert_norm", False):
        raise HFIntegrationError(f"{family}: a post-expert norm (has_post_expert_norm) is not "
                                 "supported")
    if getattr(module, "_is_expert_parallel", False):
        raise HFIntegrationError(f"{family}: HF expert parallelism is not supported here; use "
                                 "moe_dispatch.distributed")
    gate_up = module.gate_up_proj.detach()  # detach shares storage and version counter
    down = module.down_proj.detach()
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    has_bias = bool(getattr(module, "has_bias", False))
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    from transformers.integrations.moe import _default_apply_gate
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    if own_gate or not concatenated:
        activation = _custom_gate(module, family, concatenated)
    else:
        activation = _activation(module, family)
    config = MoEConfig(experts, _top_k(module, family) if top_k is None else top_k, hidden,
                       inter, activation=activation, dtype=gate_up.dtype, has_bias=has_bias)
    weights = {"w13": gate_up, "w2": down,
               "w13_bias": module.gate_up_proj_bias.detach() if has_bias else None,
               "w2_bias": module.down_proj_bias.detach() if has_bias else None}
    return config, weights


def _top_k(module: torch.nn.Module, family: str) -> int:
    top_k = int(getattr(getattr(module, "config", None), "num_experts_per_tok", 0) or 0)
    if top_k <= 0:
        raise HFIntegrationError(f"{family}: config.num_experts_per_tok is missing; pass "
                                 "top_k (the routing's width) to describe() / layer_for()")
    return min(top_k, module.gate_up_proj.shape[0])


def _act_types() -> dict[Any, Activation]:
    """``act_fn`` classes and functions whose math is exactly one of moe-dispatch's
    activations (erf GELU and the tanh GELU are different functions: never mixed up)."""
    from transformers import activations as hf_act
    F = torch.nn.functional
    known: dict[Any, Activation] = {torch.nn.SiLU: Activation.SILU, F.silu: Activation.SILU,
                                    F.gelu: Activation.GELU}
    for name, act in (("SiLUActivation", Activation.SILU),
                      ("GELUActivation", Activation.GELU),  # F.gelu or its erf formula
                      ("GELUTanh", Activation.GELU_TANH),  # F.gelu(approximate="tanh")
                      ("PytorchGELUTanh", Activation.GELU_TANH),  # older name of GELUTanh
                      ("NewGELUActivation", Activation.GELU_TANH)):  # the tanh formula
        cls = getattr(hf_act, name, None)  # not every transformers version has each
        if cls is not None:
            known[cls] = act
    return known


def _activation(module: torch.nn.Module, family: str) -> Activation:
    """What the default gate (``act_fn(gate) * up``) computes: the module's ``act_fn``, which
    some families fix whatever the config says (Aria, Lfm2-MoE) or read from another key
    (Gemma 4: ``hidden_activation``); ``config.hidden_act`` only for a module without one."""
    act = getattr(module, "act_fn", None)
    if act is None:
        name = getattr(getattr(module, "config", None), "hidden_act", None)
        if name not in _ACTIVATIONS:
            raise HFIntegrationError(f"{family}: no act_fn and config.hidden_act={name!r}; "
                                     f"supported: {', '.join(sorted(_ACTIVATIONS))}")
        return _ACTIVATIONS[name]
    if type(act) is torch.nn.GELU:  # its math depends on an attribute
        found = {"none": Activation.GELU, "tanh": Activation.GELU_TANH}.get(act.approximate)
    else:
        # Exact types only: a subclass may override forward with other math.
        found = _act_types().get(type(act) if isinstance(act, torch.nn.Module) else act)
    if found is None:
        what = type(act).__name__ if isinstance(act, torch.nn.Module) else \
            getattr(act, "__qualname__", repr(act))
        known = sorted(getattr(k, "__qualname__", str(k)) for k in _act_types())
        raise HFIntegrationError(f"{family}: activation act_fn={what} is not supported; "
                                 f"supported act_fn: {', '.join(known)}, GELU")
    return found


def _custom_gate(module: torch.nn.Module, family: str, concatenated: bool) -> Activation:
    """gpt-oss's clamped SwiGLU is swigluoai exactly when alpha=1.702, limit=7, interleaved."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if concatenated or alpha is None or limit is None:
        raise HFIntegrationError(f"{family}: a custom gate (_apply_gate) that moe-dispatch "
                                 "cannot identify; supported: gpt-oss clamped SwiGLU")
    if float(alpha) != 1.702 or float(limit) != 7.0:
        raise HFIntegrationError(f"{family}: clamped SwiGLU with alpha={alpha}, limit={limit}; "
                                 "swigluoai fixes alpha=1.702 and limit=7.0")
    return Activation.SWIGLUOAI


@torch.compiler.disable  # built eagerly: a trace would time the tuning symbolically
def layer_for(module: torch.nn.Module, top_k: int | None = None) -> MoELayer:
    """The prepared MoELayer for an HF experts module, built once and cached on it.

    ``top_k``: the routing's width (``top_k_index.shape[1]``); None reads the config's.
    Rebuilt when the module's parameters are replaced, changed in place, or given new data
    (``.to()``, ``.half()``, ``p.data = ...``), when ``top_k`` changes, and when
    :func:`register` changes the options. Writes through ``.data`` into the same storage
    are not seen: call :func:`invalidate` after them.
    """
    if top_k is None:
        top_k = _top_k(module, _family(module))
    # The module's own parameters, read from _parameters: module.parameters() walks them
    # through named_members and a memo set, measured ~60 us per decode call here.
    params = [p for p in module._parameters.values() if p is not None]
    # The storage too: a .to() / .half() of the model, or a .data assignment, keeps each
    # parameter and its version but replaces its data.
    try:
        key = (top_k, _GENERATION, tuple(map(id, params)), tuple(map(_version_of, params)),
               tuple(map(storage_id, params)))
    except RuntimeError:  # an inference tensor has no version: load_weights says so, typed
        key = None
    cached = getattr(module, "_moe_dispatch_layer", None)
    if key is not None and cached is not None and cached[0] == key:
        return cached[1]
    with _LOCK:
        cached = getattr(module, "_moe_dispatch_layer", None)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        config, weights = describe(module, top_k)
        layer = MoELayer(config, **LAYER_OPTIONS).load_weights(**weights).prepare()
        # Plain attribute, not a submodule: it must not appear in state_dict or .parameters().
        object.__setattr__(module, "_moe_dispatch_layer", _Cached((key, layer)))
        return layer


class _Cached(tuple):
    """(key, layer) cached on an experts module. A copy or a pickle of the model starts
    without it (its parameters are new tensors: their layer is built at its first forward),
    so copy.deepcopy(model) and torch.save(model) neither copy nor pickle a prepared layer."""

    def __reduce__(self) -> tuple:
        return (_Cached, ((None, None),))

    def __deepcopy__(self, memo: dict) -> "_Cached":
        return _Cached((None, None))
