"""The benchmarks' paired timing (moe_dispatch._timing): time_pairs' order and balanced."""

from __future__ import annotations

import statistics

import pytest

from moe_dispatch import _timing


class Clock:
    """perf_counter for time_pairs: each call of a runner advances it by the runner's cost,
    more when it runs first in its pair (a cold cache that the second call then finds warm)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.first = True

    def perf_counter(self) -> float:
        return self.now

    def runner(self, cost: float, cold_extra: float):
        def run(*_args) -> None:
            self.now += cost + (cold_extra if self.first else 0.0)
            self.first = not self.first
        return run


@pytest.mark.parametrize("pairs", [2, 10, 1000])
def test_balanced_cancels_the_order_inside_a_pair(monkeypatch, pairs):
    clock = Clock()
    monkeypatch.setattr(_timing, "time", clock)
    fn, base = clock.runner(1.2e-3, 0.5e-3), clock.runner(1.0e-3, 0.5e-3)
    [(t_fn, t_base)] = _timing.time_pairs([(fn, base)], [()], pairs)
    # The pairs alternate their order, so half of the raw ratios are cold / warm, half warm / cold.
    raw = sorted(a / b for a, b in zip(t_fn, t_base))
    assert raw[0] == pytest.approx(1.2 / 1.5) and raw[-1] == pytest.approx(1.7 / 1.0)
    ratios, diffs = _timing.balanced(t_fn, t_base)
    assert len(ratios) == len(diffs) == pairs // 2
    # Each balanced ratio is the geometric mean of (1.7 / 1.0) and (1.2 / 1.5); the difference
    # is the true one, whatever the order cost.
    assert statistics.median(ratios) == pytest.approx(((1.7 / 1.0) * (1.2 / 1.5)) ** 0.5)
    assert statistics.median(diffs) == pytest.approx(0.2e-3)


def test_balanced_of_a_runner_against_itself_is_one(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(_timing, "time", clock)
    run = clock.runner(1.0e-3, 0.3e-3)
    [(t_fn, t_base)] = _timing.time_pairs([(run, run)], [()], 100)
    ratios, diffs = _timing.balanced(t_fn, t_base)
    assert all(r == pytest.approx(1.0) for r in ratios)
    assert all(d == pytest.approx(0.0, abs=1e-12) for d in diffs)
    # The plain median of the two-humped list is not one: it is the mean of the two humps.
    assert statistics.median(a / b for a, b in zip(t_fn, t_base)) == pytest.approx((1.0 / 1.3 + 1.3 / 1.0) / 2)


def test_balanced_with_several_rows_and_an_odd_count(monkeypatch):
    # Rows interleaved: each row's pairs still alternate their order, so every row's balanced
    # ratios are its own; an odd last pair (no partner in the other order) is left out.
    clock = Clock()
    monkeypatch.setattr(_timing, "time", clock)
    rows = [(clock.runner(2.0e-3, 0.4e-3), clock.runner(1.0e-3, 0.4e-3)),
            (clock.runner(1.0e-3, 0.2e-3), clock.runner(1.0e-3, 0.2e-3))]
    timed = _timing.time_pairs(rows, [()], 7)
    (r0, d0), (r1, d1) = (_timing.balanced(*t) for t in timed)
    assert len(r0) == len(r1) == 3
    assert all(r == pytest.approx(((2.4 / 1.0) * (2.0 / 1.4)) ** 0.5) for r in r0)
    assert all(d == pytest.approx(1.0e-3) for d in d0)
    assert all(r == pytest.approx(1.0) for r in r1)
