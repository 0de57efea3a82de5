"""The exception hierarchy.

Every error raised on purpose by moe-dispatch derives from :class:`MoEDispatchError`, and
also from the builtin that fits (``ValueError`` for bad values, ``TypeError`` for bad
types, ``LookupError`` for unknown names, ``RuntimeError`` for state), so callers can
catch either family.
"""

from __future__ import annotations

from typing import Any


class MoEDispatchError(Exception):
    """Base class of every error moe-dispatch raises on purpose."""


class InvalidArgumentError(MoEDispatchError, ValueError):
    """An argument has a value outside what is accepted.

    The message names the argument, the value it got and what would be accepted.
    """

    def __init__(self, argument: str, value: Any, expected: str) -> None:
        self.argument = argument
        self.value = value
        self.expected = expected
        super().__init__(f"{argument}={_short(value)} is invalid: expected {expected}")


class InvalidTypeError(MoEDispatchError, TypeError):
    """An argument has the wrong type or dtype."""

    def __init__(self, argument: str, value: Any, expected: str) -> None:
        self.argument = argument
        self.value = value
        self.expected = expected
        super().__init__(f"{argument} has {_short(value)}: expected {expected}")


class UnknownBackendError(MoEDispatchError, LookupError):
    """A backend name that no registered plugin provides."""


class BackendRejectedError(MoEDispatchError, ValueError):
    """A forced backend declined the configuration or the layer."""

    def __init__(self, backend: str, reason: str, stage: str) -> None:
        self.backend = backend
        self.reason = reason
        self.stage = stage
        super().__init__(f"backend {backend!r} was forced but rejects the {stage}: {reason}")


class NoBackendError(MoEDispatchError, RuntimeError):
    """No registered backend accepts the configuration or the layer."""


class PluginError(MoEDispatchError, RuntimeError):
    """A plugin is malformed: bad records, duplicate names, hooks that raise."""


class LayerStateError(MoEDispatchError, RuntimeError):
    """A layer used out of order: forward before prepare, prepare before load_weights."""


class WeightsModifiedError(LayerStateError):
    """The caller changed a prepared layer's weights in place; the prepared copy is stale."""


class NotDifferentiableError(MoEDispatchError, RuntimeError):
    """A backward pass through a layer call whose backend computes the forward only."""

    @classmethod
    def through(cls, what: str, why: str, way_out: str) -> "NotDifferentiableError":
        """The error for a backward through ``what``, which has no gradient because of
        ``why``; ``way_out`` says how to train through the experts."""
        return cls(f"backward through {what}: {why}, so no gradient would reach the hidden "
                   "states, the router weights or the expert weights. For inference call the "
                   f"model under torch.no_grad() or torch.inference_mode(); {way_out}")


class KernelError(MoEDispatchError, RuntimeError):
    """A backend's kernel failed at run time and no fallback was allowed or possible."""


def _short(value: Any) -> str:
    """A one-line rendering of ``value`` for an error message; tensors by shape and dtype."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"<tensor shape={tuple(shape)} dtype={dtype}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
