"""Routing per token count, measured: policy="auto" (the default) and policy="fastest".

Token counts are bucketed in powers of two up to a cap; a forward with T tokens runs the
winner of the smallest bucket >= T (the last bucket for larger T). :func:`tune` builds the
per-bucket routes of an execution plan: from the tuning cache (``_tuning_cache``), so each
(machine, shape, kernel versions) is measured once, or measured now on the real layer's
prepared states (``_measure`` has the rules). It times routes, never a layer (this module
does not import the layer).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable


from ._config import MoEConfig
from ._options import TuningOptions
from ._plan import Route, bad_output, good_output
from ._random import random_inputs
from ._resolution import Resolution, Status
from ._resolver import call_check
from ._spec import BackendRecord, LayerWeights
from ._buckets import bucket_sizes, within_limits
from ._measure import Runner, measure, measure_adaptive
from ._memory import weight_budget, within_memory
from ._tuning_cache import CachedTable, TuningCache, tuning_key

log = logging.getLogger("moe_dispatch")

Build = Callable[[BackendRecord], Any]


def _candidates(final: Resolution, chosen: Route, weights: LayerWeights,
                max_candidates: int | None, left: dict[str, str]) -> dict[str, BackendRecord]:
    """The resolver's choice, then every other backend that accepts the layer, in priority
    order, up to ``max_candidates``; those whose supports_layer says no go in ``left`` with
    the reason. Nothing is prepared here."""
    caps = final.capabilities
    records: dict[str, BackendRecord] = {chosen.name: chosen.record}
    for cand in final.candidates:
        if max_candidates is not None and len(records) >= max_candidates:
            break
        if cand.name in records or cand.status not in (Status.STANDBY, Status.CHOSEN):
            continue
        other = final.record(cand.name)
        if other is None:
            continue
        decision = call_check(other, "supports_layer", weights, caps)
        if decision.accepted:
            records[other.name] = other
        else:
            left[other.name] = f"rejects the layer: {decision.reason}"
    return records


def tune(config: MoEConfig, final: Resolution, chosen: Route, weights: LayerWeights,
         build: Build, options: TuningOptions, runner: Callable[[Route], Runner]
         ) -> tuple[tuple[Route, ...] | None, dict[int, dict[str, Any]] | None, str]:
    """The route of every bucket, from the tuning cache or measured now; bucket ->
    {"winner": name, "ms": {name: ms}, "source": how it was decided}; and a one-line
    summary (cost, candidates). ``runner(route)``: what a forward runs on that route (its
    native entry, or its ``apply``). Only the winners' prepared states are kept (memory).
    (None, None, summary) when the candidates cannot serve every bucket by their
    ``max_tokens``: the plan routes as policy="priority" does then."""
    started = time.perf_counter()
    left: dict[str, str] = {}  # backends not timed, and why: explain() shows them
    records = _candidates(final, chosen, weights, options.max_candidates, left)
    sizes = bucket_sizes(options.max_tokens)
    names = sorted(records)
    if len(names) == 1:
        if chosen.record.spec.token_limit(config.weight_format) is not None:
            return None, None, (f"one candidate ({chosen.name}), which declares max_tokens"
                                f"{_not_tuned(left)}")
        rows = {t: {"winner": chosen.name, "ms": {}, "source": "the only candidate"} for t in sizes}
        return (chosen,) * len(sizes), rows, (f"one candidate ({chosen.name}): nothing to "
                                              f"measure{_not_tuned(left)}")
    cache = None if options.cache is False else TuningCache(
        None if options.cache in (None, True) else options.cache)  # type: ignore[arg-type]
    budget = weight_budget(config, options.max_weight_copies)
    key = tuning_key(config, final.capabilities, {n: records[n].spec.version for n in names},
                     budget, {v: os.environ.get(v) for n in names for v in records[n].spec.env_vars})
    cached = cache.get(key, names, sizes) if cache is not None else None
    if cached is not None and not options.adaptive and list(cached.measured) != sizes:
        cached = None  # "fastest" wants every bucket measured, not a probed table
    if cached is not None and cached.partial_budget_s is not None and \
            options.budget_s > cached.partial_budget_s:
        cached = None  # cut short by a smaller budget than this layer's: measure again
    prepared: dict[str, Route] = {chosen.name: chosen}
    fitted = ""

    need = 2 * sum(t.numel() * t.element_size() for _, t in weights.tensors())

    def prepare_all(wanted: list[str]) -> None:
        for name in wanted:
            if name not in prepared:
                free = available_bytes()
                if free is not None and free < need:
                    # A candidate's state can take twice the weights (measured for a built-in
                    # backend in bf16): one more must not push the machine into swap or the
                    # OOM killer.
                    log.warning("moe-dispatch: %r not prepared for tuning: %d MiB available, "
                                "%d MiB wanted", name, free >> 20, need >> 20)
                    left[name] = (f"not prepared: memory ({free >> 20} MiB available, "
                                  f"{need >> 20} MiB wanted)")
                    continue
                try:
                    prepared[name] = Route(records[name], build(records[name]))
                except Exception as exc:  # a candidate that cannot prepare is not used
                    log.warning("moe-dispatch: %r could not be prepared for tuning (%s)", name, exc)
                    left[name] = f"could not be prepared ({type(exc).__name__}: {exc})"

    if cached is not None:
        prepare_all(sorted(set(cached.winners.values())))  # a hit prepares only the winners
        if not set(cached.winners.values()) <= set(prepared):
            cached = None  # a cached winner no longer prepares: measure again
    if cached is not None:
        table, timings, measured = cached.winners, cached.timings, set(cached.measured)
        how = f"table from the tuning cache {cache.path}"  # type: ignore[union-attr]
    else:
        prepare_all(names)
        runners = _working_runners(prepared, chosen.name, config, runner, left)
        def serves(name: str, tokens: int) -> bool:
            return records[name].spec.serves(tokens, config.weight_format)

        fn = measure_adaptive if options.adaptive else measure
        table, timings, complete = fn(runners, config, sizes, options.budget_s, chosen.name,
                                      serves=serves)
        table = within_limits(table, timings, sizes, {n: records[n] for n in prepared},
                              config.weight_format)
        table, fitted = within_memory(table, timings, sizes, {
            n: records[n].spec.copies(config.weight_format) for n in prepared}, budget, serves)
        measured = set(timings)
        # A table without a candidate that could not be prepared or run now (memory, a
        # transient failure) serves this process's other layers of the shape but is kept
        # out of the file: it would stand for good in every later process. One cut short by
        # the budget is written with that budget: a layer with a larger one measures again.
        lost = sorted(set(names) - set(prepared))
        kept = ""
        if cache is not None and lost:
            cache.remember(key, CachedTable(table, tuple(sorted(timings)), timings))
            kept = f" (kept for this process only: {', '.join(lost)} not measured)"
        elif cache is not None:
            cache.put(key, table, timings, config, None if complete else options.budget_s)
            kept = "" if complete else f" (cached as cut short by the {options.budget_s:g} s budget)"
        how = (f"measured at prepare() in {time.perf_counter() - started:.1f} s, "
               f"{len(measured)} of {len(sizes)} buckets{kept}")
    if any(not records[table[t]].spec.serves(t, config.weight_format) for t in sizes):
        # No prepared candidate serves some bucket (the others failed or were left out):
        # the plan routes past the chosen backend's limit as policy="priority" does.
        return None, None, f"{how}{_not_tuned(left)}; no prepared candidate serves every bucket"
    routes = tuple(prepared[table[t]] for t in sizes)
    tuned = {t: {"winner": table[t], "ms": dict(timings.get(t, {})) if cached is None else {},
                 "source": _source(t, measured, cached is not None, options.adaptive)}
             for t in sizes}
    fitted = f"; {fitted}" if fitted else ""
    return routes, tuned, (f"{how}; candidates {', '.join(n for n in names if n not in left)}"
                           f"{_not_tuned(left)}{fitted}")


def _not_tuned(left: dict[str, str]) -> str:
    return ("; not tuned: " + "; ".join(f"{n}: {why}" for n, why in left.items())) if left else ""


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _source(tokens: int, measured: set[int], from_cache: bool, adaptive: bool) -> str:
    if from_cache:
        return "from the tuning cache" + ("" if tokens in measured else " (not measured)")
    if tokens in measured:
        return "measured"
    # What measure / measure_adaptive give a bucket they did not time.
    return "not measured: nearest measured bucket" if adaptive else \
        "not measured (budget spent): the priority choice"


def _working_runners(prepared: dict[str, Route], chosen: str, config: MoEConfig,
                     runner: Callable[[Route], Runner], left: dict[str, str]) -> dict[str, Runner]:
    """A runner per prepared candidate whose kernel runs at all (one call at T=1): a
    candidate that fails is not timed and never wins a bucket."""
    x, tw, ids = random_inputs(config, 1, pool=1, seed=0)[0]
    for name in [n for n in prepared if n != chosen]:
        r = prepared[name]
        try:
            out = r.apply(r.state, x, tw, ids)
            if not good_output(out, x.shape, x.dtype):
                raise bad_output(out, tuple(x.shape), x.dtype)  # doing nothing is fast: never a winner
        except Exception as exc:
            log.warning("moe-dispatch: %r failed a tuning call (%s: %s); not a candidate",
                        name, type(exc).__name__, exc)
            left[name] = f"failed a tuning call ({type(exc).__name__}: {exc})"
            del prepared[name]
    return {n: runner(prepared[n]) for n in sorted(prepared)}
