"""Routing per token count, measured: policy="auto" (the default) and policy="fastest".

Token counts are bucketed in powers of two up to a cap; a forward with T tokens runs the
winner of the smallest bucket >= T (the last bucket for larger T). The candidates are timed
side by side on the real layer's prepared states, and the table persists in the tuning
cache (``_tuning_cache``), so each (machine, shape, kernel versions) is measured once.

- "fastest" measures every bucket with every candidate, within its budget.
- "auto" bounds the first prepare(): it measures a few buckets (1, 8, 64 and the cap for
  a cap of 512), bisects only between two measured buckets whose winners differ, drops a
  candidate from larger buckets once it was ``DROP_FACTOR`` times slower than the best at
  two measured buckets in a row, and
  skips a bucket whose estimated cost would overrun the budget. An unmeasured bucket takes
  the winner of the nearest measured one.
- Both time a near-tie again: the best two of a bucket, when within ``RUNOFF_MARGIN``, run
  a runoff of more rounds (``_time_bucket``).

:func:`tune` builds the per-bucket routes of an execution plan; it times routes, never a
layer (this module does not import the layer).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch

from ._config import MoEConfig
from ._options import TuningOptions
from ._plan import Route
from ._random import random_inputs
from ._resolution import Resolution, Status
from ._resolver import call_check
from ._spec import BackendRecord, LayerWeights
from ._timing import CacheFlush, time_rounds
from ._buckets import Timings, bucket_sizes, pick_winner, within_limits
from ._tuning_cache import TuningCache, tuning_key

log = logging.getLogger("moe_dispatch")

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# "auto" stops timing a candidate at larger buckets once it was this many times slower than
# the best at two measured buckets in a row (one is not enough: a kernel built for prefill
# may lose badly at T=1 and still win at T=512). In every grid measured (docs/performance.md)
# no backend that far behind twice caught up later; policy="fastest" times everything.
DROP_FACTOR = 2.5

# Three to five rounds rank two kernels within ~15% of each other by noise: with 3 rounds at
# T=512, fp32 E=8 H=4096, "auto" routed to a backend that was 19% slower in the benchmark
# (docs/performance.md, Zen 3). So when the runner-up's median is within RUNOFF_MARGIN of the
# best, the two are timed again alone for RUNOFF_REPS more rounds (at least as many as
# before) and ranked on the medians of all their rounds. Clear wins cost nothing extra.
RUNOFF_MARGIN = 0.15
RUNOFF_REPS = 5


Serves = Callable[[str, int], bool]  # may this candidate be routed calls of T tokens?


def _everywhere(name: str, tokens: int) -> bool:
    return True


def _time_bucket(runners: dict[str, Runner], names: list[str], config: MoEConfig, tokens: int,
                 reps: int, flush: CacheFlush) -> dict[str, float]:
    """Medians of rounds, each call on cold caches (``CacheFlush`` says why; its buffer lives
    only while one layer is tuned), with a runoff between the best two when they are close."""
    inputs = random_inputs(config, tokens, pool=3, seed=tokens)
    samples = time_rounds({n: runners[n] for n in names}, inputs, reps, warmup=1, between=flush)
    med = {n: statistics.median(v) for n, v in samples.items()}
    if len(med) > 1:
        first, second = sorted(med, key=lambda n: (med[n], n))[:2]
        if med[second] <= med[first] * (1 + RUNOFF_MARGIN):
            more = time_rounds({first: runners[first], second: runners[second]}, inputs,
                               max(reps, RUNOFF_REPS), warmup=0, seed=1, between=flush)
            for n in (first, second):
                med[n] = statistics.median(samples[n] + more[n])
    return med


def _budget_spent(measured: int, total: int, budget_s: float, fill: str) -> None:
    log.warning("moe-dispatch: tuning budget of %.1f s spent after %d of %d buckets; the rest "
                "use %s", budget_s, measured, total, fill)


def measure(runners: dict[str, Runner], config: MoEConfig, sizes: list[int], budget_s: float,
            default: str, reps: int = 5, serves: Serves = _everywhere
            ) -> tuple[dict[int, str], Timings]:
    """policy="fastest": every runner at every bucket size, round-robin, medians. Buckets
    left when the budget runs out get ``default`` (the priority choice)."""
    start = time.perf_counter()
    flush = CacheFlush()
    table: dict[int, str] = {}
    timings: Timings = {}
    for n, tokens in enumerate(sizes, 1):
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            _budget_spent(n - 1, len(sizes), budget_s, f"the priority choice {default!r}")
            for t in sizes[n - 1:]:
                table[t] = default
            break
        if elapsed > 1.0:
            log.info("moe-dispatch: tuning %s: bucket %d/%d (T=%d), %.1f s so far",
                     config.describe(), n, len(sizes), tokens, elapsed)
        names = [n for n in sorted(runners) if serves(n, tokens)]
        if not names:
            table[tokens] = default
            continue
        timings[tokens] = _time_bucket(runners, names, config, tokens, reps, flush)
        table[tokens] = pick_winner(timings[tokens], default)
    return table, timings


def measure_adaptive(runners: dict[str, Runner], config: MoEConfig, sizes: list[int],
                     budget_s: float, default: str, serves: Serves = _everywhere
                     ) -> tuple[dict[int, str], Timings]:
    """policy="auto": probe, bisect where winners differ, drop clear losers, within the
    budget (the module docstring has the rules)."""
    start = time.perf_counter()
    flush = CacheFlush()
    n = len(sizes)
    timings: dict[int, dict[str, float]] = {}  # by bucket index while measuring
    alive_after: dict[int, list[str]] = {}
    over_after: dict[int, set[str]] = {}  # candidates DROP_FACTOR slower than the best there

    def measure_at(i: int) -> bool:
        below = [j for j in timings if j < i]
        names = alive_after[max(below)] if below else sorted(runners)
        names = [m for m in names if serves(m, sizes[i])]
        if not names:
            # Every live candidate was dropped or stops below T: the drops were measured
            # against a best that does not serve T, so those that do are timed again.
            names = [m for m in sorted(runners) if serves(m, sizes[i])]
        if not names:
            return True
        elapsed = time.perf_counter() - start
        reps = 5 if sizes[i] <= 64 else 3
        if below:  # linear in T from each one's nearest measured bucket: an overestimate at decode
            est = 0.0
            for m in names:
                seen = [j for j in below if m in timings[j]]
                if seen:
                    est += timings[max(seen)][m] * sizes[i] / sizes[max(seen)]
            est *= (reps + 1) / 1e3
            if elapsed + est > budget_s:
                return False
        elif elapsed > budget_s:
            return False
        if elapsed > 1.0:
            log.info("moe-dispatch: tuning %s: T=%d, %.1f s so far", config.describe(),
                     sizes[i], elapsed)
        med = _time_bucket(runners, names, config, sizes[i], reps, flush)
        timings[i] = med
        best = min(med.values())
        over_after[i] = {m for m in names if med[m] > best * DROP_FACTOR}
        before = over_after[max(below)] if below else set()
        alive_after[i] = [m for m in names if not (m in over_after[i] and m in before)]
        return True

    complete = all(measure_at(i) for i in sorted({*range(0, n, 3), n - 1}))
    winners = {i: pick_winner(med, default) for i, med in timings.items()}
    while complete:  # bisect every gap whose two ends disagree
        idx = sorted(timings)
        gaps = [(a, b) for a, b in zip(idx, idx[1:]) if b - a > 1 and winners[a] != winners[b]]
        if not gaps:
            break
        middle = (gaps[0][0] + gaps[0][1]) // 2
        complete = measure_at(middle)
        if complete:
            winners[middle] = pick_winner(timings[middle], default)
    if not complete:
        _budget_spent(len(timings), n, budget_s, "the nearest measured bucket's winner")
    table = {sizes[i]: _nearest(winners, i, default) for i in range(n)}
    return table, {sizes[i]: med for i, med in sorted(timings.items())}


def _nearest(winners: dict[int, str], i: int, default: str) -> str:
    """The winner at bucket index ``i``, else at the nearest measured index (the smaller on
    a tie: its calls are the cheaper ones to get wrong), else ``default``."""
    if not winners:
        return default
    return winners[min(winners, key=lambda j: (abs(j - i), j))]


Build = Callable[[BackendRecord], Any]


def _candidates(final: Resolution, chosen: Route, weights: LayerWeights,
                max_candidates: int | None) -> dict[str, BackendRecord]:
    """The resolver's choice, then every other backend that accepts the layer, in priority
    order, up to ``max_candidates``. Nothing is prepared here."""
    caps = final.capabilities
    records: dict[str, BackendRecord] = {chosen.name: chosen.record}
    for cand in final.candidates:
        if max_candidates is not None and len(records) >= max_candidates:
            break
        if cand.name in records or cand.status not in (Status.STANDBY, Status.CHOSEN):
            continue
        other = final.record(cand.name)
        if other is not None and call_check(other, "supports_layer", weights, caps).accepted:
            records[other.name] = other
    return records


def tune(config: MoEConfig, final: Resolution, chosen: Route, weights: LayerWeights,
         build: Build, options: TuningOptions, runner: Callable[[Route], Runner]
         ) -> tuple[tuple[Route, ...], dict[int, dict[str, Any]], str]:
    """The route of every bucket, from the tuning cache or measured now; bucket ->
    {"winner": name, "ms": {name: ms}, "source": how it was decided}; and a one-line
    summary (cost, candidates). ``runner(route)``: what a forward runs on that route (its
    native entry, or its ``apply``). Only the winners' prepared states are kept (memory)."""
    started = time.perf_counter()
    records = _candidates(final, chosen, weights, options.max_candidates)
    sizes = bucket_sizes(options.max_tokens)
    names = sorted(records)
    if len(names) == 1:
        rows = {t: {"winner": chosen.name, "ms": {}, "source": "the only candidate"} for t in sizes}
        return (chosen,) * len(sizes), rows, f"one candidate ({chosen.name}): nothing to measure"
    cache = None if options.cache is False else TuningCache(
        None if options.cache in (None, True) else options.cache)  # type: ignore[arg-type]
    key = tuning_key(config, final.capabilities, {n: records[n].spec.version for n in names})
    cached = cache.get(key, names, sizes) if cache is not None else None
    if cached is not None and not options.adaptive and list(cached.measured) != sizes:
        cached = None  # "fastest" wants every bucket measured, not a probed table
    prepared: dict[str, Route] = {chosen.name: chosen}

    need = 2 * sum(t.numel() * t.element_size() for _, t in weights.tensors())
    skipped: list[str] = []

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
                    skipped.append(name)
                    continue
                try:
                    prepared[name] = Route(records[name], build(records[name]))
                except Exception as exc:  # a candidate that cannot prepare is not used
                    log.warning("moe-dispatch: %r could not be prepared for tuning (%s)", name, exc)

    if cached is not None:
        prepare_all(sorted(set(cached.winners.values())))  # a hit prepares only the winners
        if not set(cached.winners.values()) <= set(prepared):
            cached = None  # a cached winner no longer prepares: measure again
    if cached is not None:
        table, timings, measured = cached.winners, cached.timings, set(cached.measured)
        how = f"table from the tuning cache {cache.path}"  # type: ignore[union-attr]
    else:
        prepare_all(names)
        runners = _working_runners(prepared, chosen.name, config, runner)
        def serves(name: str, tokens: int) -> bool:
            return records[name].spec.serves(tokens, config.weight_format)

        fn = measure_adaptive if options.adaptive else measure
        table, timings = fn(runners, config, sizes, options.budget_s, chosen.name, serves=serves)
        table = within_limits(table, timings, sizes, {n: records[n] for n in prepared},
                              config.weight_format)
        measured = set(timings)
        if cache is not None:
            cache.put(key, table, timings, config)
        how = (f"measured at prepare() in {time.perf_counter() - started:.1f} s, "
               f"{len(measured)} of {len(sizes)} buckets")
    routes = tuple(prepared[table[t]] for t in sizes)
    tuned = {t: {"winner": table[t], "ms": dict(timings.get(t, {})) if cached is None else {},
                 "source": _source(t, measured, cached is not None, options.adaptive)}
             for t in sizes}
    left = f" ({', '.join(skipped)} not prepared: memory)" if skipped else ""
    return routes, tuned, f"{how}; candidates {', '.join(n for n in names if n not in skipped)}{left}"


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
                     runner: Callable[[Route], Runner]) -> dict[str, Runner]:
    """A runner per prepared candidate whose kernel runs at all (one call at T=1): a
    candidate that fails is not timed and never wins a bucket."""
    x, tw, ids = random_inputs(config, 1, pool=1, seed=0)[0]
    for name in [n for n in prepared if n != chosen]:
        r = prepared[name]
        try:
            r.apply(r.state, x, tw, ids)
        except Exception as exc:
            log.warning("moe-dispatch: %r failed a tuning call (%s: %s); not a candidate",
                        name, type(exc).__name__, exc)
            del prepared[name]
    return {n: runner(prepared[n]) for n in sorted(prepared)}
