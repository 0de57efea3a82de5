"""The priority resolver: pick the first backend that accepts, and say why for all others.

Resolution runs in two stages. ``resolve`` asks every backend's ``supports_config``;
``resolve_layer`` then walks only the backends that accepted the config, in the same
order and from the same registry snapshot, asking ``supports_layer`` on the real tensors. A
layer-level rejection narrows the list; it never jumps to a backend whose config check
failed (vLLM's silent fall-through).

Gates are pure functions of (config, capabilities, the env variables the backend declares
in ``BackendSpec.env_vars``), so a resolution is cached under exactly those inputs.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Iterable

import attrs

from ._capabilities import Capabilities, probe_op, record_ops
from ._config import MoEConfig
from ._decision import Decision, reject
from ._errors import (BackendRejectedError, InvalidArgumentError, InvalidTypeError,
                      KernelError, NoBackendError, UnknownBackendError)
from ._explain import format_table
from ._memory import check_copies_arg, over_budget, weight_budget
from ._registry import PluginFailure, env_names, get_registry
from ._resolution import Candidate, Resolution, Status
from ._spec import BackendRecord, LayerWeights, normalize_name

log = logging.getLogger("moe_dispatch")


def _exclusion_sets(exclude: Iterable[str] | str) -> tuple[frozenset[str], frozenset[str]]:
    if isinstance(exclude, str):
        exclude = [exclude]
    try:
        by_arg = frozenset(normalize_name(n) for n in exclude)
    except (TypeError, AttributeError):
        raise InvalidTypeError("exclude", exclude, "an iterable of backend names (str)") from None
    return by_arg, env_names("MOE_DISPATCH_DISABLE")


class _EnvName(str):
    """A forced name read from env ``MOE_DISPATCH_BACKEND``, so errors can say so."""


def forced_name(backend: str | None) -> str | None:
    """The forced backend: the argument, else env ``MOE_DISPATCH_BACKEND`` (blank is
    unset), normalised."""
    if backend is None:
        env = os.environ.get("MOE_DISPATCH_BACKEND", "")
        return _EnvName(normalize_name(env)) if env.strip() else None
    if not isinstance(backend, str):
        raise InvalidTypeError("backend", backend, "a registered backend name (str) or None")
    if not backend.strip():
        raise InvalidArgumentError("backend", backend, "a registered backend name, or None")
    return normalize_name(backend)


def call_check(rec: BackendRecord, method: str, *args: Any) -> Decision:
    """Call a backend's check; an exception or a non-Decision becomes a rejection naming it."""
    try:
        result = getattr(rec.spec.backend, method)(*args)
    except Exception as exc:
        return reject(f"{method} raised {type(exc).__name__}: {exc} [backend {rec.name!r} "
                      f"from {rec.source}; treated as a rejection]")
    if not isinstance(result, Decision):
        return reject(f"{method} returned {type(result).__name__} {result!r:.60} instead of a "
                      f"Decision [backend {rec.name!r} from {rec.source}; treated as a rejection]")
    return result


def gate_env(records: Iterable[BackendRecord]) -> tuple[tuple[str, str | None], ...]:
    """What the gates read besides (config, capabilities): the env variables they declare.
    (The ops they look up are checked on every cache hit: see resolve.)"""
    env = sorted({v for r in records for v in r.spec.env_vars})
    return tuple((v, os.environ.get(v)) for v in env)


class _Cache:
    """Resolutions by key; a plain bounded store (announcing is the resolver's job)."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._data: dict[Any, tuple[Resolution, tuple[tuple[str, str | None], ...]]] = {}
        self._limit = limit

    def get(self, key: Any) -> tuple[Resolution, tuple[tuple[str, str | None], ...]] | None:
        return self._data.get(key)

    def put(self, key: Any, value: tuple[Resolution, tuple[tuple[str, str | None], ...]]) -> None:
        with self._lock:
            if len(self._data) >= self._limit:
                self._data.clear()
            self._data[key] = value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


_CACHE = _Cache()
_ANNOUNCED: set[tuple[MoEConfig, str]] = set()
_ANNOUNCED_LOCK = threading.Lock()


def _announce(res: Resolution) -> None:
    """The chosen backend at INFO once per (config, backend); skips at DEBUG."""
    key = (res.config, res.backend)
    with _ANNOUNCED_LOCK:
        first = key not in _ANNOUNCED
        _ANNOUNCED.add(key)
    if first:
        log.info("moe-dispatch: %s runs on backend %r%s", res.config.describe(), res.backend,
                 " (forced)" if res.forced else "")
    for cand in res.candidates:
        if cand.status in (Status.REJECTED, Status.EXCLUDED, Status.LAYER_REJECTED):
            log.debug("moe-dispatch: skipped backend %r for %s: %s", cand.name,
                      res.config.describe(), cand.reason)


def clear_cache() -> None:
    """Forget cached resolutions (they are also dropped whenever plugins change)."""
    _CACHE.clear()
    with _ANNOUNCED_LOCK:
        _ANNOUNCED.clear()


def resolve(config: MoEConfig, *, backend: str | None = None, exclude: Iterable[str] = (),
            capabilities: Capabilities | None = None,
            max_weight_copies: float | None = None) -> Resolution:
    """Pick the backend for ``config``: the first, by priority, whose config check accepts.

    ``backend`` (or env ``MOE_DISPATCH_BACKEND``) forces one; forced and rejected raises
    :class:`BackendRejectedError`. ``exclude`` (and env ``MOE_DISPATCH_DISABLE``) removes
    backends, and so does ``max_weight_copies`` every backend that holds more copies of the
    weights (None: one for quantized weights, no limit for float ones; a forced backend
    runs regardless). Raises :class:`NoBackendError` listing every reason when none accepts.
    """
    if not isinstance(config, MoEConfig):
        raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
    if config.is_expert_parallel:
        raise InvalidArgumentError(
            "config", config.describe(), "a config with ep_size == 1: a rank runs "
            "config.local_config(), which is what to resolve (ExpertParallelLayer does)")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise InvalidTypeError("capabilities", capabilities, "a moe_dispatch.Capabilities or None")
    caps = capabilities if capabilities is not None else Capabilities.detect()
    forced = forced_name(backend)
    by_arg, by_env = _exclusion_sets(exclude)
    budget = weight_budget(config, check_copies_arg(max_weight_copies))
    snap = get_registry().snapshot()
    key = (snap.generation, config, caps, forced, by_arg, by_env, budget, gate_env(snap.records))
    hit = _CACHE.get(key)
    # A hit is valid only while every op a gate looked up still answers the same (a vendor
    # may register its op after a first resolution rejected it).
    if hit is not None and all(probe_op(n) == s for n, s in hit[1]):
        return hit[0]
    with record_ops() as asked:
        # Failures are not cached: they raise, and the caller fixes the input.
        res = _resolve(config, caps, forced, by_arg, by_env, budget, snap.records, snap.failures)
    _CACHE.put(key, (res, tuple(asked.items())))
    _announce(res)
    return res


def _status(rec: BackendRecord, dec: Decision, excluded: bool, chosen: str | None,
            forced: str | None) -> Status:
    if excluded:
        return Status.EXCLUDED
    if rec.name == chosen:
        return Status.CHOSEN
    if not dec.accepted:
        return Status.REJECTED
    return Status.NOT_FORCED if forced is not None else Status.STANDBY


def _resolve(config: MoEConfig, caps: Capabilities, forced: str | None, by_arg: frozenset[str],
             by_env: frozenset[str], budget: float, records: tuple[BackendRecord, ...],
             failures: tuple[PluginFailure, ...]) -> Resolution:
    names = [r.name for r in records]
    if forced is not None:
        from_env = isinstance(forced, _EnvName)
        forced = str(forced)
        if forced not in names:
            where = " (from env MOE_DISPATCH_BACKEND)" if from_env else ""
            raise UnknownBackendError(
                f"backend {forced!r}{where} is not registered; registered backends are "
                f"{', '.join(names) or '(none)'}" + _failure_hint(failures))
        if forced in by_arg or forced in by_env:
            raise InvalidArgumentError(
                "MOE_DISPATCH_BACKEND" if from_env else "backend", forced, "a backend that is not also excluded (it is listed in "
                + ("exclude=" if forced in by_arg else "MOE_DISPATCH_DISABLE") + ")")
    decisions: list[tuple[BackendRecord, Decision, bool]] = []
    for rec in records:
        if rec.name in by_arg or rec.name in by_env:
            why = "exclude= argument" if rec.name in by_arg else "MOE_DISPATCH_DISABLE"
            decisions.append((rec, reject(f"excluded by {why}"), True))
        elif config.weight_format not in rec.spec.weights:
            scheme = config.weight_scheme
            decisions.append((rec, reject(
                f"runs {'/'.join(rec.spec.weights)} weights; this config has "
                f"{'float' if scheme is None else scheme.describe()} weights"), False))
        elif forced is None and (why := over_budget(rec, config, budget)) is not None:
            decisions.append((rec, reject(why), True))
        else:
            decisions.append((rec, call_check(rec, "supports_config", config, caps), False))
    if forced is not None:
        dec = next(d for r, d, _ in decisions if r.name == forced)
        if not dec.accepted:
            raise BackendRejectedError(forced, dec.reason, "config")
        chosen: str | None = forced
    else:
        chosen = next((r.name for r, d, _ in decisions if d.accepted), None)
    candidates = tuple(Candidate(r.name, r.priority, r.source, d, _status(r, d, ex, chosen, forced))
                       for r, d, ex in decisions)
    res = Resolution(config=config, backend=chosen or "", candidates=candidates,
                     capabilities=caps, forced=forced, excluded=by_arg | by_env,
                     failures=failures, records=records)
    if chosen is None:
        raise NoBackendError(f"no backend accepts {config.describe()}:\n" + format_table(res))
    return res


def _failure_hint(failures: tuple[PluginFailure, ...]) -> str:
    if not failures:
        return ""
    return "; plugins that failed to load: " + "; ".join(
        f"{f.plugin} ({f.error})" for f in failures)


def layer_candidates(res: Resolution) -> list[BackendRecord]:
    """The backends the layer stage may try, in order: the config stage's choice and, unless
    a backend was forced, every other config-accepting one."""
    out = []
    for cand in res.candidates:
        if cand.status is Status.CHOSEN or (cand.status is Status.STANDBY and res.forced is None):
            rec = res.record(cand.name)
            if rec is not None:
                out.append(rec)
    return out


def resolve_layer(res: Resolution, weights: LayerWeights,
                  build: Callable[[BackendRecord], Any], *, strict: bool = False
                  ) -> tuple[Resolution, BackendRecord, Any]:
    """The layer stage: walk the config-accepting backends in order on the real tensors.

    ``build(record)`` runs the backend's weight processing; if it raises, the backend
    is treated as rejecting the layer (unless ``strict`` or forced, where it raises).
    Returns the final resolution, the chosen record and the backend's prepared state.
    """
    caps = res.capabilities
    layer_decisions: dict[str, Decision] = {}
    chosen: tuple[BackendRecord, Any] | None = None
    for rec in layer_candidates(res):
        dec = call_check(rec, "supports_layer", weights, caps)
        if dec.accepted:
            try:
                state = build(rec)
            except Exception as exc:
                if strict or res.forced is not None:
                    raise KernelError(f"backend {rec.name!r} failed to process the weights: "
                                      f"{type(exc).__name__}: {exc}") from exc
                log.warning("moe-dispatch: backend %r failed to process the weights (%s: %s); "
                            "trying the next backend", rec.name, type(exc).__name__, exc)
                dec = reject(f"process_weights raised {type(exc).__name__}: {exc}")
            else:
                layer_decisions[rec.name] = dec
                chosen = (rec, state)
                break
        layer_decisions[rec.name] = dec
        if res.forced is not None:
            raise BackendRejectedError(rec.name, dec.reason, "layer")
    winner = chosen[0].name if chosen else ""
    candidates = []
    for cand in res.candidates:
        ld = layer_decisions.get(cand.name)
        if cand.name == winner:
            status = Status.CHOSEN
        elif ld is not None and not ld.accepted:
            status = Status.LAYER_REJECTED
        else:
            status = cand.status
        candidates.append(attrs.evolve(cand, status=status, layer_decision=ld))
    final = attrs.evolve(res, backend=winner, candidates=tuple(candidates), stage="layer")
    if chosen is None:
        raise NoBackendError(f"no backend accepts the loaded layer ({res.config.describe()}):\n"
                             + format_table(final))
    _announce(final)
    return final, chosen[0], chosen[1]


def explain(config: MoEConfig, *, backend: str | None = None, exclude: Iterable[str] = (),
            capabilities: Capabilities | None = None,
            max_weight_copies: float | None = None) -> str:
    """The resolution table for ``config`` as text; on failure the table of reasons."""
    try:
        return resolve(config, backend=backend, exclude=exclude, capabilities=capabilities,
                       max_weight_copies=max_weight_copies).explain()
    except NoBackendError as exc:
        return str(exc)
