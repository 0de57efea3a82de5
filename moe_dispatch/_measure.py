"""Timing the candidates of each token bucket: the rules of policy="fastest" and "auto".

- "fastest" measures every bucket with every candidate, within its budget.
- "auto" bounds the first prepare(): it measures a few buckets (1, 8, 64 and the cap for
  a cap of 512), bisects only between two measured buckets whose winners differ, drops a
  candidate from larger buckets once it was ``DROP_FACTOR`` times slower than the best at
  two measured buckets in a row (and times the dropped again where every live candidate
  stops below T), and skips a bucket whose estimated cost would overrun the budget. An
  unmeasured bucket takes the winner of the nearest measured one.
- Both time a near-tie again: the best two of a bucket, when within ``RUNOFF_MARGIN``, run
  a runoff of more rounds (``_time_bucket``).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch

from ._buckets import Timings, pick_winner
from ._config import MoEConfig
from ._random import random_inputs
from ._timing import CacheFlush, time_rounds

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
            ) -> tuple[dict[int, str], Timings, bool]:
    """policy="fastest": every runner at every bucket size, round-robin, medians. Buckets
    left when the budget runs out get ``default`` (the priority choice); the first bucket
    is always measured. Returns the table, the timings, and whether the budget sufficed."""
    start = time.perf_counter()
    flush = CacheFlush()
    table: dict[int, str] = {}
    timings: Timings = {}
    for n, tokens in enumerate(sizes, 1):
        elapsed = time.perf_counter() - start
        if n > 1 and elapsed > budget_s:
            _budget_spent(n - 1, len(sizes), budget_s, f"the priority choice {default!r}")
            for t in sizes[n - 1:]:
                table[t] = default
            return table, timings, False
        if elapsed > 1.0:
            log.info("moe-dispatch: tuning %s: bucket %d/%d (T=%d), %.1f s so far",
                     config.describe(), n, len(sizes), tokens, elapsed)
        names = [n for n in sorted(runners) if serves(n, tokens)]
        if not names:
            table[tokens] = default
            continue
        timings[tokens] = _time_bucket(runners, names, config, tokens, reps, flush)
        table[tokens] = pick_winner(timings[tokens], default)
    return table, timings, True


def measure_adaptive(runners: dict[str, Runner], config: MoEConfig, sizes: list[int],
                     budget_s: float, default: str, serves: Serves = _everywhere
                     ) -> tuple[dict[int, str], Timings, bool]:
    """policy="auto": probe, bisect where winners differ, drop clear losers, within the
    budget (the module docstring has the rules; the first measured bucket is measured
    whatever the budget). Returns the table, the timings, and whether the budget sufficed."""
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
        elif timings and elapsed > budget_s:
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
    return table, {sizes[i]: med for i, med in sorted(timings.items())}, complete


def _nearest(winners: dict[int, str], i: int, default: str) -> str:
    """The winner at bucket index ``i``, else at the nearest measured index (the smaller on
    a tie: its calls are the cheaper ones to get wrong), else ``default``."""
    if not winners:
        return default
    return winners[min(winners, key=lambda j: (abs(j - i), j))]
