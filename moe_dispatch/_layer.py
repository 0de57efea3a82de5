"""MoELayer: a torch.nn.Module that resolves once, prepares once, and then only runs."""

from __future__ import annotations

import logging
import operator
import os
import threading
import weakref
from typing import Any, Callable, Iterable

import attrs
import torch
import torch.nn.modules.module as _module

from ._capabilities import Capabilities
from ._config import MoEConfig
from ._decision import reject
from ._errors import (InvalidArgumentError, InvalidTypeError, KernelError, LayerStateError, MoEDispatchError,
                      NoBackendError, WeightsModifiedError)
from ._registry import BackendRecord
from ._resolver import DEMOTED, STANDBY, CHOSEN, Resolution, call_check, resolve, resolve_layer
from ._compile import register_layer
from ._tuning import POLICIES, TuningCache, bucket_index, bucket_sizes, measure, tuning_key
from ._spec import FastGuard, LayerWeights
from ._validation import check_forward, check_weights, id_range

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling  # bound once: one lookup less per call
_ID_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))
_version_of = operator.attrgetter("_version")
_tracing_state = torch._C._get_tracing_state
# nn.Module's process-wide hook registries (mutated in place by register_module_*_hook).
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
                 _module._global_backward_hooks, _module._global_backward_pre_hooks)

log = logging.getLogger("moe_dispatch")


def _strong(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@attrs.frozen(slots=True)
class Demotion:
    """A backend that failed at run time on this layer and is no longer used for it."""

    backend: str
    error: str


class MoELayer(torch.nn.Module):
    """A MoE experts layer whose kernel is chosen by the resolver.

    Life cycle: ``MoELayer(config)`` resolves the config; ``load_weights`` stores
    references to the caller's canonical tensors (never modified); ``prepare`` runs the
    layer-level checks, fixes the backend and lets it build its own weight layout;
    ``forward`` runs it.

    ``strict`` (or env ``MOE_DISPATCH_STRICT=1``): a kernel that fails at run time raises
    :class:`KernelError` instead of falling back to the next accepting backend.

    ``keep_canonical`` (default True): the layer keeps references to the caller's
    canonical tensors after ``prepare()``, so a fallback backend can be prepared from
    intact weights. With False it keeps only weak references: once the caller drops its
    tensors, only the backend's own copy remains (less memory) and a failing kernel
    raises :class:`KernelError` instead of falling back.

    ``policy`` (or env ``MOE_DISPATCH_POLICY``): ``"priority"`` (default) runs the resolver's
    choice; ``"fastest"`` times the accepting backends at ``prepare()`` per power-of-two
    token bucket (up to ``tune_max_tokens``, within ``tune_budget_s``) and runs each bucket's
    winner (another backend replaces the priority choice only when it is more than 2%
    faster). It keeps the prepared state of every backend that wins a bucket, so memory grows
    with the number of distinct winners; ``max_candidates`` caps how many backends are tried.
    Tuned tables persist in ``tuning_cache`` (default: env ``MOE_DISPATCH_TUNING_CACHE`` or
    ``~/.cache/moe-dispatch/tuning.json``; ``False`` disables persistence).
    """

    def __init__(self, config: MoEConfig, *, backend: str | None = None,
                 exclude: Iterable[str] = (), capabilities: Capabilities | None = None,
                 strict: bool | None = None, keep_canonical: bool = True,
                 policy: str | None = None, max_candidates: int | None = None,
                 tune_max_tokens: int = 512, tune_budget_s: float = 60.0,
                 tuning_cache: str | os.PathLike | bool | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
        self.config = config
        self._backend_arg = backend
        self._exclude = tuple(exclude) if not isinstance(exclude, str) else (exclude,)
        self._capabilities = capabilities
        self.strict = _env_flag("MOE_DISPATCH_STRICT") if strict is None else bool(strict)
        self.keep_canonical = bool(keep_canonical)
        policy = policy if policy is not None else (os.environ.get("MOE_DISPATCH_POLICY") or "priority")
        if policy not in POLICIES:
            raise InvalidArgumentError("policy", policy, f"one of {POLICIES}")
        self.policy = policy
        if max_candidates is not None and (not isinstance(max_candidates, int) or max_candidates < 1):
            raise InvalidArgumentError("max_candidates", max_candidates, "a positive int or None")
        if not isinstance(tune_max_tokens, int) or tune_max_tokens < 1:
            raise InvalidArgumentError("tune_max_tokens", tune_max_tokens, "a positive int")
        self._tuning = dict(max_candidates=max_candidates, cap=tune_max_tokens,
                            budget=float(tune_budget_s), cache=tuning_cache)
        # policy="fastest": (record, state) per bucket; None under policy="priority".
        self._table: list[tuple[BackendRecord, Any]] | None = None
        self._tuned: dict[int, dict[str, float]] | None = None
        # Resolve now: a bad forced name or an unsupported config fails at construction.
        self._config_resolution: Resolution = resolve(
            config, backend=backend, exclude=self._exclude, capabilities=capabilities)
        # Expert parallelism: an inner layer computes this rank's experts (local config).
        self._inner: MoELayer | None = None
        self._expert_map: torch.Tensor | None = None
        if config.is_expert_parallel:
            self._inner = MoELayer(config.local_config(), backend=backend, exclude=self._exclude,
                                   capabilities=capabilities, strict=strict,
                                   keep_canonical=keep_canonical, policy=policy,
                                   max_candidates=max_candidates, tune_max_tokens=tune_max_tokens,
                                   tune_budget_s=tune_budget_s, tuning_cache=tuning_cache)
            self._expert_map = config.expert_map()
        self._weights: LayerWeights | None = None
        self._weak_weights: tuple[tuple[str, Callable[[], torch.Tensor | None]], ...] | None = None
        # (name, reference to the tensor, version at prepare); the reference is weak when
        # keep_canonical is False.
        self._versions: tuple[tuple[str, Callable[[], torch.Tensor | None], int], ...] = ()
        self._resolution: Resolution | None = None
        self._active: tuple[BackendRecord, Any] | None = None
        self._demotions: list[Demotion] = []
        self._lock = threading.RLock()
        self._handle = register_layer(self)
        # The forward fast path's constants, set by prepare() (None: use the checked path).
        self._fast: tuple | None = None
        # (entry, its backend's record) for plain calls (BackendBase.fast_call), or None.
        self._native: tuple[Callable[..., torch.Tensor | None], BackendRecord] | None = None

    # -- loading -------------------------------------------------------------------
    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor,
                     w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None) -> "MoELayer":
        """Store the canonical weights (by reference; never modified).

        Loading again replaces the weights and drops the prepared state: call
        ``prepare()`` again before ``forward``.
        """
        weights = check_weights(self.config, w13, w2, w13_bias, w2_bias)
        if self._inner is not None:
            self._inner.load_weights(w13, w2, w13_bias, w2_bias)
            return self
        with self._lock:
            self._weights = weights
            self._weak_weights = None
            self._fast = self._native = None
            self._active = None
            self._resolution = None
            self._versions = ()
            self._demotions.clear()
        return self

    def _canonical(self) -> LayerWeights | None:
        """The canonical weights if they are still alive (always, with keep_canonical)."""
        if self._weights is not None:
            return self._weights
        refs = self._weak_weights
        if refs is None:
            return None
        tensors = {name: ref() for name, ref in refs}
        if any(t is None for t in tensors.values()):
            return None
        return LayerWeights(self.config, **tensors)  # type: ignore[arg-type]

    def prepare(self) -> "MoELayer":
        """Layer-level checks, the final backend choice, and the backend's weight processing.

        Calling it again rebuilds from the current weights (after an in-place update).
        """
        if self._inner is not None:
            self._inner.prepare()
            return self
        with self._lock:
            weights = self._canonical()
            if weights is None:
                if self._weak_weights is not None:
                    raise LayerStateError("prepare() needs the canonical weights, but this layer "
                                          "was built with keep_canonical=False and the caller "
                                          "has released them: load_weights() again")
                raise LayerStateError("prepare() called before load_weights(): load the "
                                      "canonical weights first")
            demoted = {d.backend for d in self._demotions}
            res = self._config_resolution
            if demoted:
                res = resolve(self.config, backend=self._backend_arg,
                              exclude=self._exclude + tuple(demoted),
                              capabilities=self._capabilities)
            caps = res.capabilities

            def build(rec: BackendRecord) -> Any:
                return rec.spec.backend.process_weights(weights, caps)

            final, rec, state = resolve_layer(res, weights, build, strict=self.strict)
            self._resolution = self._annotate(final)
            self._active = (rec, state)
            self._table = self._tuned = None
            if self.policy == "fastest" and res.forced is None and not self._demotions:
                self._tune(final, rec, state, weights, build)
            if self.keep_canonical:
                self._versions = tuple((n, _strong(t), t._version) for n, t in weights.tensors())
            else:
                self._versions = tuple((n, weakref.ref(t), t._version) for n, t in weights.tensors())
                self._weak_weights = tuple((n, weakref.ref(t)) for n, t in weights.tensors())
                self._weights = None
            self._fast = self._native = None
            if self.keep_canonical:
                c = self.config
                tensors = tuple(t for _, t in weights.tensors())
                chosen = [rec] if self._table is None else [r for r, _ in self._table]
                table = None if self._table is None else tuple(
                    (r, r.spec.backend.apply, s) for r, s in self._table)
                # The id range check can be left to the kernels only when every backend this
                # layer may run rejects bad ids itself (BackendSpec.validates_ids).
                check_ids = not all(r.spec.validates_ids for r in chosen)
                versions = tuple(t._version for t in tensors)
                self._fast = (rec, rec.spec.backend.apply, state, table, tensors, versions,
                              c.hidden_size, c.top_k, c.num_experts, c.dtype, check_ids)
                # A native entry only when one backend serves every token count (a tuned
                # table with a single winner included).
                single = {id(s): (r, s) for r, s in self._table} if self._table else {}
                if len(single) <= 1:
                    r, s = next(iter(single.values())) if single else (rec, state)
                    entry = self._native_entry(r, s, FastGuard(tensors, versions))
                    self._native = None if entry is None else (entry, r)
        return self

    @staticmethod
    def _native_entry(rec: BackendRecord, state: Any, guard: FastGuard
                      ) -> Callable[..., torch.Tensor | None] | None:
        fast_call = getattr(rec.spec.backend, "fast_call", None)
        if fast_call is None:
            return None
        try:
            entry = fast_call(state, guard)
        except Exception as exc:  # an optional accelerator: its failure costs speed only
            log.warning("moe-dispatch: backend %r's fast_call failed (%s: %s); its Python path "
                        "runs", rec.name, type(exc).__name__, exc)
            return None
        return entry if callable(entry) else None

    def _tune(self, final: Resolution, rec: BackendRecord, state: Any, weights: LayerWeights,
              build: Callable[[BackendRecord], Any]) -> None:
        """policy="fastest": read the tuned table from the cache, or prepare the other
        accepting backends and time them per bucket; keep only the winners' states."""
        from ._registry import get_registry
        snap = get_registry().snapshot()
        caps = final.capabilities
        # The candidates: the resolver's choice, then every other backend that accepts the
        # layer, up to max_candidates. Nothing else is prepared before the cache is read.
        records: dict[str, BackendRecord] = {rec.name: rec}
        limit = self._tuning["max_candidates"]
        for cand in final.candidates:
            if limit is not None and len(records) >= limit:
                break
            if cand.name in records or cand.status not in (STANDBY, CHOSEN):
                continue
            other = snap.by_name(cand.name)
            if call_check(other, "supports_layer", weights, caps).accepted:
                records[other.name] = other
        sizes = bucket_sizes(self._tuning["cap"])
        names = sorted(records)
        cache_opt = self._tuning["cache"]
        cache = None if cache_opt is False else TuningCache(None if cache_opt in (None, True) else cache_opt)
        key = tuning_key(self.config, caps, {n: records[n].spec.version for n in names})
        table = cache.get(key, names, sizes) if cache is not None else None
        prepared: dict[str, tuple[BackendRecord, Any]] = {rec.name: (rec, state)}

        def prepare_all(wanted: Iterable[str]) -> None:
            for name in wanted:
                if name in prepared:
                    continue
                try:
                    prepared[name] = (records[name], build(records[name]))
                except Exception as exc:  # a candidate that cannot prepare is not used
                    log.warning("moe-dispatch: %r could not be prepared for tuning (%s)", name, exc)

        timings: dict[int, dict[str, float]] = {}
        if table is not None:
            # A cache hit prepares only the winners (memory and time).
            prepare_all(sorted(set(table.values())))
            if not set(table.values()) <= set(prepared):
                table = None  # a cached winner no longer prepares: measure again
        if table is None:
            prepare_all(names)
            runners = {n: (lambda x, tw, ids, _r=prepared[n]: _r[0].spec.backend.apply(_r[1], x, tw, ids))
                       for n in sorted(prepared)}
            table, timings = measure(runners, self.config, sizes, self._tuning["budget"], rec.name)
            if cache is not None:
                cache.put(key, table, timings, self.config)
        self._table = [prepared[table[t]] for t in sizes]
        self._tuned = {t: {"winner": table[t], **timings.get(t, {})} for t in sizes}  # type: ignore[dict-item]
        # Keep only the winners' prepared states (memory): the others are dropped here.
        prepared.clear()

    def _annotate(self, res: Resolution) -> Resolution:
        if not self._demotions:
            return res
        notes = tuple(f"demoted at run time: {d.backend}: {d.error}" for d in self._demotions)
        cands = tuple(attrs.evolve(c, status=DEMOTED, layer_decision=reject(
            next(d.error for d in self._demotions if d.backend == c.name)))
            if c.name in {d.backend for d in self._demotions} else c for c in res.candidates)
        return attrs.evolve(res, candidates=cands, notes=res.notes + notes)

    # -- introspection -------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The final backend name (after prepare), else the config-level choice."""
        if self._inner is not None:
            return self._inner.backend
        active = self._active
        return active[0].name if active is not None else self._config_resolution.backend

    @property
    def resolution(self) -> Resolution:
        if self._inner is not None:
            inner = self._inner.resolution
            return attrs.evolve(inner, notes=inner.notes + self._config_resolution.notes[-1:])
        return self._resolution or self._config_resolution

    @property
    def prepared(self) -> bool:
        return self._inner.prepared if self._inner is not None else self._active is not None

    @property
    def demotions(self) -> tuple[Demotion, ...]:
        return tuple(self._demotions)

    def explain(self) -> str:
        text = self.resolution.explain()
        if not self.prepared:
            text += "\n(config stage only: call prepare() for the layer-level decision)"
        elif self._native is not None:
            text += ("\nforward: plain calls take the backend's native entry (fast_call); "
                     "others the Python path")
        if self._tuned:
            lines = ["", "policy=fastest, tuned per token bucket (T <= bucket):"]
            for t, row in self._tuned.items():
                times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in row.items() if n != "winner")
                lines.append(f"  T<={t:<5} {row['winner']:<12} {('(' + times + ')') if times else '(from the tuning cache)'}")
            text += "\n".join(lines)
        return text

    @property
    def uses_native_entry(self) -> bool:
        """Whether plain calls go to the backend's native entry (``BackendBase.fast_call``)."""
        return self._native is not None

    @property
    def tuned_table(self) -> dict[int, str] | None:
        """bucket size -> backend under policy="fastest" (None under "priority")."""
        return {t: row["winner"] for t, row in self._tuned.items()} if self._tuned else None  # type: ignore[misc]

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, backend={self.backend!r}, prepared={self.prepared}"

    # -- running -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ without its hook machinery when nothing needs it: measured here,
        # Module.__call__ costs ~60 us per call at E=64 H=2048 T=1 (every line after a kernel
        # that streamed 150 MB runs cold), 1% of the kernel. Hooks, compiled modules, JIT
        # tracing and torch.compile tracing all take the standard path.
        if (self._fast is None or self._compiled_call_impl is not None or self._forward_hooks
                or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3]
                or _is_compiling() or _tracing_state()):
            return super().__call__(*args, **kwargs)
        if len(args) == 3 and not kwargs:
            return self._forward_plain(*args)
        return self._forward_eager(*args, **kwargs)

    def _forward_plain(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """The eager forward, through the backend's native entry when it has one (the whole
        plain call in compiled code; it declines, with None, anything it cannot prove plain,
        and the Python path handles that)."""
        native = self._native
        if native is not None:
            entry, rec = native
            try:
                out = entry(hidden_states, topk_weights, topk_ids)
            except Exception as exc:
                # The entry checked the inputs before the kernel ran, so this is the kernel's
                # (or the entry's) failure; re-check all the same: the caller's bad input must
                # never demote a backend. (_fall_back demotes rec only if it is still in use.)
                check_forward(self.config, hidden_states, topk_weights, topk_ids)
                return self._fall_back(rec, exc, hidden_states, topk_weights, topk_ids)
            if out is not None:
                return out
        return self._forward_eager(hidden_states, topk_weights, topk_ids)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if _is_compiling():
            # One opaque custom op in the graph; its real kernel is _forward_plain.
            return torch.ops.moe_dispatch.moe_forward(hidden_states, topk_weights, topk_ids,
                                                      self._handle)
        if _tracing_state():
            # torch.jit.trace records torch ops: a native entry would be invisible to it.
            return self._forward_eager(hidden_states, topk_weights, topk_ids)
        return self._forward_plain(hidden_states, topk_weights, topk_ids)

    def _forward_eager(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        # Fast path: the same checks as _forward_checked, in as little code as possible.
        # Measured here: right after a kernel has streamed its weights through the caches
        # (or after any idle pause), Python and torch's bindings run cold: ten attribute
        # reads and one empty_like cost 1.7 us warm and ~80 us then. What counts is how many
        # *distinct* torch entry points a call touches, so this path reads only tensor
        # attributes (shape, dtype, is_cpu, _version) and at most one tolist() (none when
        # the kernel rejects bad ids itself: BackendSpec.validates_ids), and derives the rest
        # in plain Python. Any doubt: the checked path, which raises the precise error.
        fast = self._fast
        if fast is not None and type(hidden_states) is _Tensor and type(topk_weights) is _Tensor \
                and type(topk_ids) is _Tensor:
            rec, apply, state, table, tensors, versions, hidden, top_k, experts, dtype, check_ids = fast
            shape = hidden_states.shape
            if (len(shape) == 2 and shape[1] == hidden and shape[0] and hidden_states.dtype is dtype
                    and topk_weights.shape == topk_ids.shape == (shape[0], top_k)
                    and topk_ids.dtype in _ID_DTYPES and topk_weights.dtype in _FLOAT_DTYPES
                    and hidden_states.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu
                    and tuple(map(_version_of, tensors)) == versions):
                if check_ids:
                    lo, hi = id_range(topk_ids)
                    if lo < 0 or hi >= experts:
                        return self._forward_checked(hidden_states, topk_weights, topk_ids)
                if table is not None:
                    rec, apply, state = table[bucket_index(shape[0], len(table))]
                try:
                    return apply(state, hidden_states, topk_weights, topk_ids)
                except MoEDispatchError:
                    raise
                except Exception as exc:
                    # Maybe the caller's ids (unchecked above when the kernels check them):
                    # that raises the typed error here, and the backend is not blamed.
                    check_forward(self.config, hidden_states, topk_weights, topk_ids)
                    return self._fall_back(rec, exc, hidden_states, topk_weights, topk_ids)
        return self._forward_checked(hidden_states, topk_weights, topk_ids)

    def _forward_checked(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
        if self._inner is not None:
            return self._forward_expert_parallel(hidden_states, topk_weights, topk_ids)
        active = self._active
        if active is None:
            raise LayerStateError("forward() called before prepare(): call "
                                  "load_weights(...) and prepare() first")
        for name, ref, version in self._versions:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise WeightsModifiedError(
                    f"{name} was modified in place after prepare() (version {version} -> "
                    f"{tensor._version}); backend {active[0].name!r} holds a copy built from "
                    "the old values. Call prepare() again to rebuild it.")
        tokens = check_forward(self.config, hidden_states, topk_weights, topk_ids)
        if tokens == 0:
            return hidden_states.new_empty((0, self.config.hidden_size))
        table = self._table
        rec, state = active if table is None else table[bucket_index(tokens, len(table))]
        try:
            return rec.spec.backend.apply(state, hidden_states, topk_weights, topk_ids)
        except MoEDispatchError:
            raise  # a typed input error from the backend, not a kernel failure
        except Exception as exc:
            return self._fall_back(rec, exc, hidden_states, topk_weights, topk_ids)

    def _forward_expert_parallel(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                                 topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum: global ids are mapped to local ones, and only the
        (token, slot) pairs owned here are computed, as rows of a top-1 batch. Tokens routed
        only to other ranks get zeros."""
        assert self._inner is not None and self._expert_map is not None
        if not self._inner.prepared:
            raise LayerStateError("forward() called before prepare(): call "
                                  "load_weights(...) and prepare() first")
        tokens = check_forward(self.config, hidden_states, topk_weights, topk_ids)
        out = torch.zeros(tokens, self.config.hidden_size, dtype=torch.float32)
        if tokens:
            local = self._expert_map[topk_ids.to(torch.int64)]
            owned = local >= 0
            rows = torch.nonzero(owned)[:, 0]
            if rows.numel():
                y = self._inner(hidden_states[rows], topk_weights[owned].unsqueeze(1),
                                local[owned].unsqueeze(1))
                out.index_add_(0, rows, y.to(torch.float32))
        return out.to(hidden_states.dtype)

    def _fall_back(self, rec: BackendRecord, exc: Exception, hidden_states: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        error = f"{type(exc).__name__}: {exc}"
        if self.strict:
            raise KernelError(f"backend {rec.name!r} failed at run time ({error}); strict "
                              "mode forbids a fallback") from exc
        if self._backend_arg is not None or os.environ.get("MOE_DISPATCH_BACKEND"):
            raise KernelError(f"forced backend {rec.name!r} failed at run time ({error}); a "
                              "forced backend never falls back") from exc
        if self._canonical() is None:
            raise KernelError(f"backend {rec.name!r} failed at run time ({error}) and no fallback "
                              "is possible: the layer was built with keep_canonical=False and "
                              "the canonical weights are gone") from exc
        with self._lock:
            active = self._active
            in_use = active is not None and (active[0].name == rec.name or any(
                r.name == rec.name for r, _ in (self._table or ())))
            if in_use:
                log.warning("moe-dispatch: backend %r failed at run time on %s (%s); it is "
                            "demoted for this layer and the next accepting backend takes over",
                            rec.name, self.config.describe(), error)
                self._demotions.append(Demotion(rec.name, error))
                self._active = self._fast = self._native = None
                self._table = self._tuned = None  # back to the priority path for this layer
                try:
                    self.prepare()
                except (NoBackendError, MoEDispatchError) as exc2:
                    raise KernelError(f"backend {rec.name!r} failed at run time ({error}) and no "
                                      f"fallback accepts this layer: {exc2}") from exc
            active = self._active
        assert active is not None
        return self._forward_eager(hidden_states, topk_weights, topk_ids)
