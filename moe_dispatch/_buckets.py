"""Token buckets: their sizes, a bucket's winner, and the limits backends declare.

A forward with T tokens runs the route of the smallest power-of-two bucket >= T (the last
bucket for larger T); these helpers decide what each bucket's route is from timings.
"""

from __future__ import annotations

from typing import Callable

from ._spec import BackendRecord

Timings = dict[int, dict[str, float]]  # bucket size -> candidate -> median ms

# A backend replaces the priority choice only when it is faster by more than this: timings
# on a shared machine move by a few percent from run to run (measured: the same kernel in
# two layers differs by up to ~5-8%), and a near-tie is not worth a second prepared state.
SWITCH_MARGIN = 0.02


def bucket_sizes(cap: int) -> list[int]:
    sizes, t = [], 1
    while t < cap:
        sizes.append(t)
        t *= 2
    sizes.append(cap)
    return sizes


def pick_winner(medians: dict[str, float], default: str, margin: float = SWITCH_MARGIN) -> str:
    """The fastest candidate, unless ``default`` is within ``margin`` of it (ties by name)."""
    best = min(medians, key=lambda name: (medians[name], name))
    if default in medians and medians[default] <= medians[best] * (1 + margin):
        return default
    return best


def fastest_near(timings: Timings, sizes: list[int], tokens: int,
                 allowed: Callable[[str], bool]) -> str | None:
    """The fastest allowed candidate at the measured bucket nearest to ``tokens`` that timed
    one (ties by name; the smaller bucket first at equal distance), or None."""
    where = {t: i for i, t in enumerate(sizes)}
    for m in sorted(timings, key=lambda m: (abs(where[m] - where[tokens]), m)):
        ok = {n: ms for n, ms in timings[m].items() if allowed(n)}
        if ok:
            return min(ok, key=lambda n: (ok[n], n))
    return None


def within_limits(table: dict[int, str], timings: Timings, sizes: list[int],
                   records: dict[str, BackendRecord], weight_format: str = "float"
                   ) -> dict[int, str]:
    """The table with every bucket routed to a candidate that serves it
    (``BackendSpec.max_tokens``): a bucket whose winner does not serve it takes the fastest
    candidate that does at the nearest measured bucket, else the first unlimited one in
    priority order."""
    def serves(n: str, t: int) -> bool:
        return n in records and records[n].spec.serves(t, weight_format)

    out = dict(table)
    for t in sizes:
        if not serves(out[t], t):
            out[t] = fastest_near(timings, sizes, t, lambda n: serves(n, t)) or next(
                (n for n in records if serves(n, t)), out[t])
    return out
