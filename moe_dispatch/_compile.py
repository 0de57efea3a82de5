"""torch.compile support: the dispatch as a ``torch.library`` custom op with a fake kernel.

Dynamo cannot trace the resolver or the backends' Python (and must not: the choice is made
at ``prepare()``), so under compilation ``MoELayer.forward`` emits one opaque op,
``moe_dispatch::moe_forward``, carrying an integer handle to the layer. Its fake (meta)
implementation returns an empty tensor of the input's shape and dtype, so graphs compile
with ``fullgraph=True``; at run time the real implementation is the eager forward, with all
its checks.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from typing import Protocol

import torch


class _Runs(Protocol):
    """What the op needs of a layer (MoELayer): its eager call. A protocol, not an import of
    the layer, which itself imports this module to register."""

    def run(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor: ...

_LOCK = threading.Lock()
_LAYERS: "weakref.WeakValueDictionary[int, _Runs]" = weakref.WeakValueDictionary()
# Layers a torch.jit.trace recorded: the trace holds only the handle, and
# `model = torch.jit.trace(model, ...)` drops the last other reference.
_TRACED: dict[int, _Runs] = {}


def register_layer(layer: _Runs) -> int:
    """A handle for the layer, random: a trace saved and loaded in another process finds no
    layer there (LayerStateError) instead of whichever layer got the same number."""
    with _LOCK:
        handle = secrets.randbits(62)
        while handle in _LAYERS:
            handle = secrets.randbits(62)
        _LAYERS[handle] = layer
    return handle


def keep_for_trace(handle: int, layer: _Runs) -> None:
    """Keep a traced layer alive for the process (a trace refers to it by handle only)."""
    with _LOCK:
        _TRACED[handle] = layer


@torch.library.custom_op("moe_dispatch::moe_forward", mutates_args=())
def moe_forward(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                handle: int) -> torch.Tensor:
    layer = _LAYERS.get(handle)
    if layer is None:
        from ._errors import LayerStateError
        raise LayerStateError(
            f"moe_dispatch::moe_forward: no layer with handle {handle} in this process: a "
            "traced or compiled MoELayer runs only in the process that made it (its kernels' "
            "states are not serialised); trace or compile the model again here")
    return layer.run(hidden_states, topk_weights, topk_ids)


@moe_forward.register_fake
def _(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
      handle: int) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


# Backward: an op that raises when it runs. Why not raise in the autograd formula itself:
# AOTAutograd traces the backward when it compiles a graph whose inputs require grad, so a
# formula that raises would fail the forward's compilation (inference in grad mode, as a
# plain model call runs); the op's fake kernel lets the trace through, and only a real
# backward raises. (Without any formula the compile fails the same way.)
@torch.library.custom_op("moe_dispatch::no_backward", mutates_args=())
def no_backward(grad: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ._errors import NotDifferentiableError
    raise NotDifferentiableError.through(
        "moe_dispatch::moe_forward, an MoELayer under torch.compile",
        "the compiled layer is one op that computes the forward only",
        "to train through the experts, run the layer eagerly on a backend whose spec is "
        "differentiable (BackendSpec.differentiable)")


@no_backward.register_fake
def _(grad: torch.Tensor, topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return grad.new_empty(grad.shape), topk_weights.new_empty(topk_weights.shape)


def _save_router_weights(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad: torch.Tensor) -> tuple:
    (topk_weights,) = ctx.saved_tensors
    grad_x, grad_tw = torch.ops.moe_dispatch.no_backward(grad, topk_weights)
    return grad_x, grad_tw, None, None


moe_forward.register_autograd(_backward, setup_context=_save_router_weights)


def moe_experts(layer: _Runs, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Functional entry point: ``layer``'s experts on one batch; traceable by torch.compile."""
    return layer(hidden_states, topk_weights, topk_ids)
