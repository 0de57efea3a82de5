"""The caller's canonical weights as a layer holds them: one representation, strong or weak.

Held strongly (``keep_canonical=True``), they stay alive so a fallback backend can be
prepared from intact weights. Held weakly, only the backend's own copy remains once the
caller drops its tensors. Either way the stamp taken at ``prepare()`` (each tensor's version
counter, storage and dtype) tells whether the caller wrote to them in place since, or
replaced their storage (``w.data = ...``, or ``.to()`` / ``.half()`` on a module that holds
them as parameters: both keep the tensor object and its version). The storage is compared by
identity, not by data pointer: ``share_memory_()`` moves a storage's bytes and keeps it (the
values are the same), and a freed storage's address can come back under a new one. So a
strong holder keeps each original storage alive (its identity cannot be reused while the
layer holds it; after a swap that costs the old bytes until ``prepare()``), and a weak one
watches it through a weak reference (expired: replaced).
"""

from __future__ import annotations

import weakref
from typing import Callable

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._config import MoEConfig
from ._errors import WeightsModifiedError
from ._quant import QuantizedExperts
from ._spec import LayerWeights, storage_id


def _strong(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


@attrs.frozen(slots=True, eq=False)
class CanonicalWeights:
    config: MoEConfig
    names: tuple[str, ...]
    refs: tuple[Callable[[], torch.Tensor | None], ...]
    versions: tuple[int, ...]
    strong: bool
    storage_ids: tuple[int, ...] = ()
    anchors: tuple[object, ...] = ()  # the storages (strong) or StorageWeakRefs (weak)
    dtypes: tuple[torch.dtype, ...] = ()
    # Quantized weights: the QuantizedExperts itself (strong or weak like the tensors).
    quantized: Callable[[], QuantizedExperts | None] | None = None

    @classmethod
    def hold(cls, weights: LayerWeights, *, strong: bool) -> "CanonicalWeights":
        named = weights.tensors()
        ref = _strong if strong else weakref.ref
        q = weights.quantized
        return cls(weights.config, tuple(n for n, _ in named), tuple(ref(t) for _, t in named),
                   tuple(t._version for _, t in named), strong,
                   storage_ids=tuple(storage_id(t) for _, t in named),
                   anchors=tuple(t.untyped_storage() if strong else StorageWeakRef(t.untyped_storage())
                                 for _, t in named),
                   dtypes=tuple(t.dtype for _, t in named),
                   quantized=None if q is None else (lambda: q) if strong else weakref.ref(q))

    def get(self) -> LayerWeights | None:
        """The weights, or None once the caller has released any of them (weak only)."""
        tensors = {n: ref() for n, ref in zip(self.names, self.refs)}
        if any(t is None for t in tensors.values()):
            return None
        if self.quantized is not None:
            q = self.quantized()
            if q is None:
                return None
            return LayerWeights(self.config, q.w13.qweight, q.w2.qweight, q.w13_bias, q.w2_bias,
                                quantized=q)
        return LayerWeights(self.config, **tensors)  # type: ignore[arg-type]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors, strongly held only: a weak holder has none to lend."""
        return tuple(ref() for ref in self.refs) if self.strong else ()  # type: ignore[misc]

    def live(self) -> tuple[torch.Tensor, ...]:
        """The tensors still alive, strongly or weakly held."""
        return tuple(t for t in (ref() for ref in self.refs) if t is not None)

    def check_unmodified(self, backend: str, live: bool = False) -> None:
        """Raise :class:`WeightsModifiedError` if a live tensor changed dtype, or (unless the
        backend computes on the caller's tensors: ``live``) was written in place or had its
        storage replaced."""
        for name, ref, version, sid, anchor, dtype in zip(
                self.names, self.refs, self.versions, self.storage_ids, self.anchors, self.dtypes):
            tensor = ref()
            if tensor is None:
                continue
            if tensor.dtype != dtype:
                raise WeightsModifiedError(
                    f"{name} is {tensor.dtype} now, {dtype} at prepare() (a .to() or .half() "
                    "on a module that holds it as a parameter replaces its data); this "
                    f"layer's config is for {dtype}: build a MoELayer for the new dtype, or "
                    "move the weights back.")
            if live:
                continue
            if storage_id(tensor) != sid or (not self.strong and anchor.expired()):  # type: ignore[attr-defined]
                raise WeightsModifiedError(
                    f"{name}'s storage was replaced after prepare() (a .data assignment, or "
                    f".to() on a module that holds it as a parameter); backend {backend!r} "
                    "holds a copy built from the old values. Call prepare() again to rebuild it.")
            if tensor._version != version:
                raise WeightsModifiedError(
                    f"{name} was modified in place after prepare() (version {version} -> "
                    f"{tensor._version}); backend {backend!r} holds a copy built from "
                    "the old values. Call prepare() again to rebuild it.")
