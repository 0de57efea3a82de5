"""MoELayer: a thin ``torch.nn.Module`` over an execution plan.

``MoELayer(config)`` resolves the config; ``load_weights`` holds the caller's tensors;
``prepare`` builds the plan (``_planner``); ``_layer_calls`` runs it (``forward``, the fast
``__call__``, the fallback when a kernel fails).
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

import torch

from . import _call_slot
from ._canonical import CanonicalWeights
from ._capabilities import Capabilities
from ._compile import register_layer
from ._config import MoEConfig
from ._explain import explain_layer
from ._errors import InvalidArgumentError, InvalidTypeError, LayerStateError
from ._layer_calls import LayerCalls
from ._options import LayerOptions
from ._plan import Demotion, ExecutionPlan
from ._quant import QuantizedExperts
from ._planner import build_plan
from ._resolution import Resolution
from ._resolver import resolve
from ._validation import check_weights


class MoELayer(LayerCalls):
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
        self._own_forward = LayerCalls.plain_forward(type(self))  # read by __call__
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
        self._start()

    def _start(self) -> None:
        """Resolve the config and start with no weights and no plan (construction, and a
        copy's __setstate__): a bad forced name or an unsupported config fails here."""
        o = self.options
        self._config_resolution: Resolution = resolve(
            self.config, backend=o.backend, exclude=o.exclude, capabilities=o.capabilities,
            max_weight_copies=o.max_weight_copies)
        self._loaded: CanonicalWeights | None = None  # strong until prepare() re-holds them
        self._plan: ExecutionPlan | None = None
        self._demotions: list[Demotion] = []
        self._lock = threading.RLock()
        self._handle = register_layer(self)

    # -- copies and pickles ------------------------------------------------------------
    # A plan holds kernels' private states (native objects, prepacked and reordered copies)
    # that neither copy nor pickle, and a layer is registered by a handle for torch.compile.
    # So copy.deepcopy, pickle and torch.save keep nn.Module's own state, the config, the
    # options and the caller's weights (through the copier's memo: a model's copied
    # parameters stay shared with its copied layer), and the copy prepares its own plan
    # when the original had one.
    _NOT_COPIED = frozenset(("_config_resolution", "_loaded", "_plan", "_demotions", "_lock",
                             "_handle"))

    def __getstate__(self) -> dict[str, object]:
        state = {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}
        held = self._plan.canonical if self._plan is not None else self._loaded
        weights = held.get() if held is not None else None
        if held is not None and weights is None:
            raise LayerStateError(
                "this layer cannot be copied or pickled: it was built with keep_canonical=False "
                "and the caller has released its weights, so a copy could neither prepare nor "
                "run; copy the model that owns the weights before releasing them")
        state["_copied_weights"] = None if weights is None else (
            (weights.quantized,) if weights.quantized is not None else
            (weights.w13, weights.w2, weights.w13_bias, weights.w2_bias))
        state["_copied_prepared"] = self._plan is not None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        state = dict(state)
        weights = state.pop("_copied_weights")
        prepared = state.pop("_copied_prepared")
        self.__dict__.update(state)
        self._start()
        if weights is not None:
            self.load_weights(*weights)  # type: ignore[misc]
            if prepared:
                self.prepare()

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
            plan = self._plan = self._build_plan()
            self._loaded = plan.canonical
        if plan.natives is not None:  # a native entry: the slot that calls it from C
            _call_slot.install(MoELayer)
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
