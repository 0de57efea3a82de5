"""The seam in vLLM: its CPU unquantized experts class, wrapped in place.

vLLM's CPU MoE picks ``CPUUnquantizedExperts`` (or its x86 AMX subclass) in its oracle and
calls two of its methods that matter here: ``process_weights_after_loading(layer)`` right
after the checkpoint is loaded (where vLLM prepacks, replacing the layer's parameters), and
``apply(output, hidden_states, ..., topk_weights, topk_ids, ...)`` on every forward with
vLLM's own routing already done. Wrapping these two keeps vLLM's router, its
prepare/finalize steps and its shared experts, and leaves the parameters as loaded when
moe-dispatch serves the layer. Everything else (quantized experts classes, expert
parallelism, unknown activations) stays on vLLM's path, with the reason logged.

A weight update (``reload_weights``, the weight-transfer engines' layerwise reload) runs the
unquantized method's ``process_weights_after_loading`` again but not the experts'; the new
values then reach the loaded parameters through ``.data.copy_``, which no version counter
sees. So the method's hook is wrapped too: on a layer already served it drops the layer's
MoELayer (and the copies its backends hold), and the next ``apply`` builds one from the
parameters as they are then.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any, Callable

import torch

from .._errors import MoEDispatchError
from .._layer import MoELayer
from ._describe import NotServed, describe, summary

# vLLM 0.32's signature of CPUUnquantizedExperts.apply: the wrapper is installed only when
# the installed vLLM has exactly these parameters (a different vLLM is left alone).
APPLY_PARAMS = ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
                "activation", "global_num_experts", "expert_map", "a1q_scale", "a2_scale",
                "workspace13", "workspace2", "expert_tokens_meta",
                "apply_router_weight_on_input")
PWAL_PARAMS = ("self", "layer")
# vLLM's quantized CPU experts classes: not served; their layers log why once per shape.
QUANTIZED = ("CPUExpertsFp8", "CPUExpertsMxfp4", "CPUExpertsInt4", "CPUExpertsInt8")
# On the experts object: (MoELayer, weakref to vLLM's layer); (None, weakref) after a weight
# update, until the next apply rebuilds it.
_ATTR = "_moe_dispatch"
_LOGGED: set[str] = set()
_LOCK = threading.Lock()


def _once(logger: logging.Logger, level: int, key: str, msg: str, *args: Any) -> None:
    with _LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.log(level, msg, *args)


def _shape_key(layer: Any) -> str:
    moe = layer.moe_config
    w13 = getattr(layer, "w13_weight", None)
    return (f"E={moe.num_experts} top_k={moe.experts_per_token} H={moe.hidden_dim} "
            f"I={moe.intermediate_size_per_partition} "
            f"{str(getattr(moe.activation, 'value', moe.activation))} "
            f"{str(getattr(w13, 'dtype', moe.in_dtype)).replace('torch.', '')}")


def serve(layer: Any, options: dict[str, Any], logger: logging.Logger) -> MoELayer | None:
    """A prepared MoELayer for a loaded vLLM layer, or None (reason logged once per shape)."""
    try:
        config, weights = describe(layer)
        md = MoELayer(config, **options).load_weights(**weights).prepare()
    except (NotServed, MoEDispatchError) as exc:  # a reason, not a failure
        _once(logger, logging.INFO, "skip " + _shape_key(layer) + str(exc),
              "moe-dispatch: %s left to vLLM's MoE path: %s", _shape_key(layer), exc)
        return None
    except Exception as exc:  # a failing plugin never takes the engine down
        _once(logger, logging.WARNING, "fail " + _shape_key(layer),
              "moe-dispatch: %s left to vLLM's MoE path: building the layer failed (%s: %s)",
              _shape_key(layer), type(exc).__name__, exc)
        return None
    _once(logger, logging.INFO, "use " + config.describe(), "moe-dispatch: %s", summary(md))
    logger.debug("moe-dispatch: %s", md.explain())
    return md


def _params(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def install(experts_cls: type, quantized: list[type], options: Callable[[], dict[str, Any]],
            logger: logging.Logger, method_cls: type | None = None) -> bool:
    """Wrap ``experts_cls`` (vLLM's CPUUnquantizedExperts) and ``method_cls`` (its
    UnquantizedFusedMoEMethod, whose ``moe_kernel.fused_experts`` is the experts object) in
    place; False, with a warning, when their methods are not the ones this seam was written
    against. ``options()`` gives the MoELayer keyword arguments as each layer is built (not
    at install: the backends' registry is loaded only in a process that builds layers)."""
    if getattr(experts_cls, "_moe_dispatch_installed", False):
        return True
    got_apply = _params(experts_cls.apply)
    got_pwal = _params(experts_cls.process_weights_after_loading)
    got_method = (PWAL_PARAMS if method_cls is None
                  else _params(method_cls.process_weights_after_loading))
    if got_apply != APPLY_PARAMS or got_pwal != PWAL_PARAMS or got_method != PWAL_PARAMS:
        logger.warning("moe-dispatch: vLLM's %s has apply%s and process_weights_after_loading%s "
                       "(its method's: %s); the plugin knows apply%s: it stays off and vLLM's "
                       "MoE path runs", experts_cls.__name__, got_apply, got_pwal, got_method,
                       APPLY_PARAMS)
        return False
    original_pwal = experts_cls.process_weights_after_loading
    original_apply = experts_cls.apply

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        md = serve(layer, options(), logger)
        if md is None:
            return original_pwal(self, layer)
        # vLLM's parameters stay as loaded: no prepack, nothing replaced.
        setattr(self, _ATTR, (md, weakref.ref(layer)))
        return None

    def apply(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: Any, global_num_experts: int, expert_map: Any, a1q_scale: Any,
              a2_scale: Any, workspace13: Any, workspace2: Any, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        served = self.__dict__.get(_ATTR)
        if served is not None and served[0] is None:  # the first call after a weight update
            layer = served[1]()
            served = _rebuild(self, layer, options, original_pwal, logger)
            if served is None and layer is not None:  # vLLM's path prepared the layer
                w1, w2 = layer.w13_weight, layer.w2_weight
        if served is not None and expert_map is None:
            if apply_router_weight_on_input:
                # vLLM's prepare step has already scaled the input (top_k = 1).
                topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
            try:
                output.copy_(served[0](hidden_states, topk_weights, topk_ids))
                return None
            except Exception as exc:
                layer = _give_back(self, served, original_pwal, exc, logger)
                w1, w2 = layer.w13_weight, layer.w2_weight  # as vLLM's path prepared them
        return original_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                              activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                              workspace13, workspace2, expert_tokens_meta,
                              apply_router_weight_on_input)

    experts_cls.process_weights_after_loading = process_weights_after_loading
    experts_cls.apply = apply
    experts_cls._moe_dispatch_installed = True
    if method_cls is not None:
        _note_updates(method_cls)
    for cls in quantized:
        _note_quantized(cls, logger)
    return True


def _note_updates(method_cls: type) -> None:
    """Wrap the method's process_weights_after_loading: run on a layer whose experts are
    already served, it is a weight update, and the served MoELayer is dropped."""
    original = method_cls.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
        served = getattr(experts, "__dict__", {}).get(_ATTR)
        try:
            return original(self, layer)
        finally:
            if served is not None:  # the old copies go now; apply builds from the new values
                experts.__dict__[_ATTR] = (None, served[1])

    method_cls.process_weights_after_loading = process_weights_after_loading


def _rebuild(experts: Any, layer: Any, options: Callable[[], dict[str, Any]],
             original_pwal: Callable[..., Any],
             logger: logging.Logger) -> tuple[MoELayer, Any] | None:
    """A MoELayer from the layer's parameters as they are after a weight update, or None
    when moe-dispatch does not serve them (then vLLM's path prepares the layer, as it would
    have at load)."""
    experts.__dict__.pop(_ATTR, None)
    if layer is None:
        return None
    md = serve(layer, options(), logger)
    if md is None:
        original_pwal(experts, layer)
        return None
    served = (md, weakref.ref(layer))
    setattr(experts, _ATTR, served)
    logger.debug("moe-dispatch: %s rebuilt from updated weights", md.config.describe())
    return served


def _give_back(experts: Any, served: tuple[MoELayer, Any], original_pwal: Callable[..., Any],
               exc: Exception, logger: logging.Logger) -> Any:
    """moe-dispatch failed on this layer at run time (every fallback of its own included):
    hand the layer to vLLM's path for good, as vLLM would have prepared it."""
    md, layer_ref = served
    layer = layer_ref()
    logger.warning("moe-dispatch: %s failed at run time (%s: %s); vLLM's MoE path takes the "
                   "layer over", md.config.describe(), type(exc).__name__, exc)
    experts.__dict__.pop(_ATTR, None)
    if layer is None:
        raise exc
    original_pwal(experts, layer)
    return layer


def _note_quantized(cls: type, logger: logging.Logger) -> None:
    """Log once per shape that a quantized experts class stays on vLLM's kernels."""
    if getattr(cls, "_moe_dispatch_noted", False):
        return
    original = cls.process_weights_after_loading

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        _once(logger, logging.INFO, "quant " + cls.__name__ + _shape_key(layer),
              "moe-dispatch: %s left to vLLM's MoE path: quantized experts (%s) are not "
              "mapped to moe-dispatch's weight formats", _shape_key(layer), cls.__name__)
        return original(self, layer)

    cls.process_weights_after_loading = process_weights_after_loading
    cls._moe_dispatch_noted = True
