"""Boundary checks for weights and forward inputs. O(1) in the data, except the id range."""

from __future__ import annotations

import torch

from ._config import MoEConfig, dtype_name
from ._errors import InvalidArgumentError, InvalidTypeError
from ._quant import QuantizedExperts
from ._spec import LayerWeights
from .kernels._ids import id_range

_INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, value: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(name, value, f"a torch.Tensor of shape {shape} and dtype {dtype}")
    if value.device.type != "cpu":
        raise InvalidArgumentError(name, value, f"a CPU tensor (got device {value.device})")
    if tuple(value.shape) != tuple(shape):
        raise InvalidArgumentError(name, value, f"shape {tuple(shape)}")
    if value.dtype != dtype:
        raise InvalidTypeError(name, value, f"dtype {dtype} (the config's dtype)")
    return value


def _held(name: str, t: torch.Tensor) -> None:
    """A weight the layer holds: its version counter is how an in-place change is caught."""
    if t.is_inference():
        raise InvalidArgumentError(
            name, "an inference tensor (made under torch.inference_mode())",
            "a normal tensor: torch tracks no in-place change of an inference tensor, and the "
            "layer's copies rely on that; make the weights outside inference_mode (or pass a "
            "clone() made outside it). Calls may run under inference_mode")


def check_weights(config: MoEConfig, w13: object, w2: object, w13_bias: object,
                  w2_bias: object) -> LayerWeights:
    """The caller's weights: float tensors for a float config, one QuantizedExperts (given
    as ``w13``) for a quantized one."""
    scheme = config.weight_scheme
    if isinstance(w13, QuantizedExperts):
        if scheme is None:
            raise InvalidTypeError("w13", w13, f"float tensors of dtype {config.dtype}: the config "
                                   "has float weights (weight_scheme=None)")
        if w2 is not None or w13_bias is not None or w2_bias is not None:
            raise InvalidArgumentError("w2", "a second argument", "nothing besides the "
                                       "QuantizedExperts (its biases travel with it)")
        return _check_quantized(config, w13)
    if scheme is not None:
        raise InvalidTypeError("w13", w13, f"a moe_dispatch.QuantizedExperts ({scheme.describe()}): "
                               "the config has quantized weights; md.quantize_experts() makes one")
    _held("w13", check_tensor("w13", w13, config.w13_shape, config.dtype))
    _held("w2", check_tensor("w2", w2, config.w2_shape, config.dtype))
    _check_biases(config, w13_bias, w2_bias)
    return LayerWeights(config, w13, w2, w13_bias, w2_bias)  # type: ignore[arg-type]


def _check_quantized(config: MoEConfig, q: QuantizedExperts) -> LayerWeights:
    if q.scheme != config.weight_scheme:
        raise InvalidArgumentError("w13.scheme", q.scheme.describe(),
                                   f"the config's weight_scheme ({config.weight_scheme.describe()})")  # type: ignore[union-attr]
    for name, t, shape in (("w13", q.w13, config.w13_shape), ("w2", q.w2, config.w2_shape)):
        if tuple(t.shape) != tuple(shape):
            raise InvalidArgumentError(f"{name}.shape", list(t.shape), f"{list(shape)}")
        for field in ("qweight", "scales", "zeros"):
            part = getattr(t, field)
            if part is not None and part.device.type != "cpu":
                raise InvalidArgumentError(f"{name}.{field}", part, "a CPU tensor")
            if part is not None:
                _held(f"{name}.{field}", part)
    _check_biases(config, q.w13_bias, q.w2_bias)
    return LayerWeights(config, q.w13.qweight, q.w2.qweight, q.w13_bias, q.w2_bias, quantized=q)


def _check_biases(config: MoEConfig, w13_bias: object, w2_bias: object) -> None:
    for name, bias, shape in (("w13_bias", w13_bias, config.w13_bias_shape),
                              ("w2_bias", w2_bias, config.w2_bias_shape)):
        if config.has_bias:
            if bias is None:
                raise InvalidArgumentError(name, None, f"a tensor of shape {shape}: the config "
                                           "has has_bias=True")
            _held(name, check_tensor(name, bias, shape, config.dtype))
        elif bias is not None:
            raise InvalidArgumentError(name, bias, "None: the config has has_bias=False "
                                       "(build the config with has_bias=True to use biases)")


def check_forward(config: MoEConfig, hidden_states: object, topk_weights: object,
                  topk_ids: object) -> int:
    """Validate forward's arguments; returns T. Raises typed errors naming the argument."""
    if not isinstance(hidden_states, torch.Tensor):
        raise InvalidTypeError("hidden_states", hidden_states, "a torch.Tensor [T, H]")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != config.hidden_size:
        raise InvalidArgumentError("hidden_states", hidden_states,
                                   f"a 2-D tensor [T, {config.hidden_size}] (H={config.hidden_size})")
    if hidden_states.dtype != config.dtype:
        raise InvalidTypeError("hidden_states", hidden_states,
                               f"dtype {config.dtype} (the layer's dtype, {dtype_name(config.dtype)})")
    if hidden_states.device.type != "cpu":
        raise InvalidArgumentError("hidden_states", hidden_states, "a CPU tensor")
    tokens = hidden_states.shape[0]
    shape = (tokens, config.top_k)
    for name, value in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(value, torch.Tensor):
            raise InvalidTypeError(name, value, f"a torch.Tensor of shape {shape} [T, top_k]")
        if tuple(value.shape) != shape:
            raise InvalidArgumentError(name, value, f"shape {shape} [T, top_k]")
        if value.device.type != "cpu":
            raise InvalidArgumentError(name, value, "a CPU tensor")
    if not topk_weights.is_floating_point():  # type: ignore[union-attr]
        raise InvalidTypeError("topk_weights", topk_weights, "a floating-point dtype (float32)")
    if topk_ids.dtype not in _INT_DTYPES:  # type: ignore[union-attr]
        raise InvalidTypeError("topk_ids", topk_ids, "dtype torch.int32 or torch.int64")
    if tokens:
        lo_i, hi_i = id_range(topk_ids)  # type: ignore[arg-type]
        if lo_i < 0 or hi_i >= config.num_experts:
            bad = lo_i if lo_i < 0 else hi_i
            raise InvalidArgumentError("topk_ids", f"a tensor containing {bad}",
                                       f"expert ids in [0, {config.num_experts}) (E={config.num_experts})")
    return tokens
