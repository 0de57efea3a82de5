"""MoELayer: a thin ``torch.nn.Module`` over an execution plan.

``MoELayer(config)`` resolves the config; ``load_weights`` holds the caller's tensors;
``prepare`` builds the plan (``_planner``); ``forward`` runs it; a kernel that fails at run
time is demoted and a new plan swapped in.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterable

import torch

from ._canonical import CanonicalWeights
from ._capabilities import Capabilities
from ._compile import register_layer
from ._config import MoEConfig
from ._autograd import grad_enabled as _grad_enabled, run_recorded, wants_grad
from ._explain import explain_layer
from ._fastpath import COMPILER as _COMPILER, FLOAT_DTYPES as _FLOAT_DTYPES
from ._fastpath import GLOBAL_HOOKS as _GLOBAL_HOOKS, ID_DTYPES as _ID_DTYPES, TENSOR as _Tensor
from ._fastpath import dynamo_compiling as _dynamo_compiling, is_compiling as _is_compiling
from ._fastpath import tracing_state as _tracing_state
from ._errors import (InvalidArgumentError, InvalidTypeError, KernelError, LayerStateError,
                      MoEDispatchError)
from ._options import LayerOptions
from ._plan import Demotion, ExecutionPlan, Route
from ._quant import QuantizedExperts
from ._planner import build_plan
from ._resolution import Resolution
from ._resolver import resolve
from ._spec import BackendRecord
from ._validation import check_forward, check_weights
from .kernels import id_range, version_of

log = logging.getLogger("moe_dispatch")


class MoELayer(torch.nn.Module):
    """A MoE experts layer whose kernel is chosen by the resolver.

    ``strict`` (env ``MOE_DISPATCH_STRICT=1``): a kernel failing at run time raises
    :class:`KernelError` instead of falling back to the next accepting backend.
    ``keep_canonical=False``: only weak references to the caller's tensors are kept after
    ``prepare()`` (less memory; a failing kernel falls back only while the caller still
    holds them, else it raises :class:`KernelError`).
    ``policy`` (env ``MOE_DISPATCH_POLICY``): ``"auto"`` (default) routes each token count
    to the backend measured fastest for it (a few buckets timed at the first ``prepare()``
    of a shape, bounded by ``max_candidates`` and ``tune_budget_s``, cached in
    ``tuning_cache``); ``"fastest"`` times every bucket up to ``tune_max_tokens``;
    ``"priority"`` runs the resolver's choice at every token count (docs/tuning.md).
    Expert parallelism has its own layer, :class:`~moe_dispatch.ExpertParallelLayer`.
    """

    def __init__(self, config: MoEConfig, *, backend: str | None = None,
                 exclude: Iterable[str] = (), capabilities: Capabilities | None = None,
                 strict: bool | None = None, keep_canonical: bool = True,
                 policy: str | None = None, max_candidates: int | None = None,
                 tune_max_tokens: int = 512, tune_budget_s: float | None = None,
                 tuning_cache: str | os.PathLike | bool | None = None,
                 max_weight_copies: float | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
        if config.is_expert_parallel:
            raise InvalidArgumentError("config", config.describe(), "a config with ep_size == 1; "
                                       "use moe_dispatch.ExpertParallelLayer for expert parallelism")
        self.config = config
        self.options = LayerOptions.build(
            backend=backend, exclude=exclude, capabilities=capabilities, strict=strict,
            keep_canonical=keep_canonical, policy=policy, max_candidates=max_candidates,
            tune_max_tokens=tune_max_tokens, tune_budget_s=tune_budget_s, tuning_cache=tuning_cache,
            max_weight_copies=max_weight_copies)
        # Resolve now: a bad forced name or an unsupported config fails at construction.
        self._config_resolution: Resolution = resolve(
            config, backend=backend, exclude=self.options.exclude, capabilities=capabilities,
            max_weight_copies=max_weight_copies)
        self._loaded: CanonicalWeights | None = None  # strong until prepare() re-holds them
        self._plan: ExecutionPlan | None = None
        self._demotions: list[Demotion] = []
        self._lock = threading.RLock()
        self._handle = register_layer(self)

    # -- loading and preparing -------------------------------------------------------
    def load_weights(self, w13: "torch.Tensor | QuantizedExperts", w2: torch.Tensor | None = None,
                     w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None) -> "MoELayer":
        """Store the canonical weights (by reference; never modified): float tensors, or for
        a quantized config one :class:`~moe_dispatch.QuantizedExperts`.

        Loading again replaces the weights and drops the plan: call ``prepare()`` again.
        """
        weights = check_weights(self.config, w13, w2, w13_bias, w2_bias)
        with self._lock:
            self._loaded = CanonicalWeights.hold(weights, strong=True)
            self._plan = None
            self._demotions.clear()
        return self

    def prepare(self) -> "MoELayer":
        """Layer-level checks, the final backend choice, the backend's weight processing,
        tuning if asked: builds the execution plan. Calling it again rebuilds it from the
        current weights (after an in-place update)."""
        with self._lock:
            self._plan = self._build_plan()
            self._loaded = self._plan.canonical
        return self

    def _build_plan(self) -> ExecutionPlan:
        loaded = self._loaded
        weights = loaded.get() if loaded is not None else None
        if weights is None:
            if loaded is not None:
                raise LayerStateError("prepare() needs the canonical weights, but this layer "
                                      "was built with keep_canonical=False and the caller "
                                      "has released them: load_weights() again")
            raise LayerStateError("prepare() called before load_weights(): load the "
                                  "canonical weights first")
        # No autograd: a backend's copies of Parameters must not carry their graph, and its
        # self-checks and the tuning time forward calls only.
        with torch.no_grad():
            return build_plan(self.config, self.options, self._config_resolution, weights,
                              tuple(self._demotions))

    # -- introspection -------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.options.policy

    @property
    def strict(self) -> bool:
        return self.options.strict

    @property
    def keep_canonical(self) -> bool:
        return self.options.keep_canonical

    @property
    def plan(self) -> ExecutionPlan | None:
        """The execution plan (None before ``prepare()``): read-only, replaced as a whole."""
        return self._plan

    @property
    def backend(self) -> str:
        """The final backend name (after prepare), else the config-level choice."""
        plan = self._plan
        return plan.route.name if plan is not None else self._config_resolution.backend

    @property
    def resolution(self) -> Resolution:
        plan = self._plan
        return plan.resolution if plan is not None else self._config_resolution

    @property
    def prepared(self) -> bool:
        return self._plan is not None

    @property
    def demotions(self) -> tuple[Demotion, ...]:
        return tuple(self._demotions)

    @property
    def uses_native_entry(self) -> bool:
        """Whether plain calls of some token count go to a backend's native entry
        (``BackendBase.fast_call``)."""
        plan = self._plan
        return plan is not None and plan.natives is not None

    @property
    def tuned_table(self) -> dict[int, str] | None:
        """bucket size -> backend under policy="auto" / "fastest", and under "priority" when the
        chosen backend has a ``max_tokens`` (else None)."""
        plan = self._plan
        if plan is None or not plan.tuned:
            return None
        return {t: row["winner"] for t, row in plan.tuned.items()}

    def explain(self) -> str:
        return explain_layer(self.resolution, self._plan)

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, backend={self.backend!r}, prepared={self.prepared}"

    # -- running -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ without its hook machinery when nothing needs it (measured: ~60 us
        # per call at E=64 H=2048 T=1, every line running cold after the kernel). Hooks,
        # compiled modules and JIT or torch.compile tracing take the standard path.
        plan = self._plan
        if (plan is None or not plan.watched or self._compiled_call_impl is not None
                or self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
                or self._backward_pre_hooks or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]
                or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3] or _dynamo_compiling()
                or _COMPILER._is_compiling_flag):
            return super().__call__(*args, **kwargs)
        plain = len(args) == 3 and not kwargs
        pair = plan.single
        if pair is None and plain and plan.natives is not None:
            pair = plan.native_for(args[0])  # a bucket table's entries
        if plain and pair is not None:
            # run()'s native branch, inlined: every frame and lookup here runs cold at
            # decode. No tracing check first: entries decline inside torch.jit.trace (their
            # contract, which the conformance kit checks).
            try:
                out = pair[0](*args)
            except Exception as exc:
                return self._entry_failed(pair[1], exc, *args)
            if out is not None:
                return out
        if not _tracing_state():
            return self._run_python(*args, **kwargs)
        return super().__call__(*args, **kwargs)  # torch.jit.trace: nn.Module's path

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if _is_compiling():
            # One opaque custom op in the graph; its real kernel is run().
            return torch.ops.moe_dispatch.moe_forward(hidden_states, topk_weights, topk_ids,
                                                      self._handle)
        if _tracing_state():
            # torch.jit.trace records torch ops: a native entry would be invisible to it.
            return self._run_python(hidden_states, topk_weights, topk_ids)
        return self.run(hidden_states, topk_weights, topk_ids)

    def run(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, native: bool = True) -> torch.Tensor:
        """The eager forward without ``nn.Module``'s machinery: through the native entry of
        the route for this token count when it has one (it declines, with None, anything it
        cannot prove plain), else, or with ``native=False``, the checked Python path."""
        plan = self._plan
        if native and plan is not None and plan.natives is not None:
            pair = plan.native_for(hidden_states)
            if pair is not None:
                try:
                    out = pair[0](hidden_states, topk_weights, topk_ids)
                except Exception as exc:
                    return self._entry_failed(pair[1], exc, hidden_states, topk_weights, topk_ids)
                if out is not None:
                    return out
        return self._run_python(hidden_states, topk_weights, topk_ids)

    def _entry_failed(self, route: Route, exc: Exception, hidden_states: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # The entry checked the inputs before the kernel ran, so this is the kernel's (or the
        # entry's) failure; re-check all the same: the caller's bad input must never demote
        # a backend.
        check_forward(self.config, hidden_states, topk_weights, topk_ids)
        return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)

    def _run_python(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        # Short path: the same checks as _run_checked, in as little code as possible.
        # Measured here: right after a kernel has streamed its weights through the caches
        # (or after any idle pause), Python and torch's bindings run cold: ten attribute
        # reads and one empty_like cost 1.7 us warm and ~80 us then. What counts is how many
        # *distinct* torch entry points a call touches, so this path reads only tensor
        # attributes (shape, dtype, is_cpu, _version) and at most one tolist() (none when
        # the kernels reject bad ids themselves: BackendSpec.validates_ids). Any doubt: the
        # checked path, which raises the precise error.
        plan = self._plan
        if (_grad_enabled() and plan is not None and isinstance(hidden_states, _Tensor)
                and isinstance(topk_weights, _Tensor)
                and wants_grad(hidden_states, topk_weights, plan.canonical.live)):
            return run_recorded(self._current_plan, self._run_checked, hidden_states,
                                topk_weights, topk_ids)
        if plan is not None and plan.watched and type(hidden_states) is _Tensor \
                and type(topk_weights) is _Tensor and type(topk_ids) is _Tensor:
            shape = hidden_states.shape
            if (len(shape) == 2 and shape[1] == plan.hidden and shape[0]
                    and hidden_states.dtype is plan.dtype
                    and topk_weights.shape == topk_ids.shape == (shape[0], plan.top_k)
                    and topk_ids.dtype in _ID_DTYPES and topk_weights.dtype in _FLOAT_DTYPES
                    and hidden_states.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu
                    and tuple(map(version_of, plan.watched)) == plan.versions):
                if plan.check_ids:
                    lo, hi = id_range(topk_ids)
                    if lo < 0 or hi >= plan.experts:
                        return self._run_checked(hidden_states, topk_weights, topk_ids)
                route = plan.route if plan.table is None else plan.route_for(shape[0])
                try:
                    return route.apply(route.state, hidden_states, topk_weights, topk_ids)
                except MoEDispatchError:
                    raise
                except Exception as exc:
                    # Maybe the caller's ids (unchecked above when the kernels check them):
                    # that raises the typed error here, and the backend is not blamed.
                    check_forward(self.config, hidden_states, topk_weights, topk_ids)
                    return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)
        return self._run_checked(hidden_states, topk_weights, topk_ids)

    def _current_plan(self) -> ExecutionPlan:
        assert self._plan is not None
        return self._plan

    def _run_checked(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise LayerStateError("forward() called before prepare(): call "
                                  "load_weights(...) and prepare() first")
        plan.canonical.check_unmodified(plan.route.name)
        tokens = check_forward(self.config, hidden_states, topk_weights, topk_ids)
        if tokens == 0:
            return hidden_states.new_empty((0, self.config.hidden_size))
        route = plan.route_for(tokens)
        try:
            return route.apply(route.state, hidden_states, topk_weights, topk_ids)
        except MoEDispatchError:
            raise  # a typed input error from the backend, not a kernel failure
        except Exception as exc:
            return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)

    def _fall_back(self, rec: BackendRecord, exc: Exception, hidden_states: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Demote ``rec`` for this layer, swap in a plan without it, and run that."""
        error = f"{type(exc).__name__}: {exc}"
        if self.options.strict:
            raise KernelError(f"backend {rec.name!r} failed at run time ({error}); strict "
                              "mode forbids a fallback") from exc
        if self._config_resolution.forced is not None:
            raise KernelError(f"forced backend {rec.name!r} failed at run time ({error}); a "
                              "forced backend never falls back") from exc
        with self._lock:
            plan = self._plan
            # Another thread may have demoted it already: then its new plan just runs.
            if plan is not None and any(r.name == rec.name for r in plan.routes()):
                if plan.canonical.get() is None:
                    raise KernelError(
                        f"backend {rec.name!r} failed at run time ({error}) and no fallback is "
                        "possible: the layer was built with keep_canonical=False and the "
                        "canonical weights are gone") from exc
                log.warning("moe-dispatch: backend %r failed at run time on %s (%s); it is "
                            "demoted for this layer and the next accepting backend takes over",
                            rec.name, self.config.describe(), error)
                self._demotions.append(Demotion(rec.name, error))
                try:
                    self._plan = self._build_plan()  # policy="fastest" is not re-tuned
                except MoEDispatchError as exc2:
                    self._plan = None
                    raise KernelError(f"backend {rec.name!r} failed at run time ({error}) and no "
                                      f"fallback accepts this layer: {exc2}") from exc
        return self._run_python(hidden_states, topk_weights, topk_ids)
