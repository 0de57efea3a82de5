"""torch.compile support: the dispatch as a ``torch.library`` custom op with a fake kernel.

Dynamo cannot trace the resolver or the backends' Python (and must not: the choice is made
at ``prepare()``), so under compilation ``MoELayer.forward`` emits one opaque op,
``moe_dispatch::moe_forward``, carrying an integer handle to the layer. Its fake (meta)
implementation returns an empty tensor of the input's shape and dtype, so graphs compile
with ``fullgraph=True``; at run time the real implementation is the eager forward, with all
its checks.
"""

from __future__ import annotations

import itertools
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
_HANDLES = itertools.count(1)


def register_layer(layer: _Runs) -> int:
    with _LOCK:
        handle = next(_HANDLES)
        _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("moe_dispatch::moe_forward", mutates_args=())
def moe_forward(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                handle: int) -> torch.Tensor:
    layer = _LAYERS.get(handle)
    if layer is None:
        from ._errors import LayerStateError
        raise LayerStateError(f"moe_dispatch::moe_forward: layer handle {handle} no longer exists")
    return layer.run(hidden_states, topk_weights, topk_ids)


@moe_forward.register_fake
def _(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
      handle: int) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


def moe_experts(layer: _Runs, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Functional entry point: ``layer``'s experts on one batch; traceable by torch.compile."""
    return layer(hidden_states, topk_weights, topk_ids)
