"""The execution plan: everything a prepared layer runs, frozen.

``prepare()`` builds one (``_planner.build_plan``); ``forward`` only reads it; a run-time
fallback builds a new one and swaps it in, so a forward never sees half a plan.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch

from ._canonical import CanonicalWeights
from ._errors import KernelError
from ._resolution import Resolution
from ._spec import BackendRecord

NativeEntry = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@attrs.frozen(slots=True)
class Demotion:
    """A backend that failed at run time on this layer and is no longer used for it."""

    backend: str
    error: str


@attrs.frozen(slots=True, eq=False)
class Route:
    """One backend ready to run: its record, its prepared state, its ``apply``."""

    record: BackendRecord
    state: Any
    apply: Callable[..., torch.Tensor] = attrs.field(init=False)

    @apply.default
    def _apply(self) -> Callable[..., torch.Tensor]:
        return self.record.spec.backend.apply  # bound once: one lookup less per call

    @property
    def name(self) -> str:
        return self.record.name


def bucket_index(tokens: int, n_buckets: int) -> int:
    """Index of the smallest power-of-two bucket >= tokens, clamped to the last (O(1))."""
    return min((tokens - 1).bit_length(), n_buckets - 1)


@attrs.frozen(slots=True, eq=False)
class ExecutionPlan:
    """What a prepared layer runs.

    ``route``: the resolver's choice. ``table``: under policy="auto" / "fastest", the route
    of each power-of-two token bucket (None under "priority"); ``tuned``: bucket -> winner,
    timings and how it was decided; ``tuning_note``: what the tuning cost and where its
    table came from. ``natives``: per bucket (one entry without a table), the route's native
    entry for plain calls (``fast_call``) and that route, or None where the route has none.
    ``watched`` / ``versions`` / ``storage_ids``: the caller's canonical tensors (only when
    they are held strongly) and their version counters and storages at ``prepare()``, which
    the forward compares.
    """

    resolution: Resolution
    route: Route
    canonical: CanonicalWeights
    table: tuple[Route, ...] | None = None
    tuned: Mapping[int, Mapping[str, Any]] | None = None
    tuning_note: str = ""
    natives: tuple[tuple[NativeEntry, Route] | None, ...] | None = None
    watched: tuple[torch.Tensor, ...] = ()
    versions: tuple[int, ...] = ()
    storage_ids: tuple[int, ...] = ()
    # The forward's constants, read as attributes (cheap) instead of through the config.
    hidden: int = 0
    top_k: int = 0
    experts: int = 0
    dtype: torch.dtype = torch.float32
    check_ids: bool = True  # False when every route's kernel rejects bad ids itself
    # The native entry and its route when one serves every token count: the layer's
    # __call__ takes it without a bucket lookup (a Python frame less per call).
    single: tuple[NativeEntry, Route] | None = attrs.field(init=False)

    @single.default
    def _single(self) -> tuple[NativeEntry, Route] | None:
        natives = self.natives
        first = natives[0] if natives is not None else None
        if first is None or any(pair is not first for pair in natives):  # type: ignore[union-attr]
            return None
        return first

    @property
    def native(self) -> NativeEntry | None:
        """The native entry when one backend serves every token count and has one."""
        return self.single[0] if self.single is not None else None

    def native_for(self, hidden_states: Any) -> tuple[NativeEntry, Route] | None:
        """The native entry (and its route) of the bucket of this call's token count, or
        None (no entry there, or not a 2-D tensor: the Python path decides)."""
        natives = self.natives
        if natives is None:
            return None
        if len(natives) == 1:
            return natives[0]
        if type(hidden_states) is torch.Tensor and hidden_states.ndim == 2:
            # int(): under torch.jit.trace shape[0] is a traced 0-d tensor (the entry then
            # declines, and the layer takes its traced path).
            return natives[bucket_index(int(hidden_states.shape[0]), len(natives))]
        return None

    def route_for(self, tokens: int) -> Route:
        table = self.table
        # int(): under torch.jit.trace a tensor's shape[0] is a traced 0-d tensor.
        return self.route if table is None else table[bucket_index(int(tokens), len(table))]

    def routes(self) -> tuple[Route, ...]:
        """The distinct routes this plan may run."""
        if self.table is None:
            return (self.route,)
        return tuple({id(r): r for r in self.table}.values())


def good_output(out: object, shape: Any, dtype: torch.dtype) -> bool:
    """A backend's apply returned the [T, H] output in the input's dtype (the check is a few
    attribute reads: it runs on every call of the Python path)."""
    return isinstance(out, torch.Tensor) and out.shape == shape and out.dtype == dtype


def bad_output(out: object, shape: tuple[int, ...], dtype: torch.dtype) -> KernelError:
    """A backend's apply returned something other than the [T, H] output in the input's dtype
    (a plugin's bug): a kernel failure, never handed to the caller."""
    got = (f"a {out.dtype} tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor)
           else f"{type(out).__name__}")
    return KernelError(f"apply returned {got}; expected a {dtype} tensor of shape {list(shape)}")
