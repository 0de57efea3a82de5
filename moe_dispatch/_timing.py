"""Side-by-side timing (shuffled rounds, medians, paired ratios): used by tuning, the CLI's
bench and ``benchmarks/``. It never imports the layer: anything callable is timed."""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

import torch


Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def time_rounds(fns: dict[str, Runner], inputs: list, reps: int, warmup: int = 2,
                seed: int = 0, between: Callable[[], object] | None = None
                ) -> dict[str, list[float]]:
    """ms per call of each candidate, one sample per round.

    Every round calls each candidate once on the same input, in a fresh random order, so
    the machine's drift hits every candidate alike and no candidate always runs right after
    the same neighbour. Sample ``r`` of two candidates come from the same round: their
    ratio is a paired comparison. ``between`` runs, untimed, before every timed call.
    """
    order = list(fns)
    rng = random.Random(seed)
    for fn in fns.values():
        for i in range(warmup):
            fn(*inputs[i % len(inputs)])
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for rep in range(reps):
        args = inputs[rep % len(inputs)]
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            if between is not None:
                between()
            t0 = time.perf_counter()
            fn(*args)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def time_side_by_side(fns: dict[str, Runner], inputs: list, reps: int, warmup: int = 2,
                      between: Callable[[], object] | None = None) -> dict[str, float]:
    """Median ms per call of each candidate (see :func:`time_rounds`)."""
    samples = time_rounds(fns, inputs, reps, warmup, between=between)
    return {n: statistics.median(v) for n, v in samples.items()}


class CacheFlush:
    """Reads a buffer larger than the last-level cache, so that the next call finds none of
    its weights cached. Why: in a model, every other layer's weights stream through the caches
    between two calls of one layer, so a kernel is timed cold. Timed warm, a small layer whose
    active experts fit in the cache (E=8 top-2 H=1024 I=1408 bf16 at T=1: 17 MB, in a 32 MB L3)
    ranks kernels by how well they reuse a warm cache, which no model run sees (measured:
    the tuned winner then lost by 9% in the cold benchmark)."""

    def __init__(self, mib: int = 128) -> None:
        self._buffer: torch.Tensor | None = None
        self._mib = mib

    def __call__(self) -> None:
        if self._buffer is None:
            self._buffer = torch.ones(self._mib * 1024 * 1024 // 4)
        self._buffer.sum()


def time_pairs(rows: list[tuple[Runner, Runner]], inputs: list, pairs: int
               ) -> list[tuple[list[float], list[float]]]:
    """Back-to-back calls of each (candidate, baseline) row: ``pairs`` pairs per row, the
    order inside a pair alternating (the second call of a pair runs in another cache state),
    rows interleaved (the machine's drift hits every row alike). Returns, per row, the
    candidate's and the baseline's seconds, pair by pair."""
    for fn, base in rows:
        fn(*inputs[0]), base(*inputs[0])
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in rows]
    for i in range(pairs * len(rows)):
        j = i % len(rows)
        fn, base = rows[j]
        args = inputs[i % len(inputs)]
        base_first = (i // len(rows)) % 2 == 0
        first, second = (base, fn) if base_first else (fn, base)
        t0 = time.perf_counter()
        first(*args)
        t1 = time.perf_counter()
        second(*args)
        t2 = time.perf_counter()
        t_base, t_fn = (t1 - t0, t2 - t1) if base_first else (t2 - t1, t1 - t0)
        out[j][0].append(t_fn)
        out[j][1].append(t_base)
    return out


def balanced(t_fn: list[float], t_base: list[float]) -> tuple[list[float], list[float]]:
    """Order-balanced ratios and differences of :func:`time_pairs`'s pairs: each from two
    consecutive pairs, one run in each order (the geometric mean of their two ratios, the
    mean of their two differences). Why: where the second call of a pair runs measurably
    faster than the first (the first call warms the last-level cache for it), a pair's ratio
    is high or low by its order, and the median of such a two-humped list lands anywhere
    between the humps: on a Zen 5 (family 26, model 2) a raw kernel set against itself gave
    1.00-1.16 at E=8 top-2 H=1024 I=1408 bf16 T=1 that way."""
    ratios, diffs = [], []
    for k in range(0, len(t_fn) - 1, 2):
        a0, b0, a1, b1 = t_fn[k], t_base[k], t_fn[k + 1], t_base[k + 1]
        ratios.append(((a0 / b0) * (a1 / b1)) ** 0.5)
        diffs.append((a0 - b0 + a1 - b1) / 2)
    return ratios, diffs


def paired_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[baseline]))
