"""From a resolved config and loaded weights to an :class:`ExecutionPlan`.

The layer stage of resolution, the backend's weight processing, per-bucket routing
(policy="auto" / "fastest"), the routes' native entries, the forward's constants: all decided here,
once, and frozen into the plan.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import attrs
import torch

from ._canonical import CanonicalWeights
from ._config import MoEConfig
from ._decision import reject
from ._options import LayerOptions
from ._plan import Demotion, ExecutionPlan, NativeEntry, Route
from ._resolution import Resolution, Status
from ._resolver import call_check, resolve, resolve_layer
from ._spec import BackendRecord, FastGuard, LayerWeights
from ._buckets import bucket_sizes
from ._tuning import tune

log = logging.getLogger("moe_dispatch")


def build_plan(config: MoEConfig, options: LayerOptions, config_stage: Resolution,
               weights: LayerWeights, demotions: Sequence[Demotion]) -> ExecutionPlan:
    """Resolve the layer on ``weights`` (without the demoted backends), prepare the chosen
    backend, tune if asked, and freeze everything the forward needs; outside the caller's
    autocast: under it a backend's warm-up check compared its kernel with a reference
    computed in bf16 and failed (a transformers model first run under autocast lost that
    backend for good), and the tuning would time other kernels than the forward runs."""
    with torch.autocast("cpu", enabled=False):
        return _build_plan(config, options, config_stage, weights, demotions)


def _build_plan(config: MoEConfig, options: LayerOptions, config_stage: Resolution,
                weights: LayerWeights, demotions: Sequence[Demotion]) -> ExecutionPlan:
    res = config_stage
    if demotions:
        res = resolve(config, backend=options.backend,
                      exclude=options.exclude + tuple(d.backend for d in demotions),
                      capabilities=options.capabilities, max_weight_copies=options.max_weight_copies)
    caps = res.capabilities

    def build(rec: BackendRecord) -> Any:
        return rec.spec.backend.process_weights(weights, caps)

    final, rec, state = resolve_layer(res, weights, build, strict=options.strict)
    route = Route(rec, state)
    canonical = CanonicalWeights.hold(weights, strong=options.keep_canonical)
    watched = canonical.tensors()
    # Native entries guard the caller's weights (version, storage): only when those are held.
    guard = FastGuard(watched, canonical.versions, canonical.storage_ids) if watched else None
    # One (entry, route) pair per distinct route, so that buckets served by the same route
    # share it; the route is held beside it, so its id is not reused meanwhile.
    pairs: dict[int, tuple[Route, tuple[NativeEntry, Route] | None]] = {}

    def pair_of(r: Route) -> tuple[NativeEntry, Route] | None:
        if id(r) not in pairs:
            entry = _native_entry(r, guard) if guard is not None else None
            pairs[id(r)] = (r, (entry, r) if entry is not None else None)
        return pairs[id(r)][1]

    table = tuned = None
    note = ""
    if options.policy != "priority" and res.forced is None and not demotions:
        # Tuning times what the forward will run: a route's native entry where it has one.
        table, tuned, note = tune(config, final, route, weights, build, options.tuning,
                                  lambda r: _runner(r, pair_of(r)))
        note = f"policy={options.policy}: {note}"
    fmt = config.weight_format
    if table is None and res.forced is None and rec.spec.token_limit(fmt) is not None:
        table, tuned, limited = _limited(final, route, weights, build, options.tuning.max_tokens, fmt)
        note = f"{note}; {limited}" if note else limited
    if table is not None and all(r is not route for r in table):
        # No token count runs on the resolver's choice: its prepared state (a copy of the
        # weights) is not kept, and the layer's backend is the route of T=1.
        route = table[0]
    routes = (route,) if table is None else tuple({id(r): r for r in table}.values())
    natives = None
    if guard is not None and any(pair_of(r) is not None for r in routes):
        natives = tuple(pair_of(r) for r in (table if table is not None else (route,)))
    return ExecutionPlan(
        resolution=_annotate(final, demotions), route=route, canonical=canonical, table=table,
        tuned=tuned, tuning_note=note, natives=natives, watched=watched,
        versions=canonical.versions, storage_ids=canonical.storage_ids, hidden=config.hidden_size, top_k=config.top_k,
        experts=config.num_experts, dtype=config.dtype,
        # The id range check can be left to the kernels only when every backend this plan
        # may run rejects bad ids itself (BackendSpec.validates_ids).
        check_ids=not all(r.record.spec.validates_ids for r in routes))


def _limited(final: Resolution, route: Route, weights: LayerWeights,
             build: Callable[[BackendRecord], Any], cap: int, fmt: str
             ) -> tuple[tuple[Route, ...] | None, dict[int, dict[str, Any]] | None, str]:
    """The chosen backend serves buckets up to its ``max_tokens`` for the weights' format
    ``fmt``; the first backend after it without a limit that accepts the layer serves the
    rest (prepared here)."""
    limit = route.record.spec.token_limit(fmt)
    for cand in final.candidates:
        other = final.record(cand.name)
        if (cand.status is not Status.STANDBY or other is None
                or other.spec.token_limit(fmt) is not None):
            continue
        if not call_check(other, "supports_layer", weights, final.capabilities).accepted:
            continue
        try:
            beyond = Route(other, build(other))
        except Exception as exc:  # as in the resolver: a backend that cannot prepare is skipped
            log.warning("moe-dispatch: %r could not be prepared for T > %s (%s)", other.name, limit, exc)
            continue
        sizes = bucket_sizes(cap)
        table = tuple(route if route.record.spec.serves(t, fmt) else beyond for t in sizes)
        why = f"{route.name} serves T <= {limit} (its max_tokens)"
        tuned = {t: {"winner": r.name, "ms": {}, "source": why} for t, r in zip(sizes, table)}
        return table, tuned, f"{why}; larger calls run on {beyond.name}"
    return None, None, (f"{route.name} serves T <= {limit} (its max_tokens), and no other backend "
                        "accepts the layer: it runs every call")


def _runner(route: Route, pair: tuple[NativeEntry, Route] | None) -> Callable[..., torch.Tensor]:
    apply, state = route.apply, route.state
    if pair is None:
        return lambda x, tw, ids: apply(state, x, tw, ids)
    entry = pair[0]

    def run(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = entry(x, tw, ids)
        return out if out is not None else apply(state, x, tw, ids)
    return run


def _native_entry(route: Route, guard: FastGuard) -> NativeEntry | None:
    fast_call = getattr(route.record.spec.backend, "fast_call", None)
    if fast_call is None:
        return None
    try:
        entry = fast_call(route.state, guard)
    except Exception as exc:  # an optional accelerator: its failure costs speed only
        log.warning("moe-dispatch: backend %r's fast_call failed (%s: %s); its Python path "
                    "runs", route.name, type(exc).__name__, exc)
        return None
    return entry if callable(entry) else None


def _annotate(res: Resolution, demotions: Sequence[Demotion]) -> Resolution:
    """The resolution with each demoted backend marked, and why, for ``explain()``."""
    if not demotions:
        return res
    why = {d.backend: d.error for d in demotions}
    notes = tuple(f"demoted at run time: {d.backend}: {d.error}" for d in demotions)
    cands = tuple(attrs.evolve(c, status=Status.DEMOTED, layer_decision=reject(why[c.name]))
                  if c.name in why else c for c in res.candidates)
    return attrs.evolve(res, candidates=cands, notes=res.notes + notes)
