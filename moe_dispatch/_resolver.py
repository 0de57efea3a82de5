"""The priority resolver: pick the first backend that accepts, and say why for all others.

Resolution runs in two stages. ``resolve`` asks every backend's ``supports_config``;
``resolve_layer`` then walks only the backends that accepted the config, in the same
order, asking ``supports_layer`` on the real tensors. A layer-level rejection narrows the
list; it never jumps to a backend whose config check failed (vLLM's silent fall-through).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Iterable

import attrs

from ._capabilities import Capabilities
from ._config import MoEConfig
from ._decision import Decision, reject
from ._errors import (BackendRejectedError, InvalidArgumentError, InvalidTypeError,
                      KernelError, NoBackendError, UnknownBackendError)
from ._registry import BackendRecord, PluginFailure, env_names, get_registry
from ._spec import LayerWeights, normalize_name

log = logging.getLogger("moe_dispatch")

CHOSEN = "chosen"
REJECTED = "rejected"
EXCLUDED = "excluded"
STANDBY = "standby"  # accepted, but a higher-priority backend was chosen
NOT_FORCED = "not forced"
LAYER_REJECTED = "layer rejected"
DEMOTED = "demoted"  # failed at run time on this layer


@attrs.frozen(slots=True)
class Candidate:
    """One backend as the resolver saw it."""

    name: str
    priority: int
    source: str
    decision: Decision  # supports_config
    status: str
    layer_decision: Decision | None = None  # supports_layer (layer stage only)

    @property
    def reason(self) -> str:
        if self.layer_decision is not None and not self.layer_decision.accepted:
            return self.layer_decision.reason
        return self.decision.reason


@attrs.frozen(slots=True)
class Resolution:
    """The outcome: the chosen backend, and every candidate in the order tried."""

    config: MoEConfig
    backend: str
    candidates: tuple[Candidate, ...]
    capabilities: Capabilities = attrs.field(eq=False, repr=False)
    forced: str | None = None
    excluded: frozenset[str] = frozenset()
    failures: tuple[PluginFailure, ...] = ()
    stage: str = "config"
    notes: tuple[str, ...] = ()

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.name == self.backend)

    def explain(self) -> str:
        return format_table(self)


def _exclusion_sets(exclude: Iterable[str] | str) -> tuple[frozenset[str], frozenset[str]]:
    if isinstance(exclude, str):
        exclude = [exclude]
    try:
        by_arg = frozenset(normalize_name(n) for n in exclude)
    except (TypeError, AttributeError):
        raise InvalidTypeError("exclude", exclude, "an iterable of backend names (str)") from None
    return by_arg, env_names("MOE_DISPATCH_DISABLE")


def _forced_name(backend: str | None) -> str | None:
    if backend is None:
        backend = os.environ.get("MOE_DISPATCH_BACKEND") or None
    if backend is None:
        return None
    if not isinstance(backend, str) or not backend.strip():
        raise InvalidTypeError("backend", backend, "a registered backend name (str) or None")
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


class _Cache:
    """Resolution results per (registry generation, config, capabilities, overrides)."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._data: dict[Any, Resolution] = {}
        self._limit = limit
        self._announced: set[tuple[MoEConfig, str]] = set()

    def get(self, key: Any) -> Resolution | None:
        return self._data.get(key)

    def put(self, key: Any, value: Resolution) -> None:
        with self._lock:
            if len(self._data) >= self._limit:
                self._data.clear()
            self._data[key] = value

    def announce(self, res: Resolution) -> None:
        """The chosen backend at INFO once per (config, backend); skips at DEBUG."""
        key = (res.config, res.backend)
        with self._lock:
            first = key not in self._announced
            self._announced.add(key)
        if first:
            log.info("moe-dispatch: %s runs on backend %r%s", res.config.describe(),
                     res.backend, " (forced)" if res.forced else "")
        for cand in res.candidates:
            if cand.status in (REJECTED, EXCLUDED, LAYER_REJECTED):
                log.debug("moe-dispatch: skipped backend %r for %s: %s", cand.name,
                          res.config.describe(), cand.reason)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._announced.clear()


_CACHE = _Cache()


def clear_cache() -> None:
    """Forget cached resolutions (they are also dropped whenever plugins change)."""
    _CACHE.clear()


def resolve(config: MoEConfig, *, backend: str | None = None, exclude: Iterable[str] = (),
            capabilities: Capabilities | None = None) -> Resolution:
    """Pick the backend for ``config``: the first, by priority, whose config check accepts.

    ``backend`` (or env ``MOE_DISPATCH_BACKEND``) forces one; forced and rejected raises
    :class:`BackendRejectedError`. ``exclude`` (and env ``MOE_DISPATCH_DISABLE``) removes
    backends. Raises :class:`NoBackendError` listing every reason when none accepts.
    """
    if not isinstance(config, MoEConfig):
        raise InvalidTypeError("config", config, "a moe_dispatch.MoEConfig")
    if capabilities is not None and not isinstance(capabilities, Capabilities):
        raise InvalidTypeError("capabilities", capabilities, "a moe_dispatch.Capabilities or None")
    caps = capabilities if capabilities is not None else Capabilities.detect()
    if config.is_expert_parallel:
        # Each rank resolves its own local config; -1 ids never reach a kernel (the layer
        # remaps global ids and keeps only this rank's (token, slot) pairs).
        local = resolve(config.local_config(), backend=backend, exclude=exclude, capabilities=caps)
        note = (f"expert parallel: rank {config.ep_rank} of {config.ep_size} ({config.placement}), "
                f"local experts {_ranges(config.local_expert_ids)} of {config.num_experts}; "
                "resolved for the local config")
        return attrs.evolve(local, notes=local.notes + (note,))
    forced = _forced_name(backend)
    by_arg, by_env = _exclusion_sets(exclude)
    snap = get_registry().snapshot()
    key = (snap.generation, config, caps, forced, by_arg, by_env)
    cached = _CACHE.get(key)
    if cached is None:
        # Failures are not cached: they raise, and the caller fixes the input.
        cached = _resolve(config, caps, forced, by_arg, by_env, snap.records, snap.failures)
        _CACHE.put(key, cached)
        _CACHE.announce(cached)
    return cached


def _resolve(config: MoEConfig, caps: Capabilities, forced: str | None, by_arg: frozenset[str],
             by_env: frozenset[str], records: tuple[BackendRecord, ...],
             failures: tuple[PluginFailure, ...]) -> Resolution:
    names = [r.name for r in records]
    if forced is not None:
        if forced not in names:
            raise UnknownBackendError(
                f"backend {forced!r} is not registered; registered backends are "
                f"{', '.join(names) or '(none)'}" + _failure_hint(failures))
        if forced in by_arg or forced in by_env:
            raise InvalidArgumentError(
                "backend", forced, "a backend that is not also excluded (it is listed in "
                + ("exclude=" if forced in by_arg else "MOE_DISPATCH_DISABLE") + ")")
    decisions: list[tuple[BackendRecord, Decision, bool]] = []
    for rec in records:
        if rec.name in by_arg or rec.name in by_env:
            why = "exclude= argument" if rec.name in by_arg else "MOE_DISPATCH_DISABLE"
            decisions.append((rec, reject(f"excluded by {why}"), True))
        else:
            decisions.append((rec, call_check(rec, "supports_config", config, caps), False))
    chosen: str | None = None
    if forced is not None:
        rec, dec, _ = next(d for d in decisions if d[0].name == forced)
        if not dec.accepted:
            raise BackendRejectedError(forced, dec.reason, "config")
        chosen = forced
    else:
        chosen = next((rec.name for rec, dec, _ in decisions if dec.accepted), None)
    candidates = []
    for rec, dec, excluded in decisions:
        if excluded:
            status = EXCLUDED
        elif rec.name == chosen:
            status = CHOSEN
        elif not dec.accepted:
            status = REJECTED
        elif forced is not None:
            status = NOT_FORCED
        else:
            status = STANDBY
        candidates.append(Candidate(rec.name, rec.priority, rec.source, dec, status))
    res = Resolution(config=config, backend=chosen or "", candidates=tuple(candidates),
                     capabilities=caps, forced=forced, excluded=by_arg | by_env,
                     failures=failures)
    if chosen is None:
        raise NoBackendError(f"no backend accepts {config.describe()}:\n" + format_table(res))
    return res


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


def _failure_hint(failures: tuple[PluginFailure, ...]) -> str:
    if not failures:
        return ""
    return "; plugins that failed to load: " + "; ".join(
        f"{f.plugin} ({f.error})" for f in failures)


def resolve_layer(res: Resolution, weights: LayerWeights,
                  build: Callable[[BackendRecord], Any], *, strict: bool = False
                  ) -> tuple[Resolution, BackendRecord, Any]:
    """The layer stage: walk the config-accepting backends in order on the real tensors.

    ``build(record)`` runs the backend's weight processing; if it raises, the backend
    is treated as rejecting the layer (unless ``strict`` or forced, where it raises).
    Returns the final resolution, the chosen record and the backend's prepared state.
    """
    snap = get_registry().snapshot()
    caps = res.capabilities
    layer_decisions: dict[str, Decision] = {}
    chosen: tuple[BackendRecord, Any] | None = None
    for cand in res.candidates:
        eligible = cand.status == CHOSEN or (cand.status == STANDBY and res.forced is None)
        if not eligible:
            continue
        try:
            rec = snap.by_name(cand.name)
        except LookupError:
            layer_decisions[cand.name] = reject("the plugin was unregistered after resolution")
            continue
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
                layer_decisions[cand.name] = dec
                chosen = (rec, state)
                break
        layer_decisions[cand.name] = dec
        if res.forced is not None:
            raise BackendRejectedError(rec.name, dec.reason, "layer")
    candidates = []
    for cand in res.candidates:
        ld = layer_decisions.get(cand.name)
        if chosen is not None and cand.name == chosen[0].name:
            status = CHOSEN
        elif ld is not None and not ld.accepted:
            status = LAYER_REJECTED
        elif cand.status == CHOSEN:  # config winner not reached? cannot happen; keep data
            status = STANDBY
        else:
            status = cand.status
        candidates.append(attrs.evolve(cand, status=status, layer_decision=ld))
    final = attrs.evolve(res, backend=chosen[0].name if chosen else "",
                         candidates=tuple(candidates), stage="layer")
    if chosen is None:
        raise NoBackendError(f"no backend accepts the loaded layer ({res.config.describe()}):\n"
                             + format_table(final))
    _CACHE.announce(final)
    return final, chosen[0], chosen[1]


def format_table(res: Resolution) -> str:
    """The human-readable explanation: order, backend, priority, result, reason."""
    caps = res.capabilities
    head = [f"moe-dispatch resolution ({res.stage} stage) for {res.config.describe()}",
            f"machine: {caps.fingerprint()}"]
    if res.forced:
        head.append(f"forced: {res.forced}")
    if res.excluded:
        head.append(f"excluded: {', '.join(sorted(res.excluded))}")
    rows = [("#", "backend", "priority", "result", "reason")]
    for i, c in enumerate(res.candidates, 1):
        reason = c.reason
        if c.status == STANDBY:
            reason = "accepted; a higher-priority backend was chosen" + (
                f" ({reason})" if reason else "")
        elif c.status == NOT_FORCED:
            reason = f"accepted; not the forced backend ({res.forced})"
        elif c.status == CHOSEN and not reason:
            reason = "accepted" + (" (forced)" if res.forced else "")
        rows.append((str(i), c.name, str(c.priority), c.status, reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    out = head + [""] + lines
    for note in res.notes:
        out.append(note)
    if res.failures:
        out.append("")
        out.append("plugins that failed to load or were excluded:")
        out.extend(f"  {f.plugin}: {f.error} [{f.source}]" for f in res.failures)
    if res.backend:
        out.append("")
        out.append(f"=> {res.backend}")
    return "\n".join(out)


def explain(config: MoEConfig, *, backend: str | None = None, exclude: Iterable[str] = (),
            capabilities: Capabilities | None = None) -> str:
    """The resolution table for ``config`` as text; on failure the table of reasons."""
    try:
        return resolve(config, backend=backend, exclude=exclude,
                       capabilities=capabilities).explain()
    except NoBackendError as exc:
        return str(exc)
