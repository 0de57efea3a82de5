"""Expert parallelism: a layer that computes this rank's share of a global MoE layer.

It wraps a local :class:`MoELayer` built for ``config.local_config()`` (this rank's
experts, one (token, slot) pair per row). Global ids are mapped through
``config.expert_map()`` and only the pairs owned here are computed, so no backend ever sees
an id of another rank's expert (-1 in vLLM's map).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ._config import MoEConfig
from ._errors import InvalidTypeError, LayerStateError
from ._layer import MoELayer
from ._quant import QuantizedExperts
from ._resolution import Resolution
from ._validation import check_forward


def _ranges(ids: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2, 5"."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}-{e}" if e != start else f"{e}")
            start = None
    return ", ".join(out)


class ExpertParallelLayer(torch.nn.Module):
    """This rank's partial sum of an expert-parallel MoE layer, in float32.

    ``forward(hidden_states, topk_weights, topk_ids)`` takes **global** ids and returns
    ``out_r[t] = sum over k owned here of topk_weights[t,k] * expert(x[t])`` as a float32
    tensor: each owned (token, slot) row comes from the local backend in the layer dtype, as
    any backend's output does; the sums (over slots, then over ranks in
    ``moe_dispatch.distributed.ep_forward``'s all-reduce) are float32, rounded to the layer
    dtype once, after the reduce. Keyword arguments
    are those of :class:`MoELayer`, for the local layer.
    """

    def __init__(self, config: MoEConfig, **layer_options: Any) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
        self.config = config
        self.local = MoELayer(config.local_config(), **layer_options)
        self.register_buffer("expert_map", config.expert_map(), persistent=False)
        self.note = (f"expert parallel: rank {config.ep_rank} of {config.ep_size} "
                     f"({config.placement}), local experts {_ranges(config.local_expert_ids)} "
                     f"of {config.num_experts}; resolved for the local config")

    def load_weights(self, w13: "torch.Tensor | QuantizedExperts", w2: torch.Tensor | None = None,
                     w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None) -> "ExpertParallelLayer":
        """This rank's experts' weights, in local order (``config.w13_shape``): float
        tensors, or for a quantized config one :class:`~moe_dispatch.QuantizedExperts`."""
        self.local.load_weights(w13, w2, w13_bias, w2_bias)
        return self

    def prepare(self) -> "ExpertParallelLayer":
        self.local.prepare()
        return self

    @property
    def backend(self) -> str:
        return self.local.backend

    @property
    def prepared(self) -> bool:
        return self.local.prepared

    @property
    def resolution(self) -> Resolution:
        res = self.local.resolution
        return attrs.evolve(res, notes=res.notes + (self.note,))

    def explain(self) -> str:
        return self.local.explain() + "\n" + self.note

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if not self.local.prepared:
            raise LayerStateError("forward() called before prepare(): call "
                                  "load_weights(...) and prepare() first")
        tokens = check_forward(self.config, hidden_states, topk_weights, topk_ids)
        out = torch.zeros(tokens, self.config.hidden_size, dtype=torch.float32)
        if tokens:
            local = self.expert_map[topk_ids.to(torch.int64)]
            owned = local >= 0
            rows = torch.nonzero(owned)[:, 0]
            if rows.numel():
                y = self.local(hidden_states[rows], topk_weights[owned].unsqueeze(1),
                               local[owned].unsqueeze(1))
                out.index_add_(0, rows, y.to(torch.float32))
        return out

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, backend={self.backend!r}, prepared={self.prepared}"
