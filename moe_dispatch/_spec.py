"""What a backend plugin provides: hook specifications, the record, the backend protocol.

Plugins *return records*; the host validates, sorts and reports them. We never rely on
pluggy's LIFO call order for priority: ordering is an explicit sort key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, runtime_checkable

import attrs
import pluggy
import torch

from ._decision import Decision, accept
from ._spec_fields import (WEIGHT_FORMATS, check_backend, check_copies, check_hosts,
                           check_max_tokens, check_name, check_priority, check_weights,
                           names_converter, normalize, normalize_name, ops_converter,
                           per_format_converter)

if TYPE_CHECKING:
    from ._capabilities import Capabilities
    from ._config import MoEConfig
    from ._quant import QuantizedExperts

PROJECT = "moe_dispatch"
ENTRY_POINT_GROUP = "moe_dispatch.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

@attrs.define(slots=True, eq=False)
class LayerWeights:
    """The canonical weights of one layer, as the caller loaded them (never modified).

    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``w13_bias [E, 2I]``, ``w2_bias [E, H]``. For a
    quantized config (``config.weight_scheme``), ``quantized`` holds the
    :class:`~moe_dispatch.QuantizedExperts` and ``w13`` / ``w2`` are their packed values
    (``quantized.w13.qweight``...): only backends that declare the format
    (``BackendSpec.weights``) are ever given them.
    """

    config: "MoEConfig"
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    quantized: "QuantizedExperts | None" = None

    def tensors(self) -> tuple[tuple[str, torch.Tensor], ...]:
        q = self.quantized
        if q is None:
            named = [("w13", self.w13), ("w2", self.w2)]
        else:
            named = [(f"{p}.{f}", getattr(getattr(q, p), f)) for p in ("w13", "w2")
                     for f in ("qweight", "scales", "zeros")]
        named += [("w13_bias", self.w13_bias), ("w2_bias", self.w2_bias)]
        return tuple((n, t) for n, t in named if t is not None)


@runtime_checkable
class Backend(Protocol):
    """What a backend object implements. Subclass :class:`BackendBase` for defaults."""

    def supports_config(self, config: "MoEConfig", capabilities: "Capabilities") -> Decision:
        """Can this backend run ``config`` on this machine? Called before weights exist."""

    def supports_layer(self, weights: LayerWeights, capabilities: "Capabilities") -> Decision:
        """Can it run these actual tensors? Called at ``MoELayer.prepare()``."""

    def process_weights(self, weights: LayerWeights, capabilities: "Capabilities") -> Any:
        """Build the backend-owned state (copies, prepacked weights). Never mutate ``weights``."""

    def apply(self, state: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """Run the layer. ``hidden_states`` has been validated; ids are in ``[0, E)``."""


@attrs.frozen(slots=True, eq=False)
class FastGuard:
    """What a backend's optional ``fast_call`` must check on every call, besides the inputs.

    ``watched``: the caller's canonical weight tensors; ``versions`` and ``storage_ids``:
    their ``_version`` and :func:`storage_id` at ``prepare()`` (the layer keeps those
    storages alive, so an id cannot come back under another storage). A changed version
    means the caller modified the weights in place, a changed storage that it replaced
    them (``w.data = ...``, or ``.to()`` on a module holding them): either way the call must
    be declined (the layer's checked path then raises WeightsModifiedError). ``unchanged()``
    checks both; the C++ toolkit's ``PlainSpec`` takes the storages itself.
    """

    watched: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    storage_ids: tuple[int, ...] = ()

    def unchanged(self) -> bool:
        """Whether every watched tensor has its version and storage of ``prepare()``."""
        return (tuple(t._version for t in self.watched) == self.versions
                and (not self.storage_ids
                     or tuple(map(storage_id, self.watched)) == self.storage_ids))


def storage_id(t: torch.Tensor) -> int:
    """The identity of the storage behind ``t`` (its StorageImpl's address): the same after
    ``share_memory_()`` (same storage, bytes moved), another after ``t.data = ...``."""
    return t.untyped_storage()._cdata


class BackendBase:
    """Convenience base: accepts every layer the config check accepted."""

    def supports_layer(self, weights: LayerWeights, capabilities: "Capabilities") -> Decision:
        return accept()

    def fast_call(self, state: Any, guard: FastGuard) -> Any:
        """Optional native entry for the layer's plain calls; None (the default): none.

        A backend may return a callable ``f(hidden_states, topk_weights, topk_ids)`` that
        returns the layer's output, or None to decline the call, in which case the layer
        runs its Python path (checks, precise errors, then ``apply``). ``f`` must decline
        every call that is not exactly: three ``torch.Tensor`` (not subclasses), dense,
        on the CPU; ``hidden_states`` 2-D ``[T, H]`` with T > 0 and the config's dtype;
        the other two ``[T, top_k]`` (the toolkit's check admits int32 and int64 ids and
        float32, bfloat16, float16 and float64 router weights, and gives the kernel int32
        and float32 converted as the Python path's ``.to()`` would, int64 ids only after
        their range check); every id in ``[0, num_experts)``; ``guard``'s
        versions unchanged; every call while ``torch.jit.trace`` is tracing
        (``torch._C._get_tracing_state()``); and every call autograd would record (grad
        mode on, and ``hidden_states``, ``topk_weights`` or a guarded tensor requires
        grad: the layer's Python path gives it exact gradients or a backward that raises).
        The toolkit's ``PlainCall::check`` does all of it; the layer does not check again.
        Exceptions it raises are treated as a kernel failure.
        Worth it only when the Python around the kernel is measurable (it is at decode:
        docs/performance.md).
        """
        return None

    def diagnostics(self) -> Mapping[str, str]:
        """Optional ``label -> status`` lines for ``moe-dispatch doctor`` and the demo (the
        vendor library's version or why it is unavailable, a native module's state...).
        Must be cheap and never build or load anything; the default has none."""
        return {}


@attrs.frozen(slots=True)
class BackendSpec:
    """The record a plugin returns from its ``moe_dispatch_backends`` hook.

    ``priority``: higher runs first. The built-in backends use 0 to 400, leaving room on
    either side for vendors (README: "Backends today").

    ``ops``: ``{"ns::op[.overload]": schema}``, the schemas of the ops the backend calls,
    as it was written for them. Simulated machines (the support matrix, tests) are given
    these; ``doctor`` compares them with this process's.

    ``env_vars``: every environment variable the backend reads, its gates' included. They
    are part of the resolution cache key (a change is seen by the next resolution) and
    ``doctor`` lists them.

    ``validates_ids``: the backend's ``apply`` raises an exception (never reads out of
    bounds, never returns numbers) for any expert id outside ``[0, num_experts)``. The
    layer's forward then skips its own O(T*K) range check on the fast path, and re-checks
    the inputs only when ``apply`` raises, so that a bad id is still reported as the
    caller's :class:`InvalidArgumentError` and does not demote the backend. Leave it False
    unless a test proves it (negative ids index from the end in PyTorch: silently wrong).

    ``weights``: the weight formats the backend runs, of ``WEIGHT_FORMATS``: "float"
    (the default), "int8", "int4" (``MoEConfig.weight_scheme``). The resolver rejects a
    backend for a format it does not declare, before its gate is asked; a backend that runs
    only some schemes of a format rejects the others in ``supports_config``.

    ``max_tokens``: the largest token bucket the backend is routed (a decode kernel that
    loses to GEMM kernels beyond it); None: every bucket; or a mapping from weight format
    to such a limit (a format it does not name: no limit), for a kernel whose crossover
    depends on the format. Buckets above it go to the next backend without such a limit,
    under every policy; forced, the backend runs every call.

    ``avoid_hosts``: the embedding hosts (by name: ``"vllm"``, the vLLM plugin) whose layers
    leave this backend out of their routing by default, for what it does to the host
    around it, which a layer's own timing cannot see (the host's documentation says how a
    user lets it compete again). Forced, it still runs.

    ``differentiable``: the backend's ``apply`` is differentiable torch ops on the caller's
    canonical tensors (the torch loop), so autograd records exact gradients of a call for
    the hidden states, the router weights and the weights. Every other backend's call that
    autograd would record runs without it and gets a backward that raises
    :class:`NotDifferentiableError` (``_autograd.py``): its share of a gradient is never
    silently zero. Leave it False unless a test compares its gradients with the reference.
    Computing on the caller's tensors, it also sees their in-place updates (an optimizer's
    step): the layer checks the weights' version counters for every other backend only
    (the conformance kit's ``test_in_place_update``).

    ``weight_copies``: how many copies of the layer's weights (counted in the bytes of the
    layer's format) a prepared state of this backend keeps, its kernel's own caches
    included: a number, or a mapping from weight format to one (a format it does not name:
    1). Measured, not guessed (docs/writing-a-backend.md says how); the default, 1, is a
    private copy in the backend's layout. A layer's ``max_weight_copies`` leaves out
    backends, and combinations of routes, that would hold more.
    """

    name: str = attrs.field(converter=normalize, validator=check_name)
    priority: int = attrs.field(validator=check_priority)
    backend: Backend = attrs.field(validator=check_backend, eq=False)
    description: str = ""
    version: str = ""
    validates_ids: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool),
                                      kw_only=True)
    ops: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=ops_converter,
                                                   kw_only=True)
    env_vars: tuple[str, ...] = attrs.field(default=(), converter=names_converter, kw_only=True)
    weights: tuple[str, ...] = attrs.field(default=("float",), converter=names_converter,
                                           validator=check_weights, kw_only=True)
    max_tokens: int | None | tuple[tuple[str, int | None], ...] = attrs.field(
        default=None, converter=per_format_converter, validator=check_max_tokens, kw_only=True)
    avoid_hosts: tuple[str, ...] = attrs.field(default=(), converter=names_converter,
                                               validator=check_hosts, kw_only=True)
    weight_copies: float | tuple[tuple[str, float], ...] = attrs.field(
        default=1.0, converter=per_format_converter, validator=check_copies, kw_only=True)
    differentiable: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool),
                                       kw_only=True)

    def copies(self, weight_format: str = "float") -> float:
        """The copies of the weights a prepared state of this backend holds, for
        ``weight_format`` weights (``weight_copies``)."""
        if isinstance(self.weight_copies, tuple):
            return float(dict(self.weight_copies).get(weight_format, 1.0))
        return float(self.weight_copies)

    def token_limit(self, weight_format: str = "float") -> int | None:
        """The largest bucket routed to this backend for weights of ``weight_format``."""
        if isinstance(self.max_tokens, tuple):
            return dict(self.max_tokens).get(weight_format)
        return self.max_tokens

    def serves(self, tokens: int, weight_format: str = "float") -> bool:
        """Whether calls of ``tokens`` tokens with ``weight_format`` weights may be routed
        to this backend."""
        limit = self.token_limit(weight_format)
        return limit is None or tokens <= limit


@attrs.frozen(slots=True)
class BackendRecord:
    """A validated spec plus where it came from (host-side bookkeeping)."""

    spec: BackendSpec
    plugin: str  # the pluggy plugin name (the entry point name for discovered plugins)
    source: str  # human-readable origin: entry point and distribution, or md.register()
    distribution: str | None = None  # the distribution of an entry point; None otherwise

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def priority(self) -> int:
        return self.spec.priority

    def sort_key(self) -> tuple[int, str]:
        # Explicit order: higher priority first, then name. Never registration order.
        return (-self.spec.priority, self.spec.name)


class BackendHookSpec:
    """Hook specifications of the ``moe_dispatch`` project."""

    @hookspec
    def moe_dispatch_backends(self) -> Iterable[BackendSpec]:  # type: ignore[empty-body]
        """Return the backends this plugin provides (a list of :class:`BackendSpec`)."""
