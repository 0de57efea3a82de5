"""Side-by-side timing of backends on one layer (used by the CLI and benchmarks/)."""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Callable, Iterable, TextIO

import torch

from ._config import MoEConfig
from ._errors import MoEDispatchError
from ._layer import MoELayer
from ._resolver import resolve
from .routing import select_experts

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def random_weights(config: MoEConfig, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Random weights scaled so activations stay O(1) (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    out: dict[str, torch.Tensor | None] = {
        "w13": (torch.randn(*config.w13_shape, generator=g) * (2 / h ** 0.5)).to(config.dtype),
        "w2": (torch.randn(*config.w2_shape, generator=g) / i ** 0.5).to(config.dtype),
        "w13_bias": None, "w2_bias": None}
    if config.has_bias:
        out["w13_bias"] = (torch.randn(*config.w13_bias_shape, generator=g) * 0.1).to(config.dtype)
        out["w2_bias"] = (torch.randn(*config.w2_bias_shape, generator=g) * 0.1).to(config.dtype)
    return out


def random_inputs(config: MoEConfig, tokens: int, pool: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pool):
        x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
        tw, ids = select_experts(torch.randn(tokens, config.num_experts, generator=g), config.top_k)
        out.append((x, tw, ids))
    return out


def prepared_layers(config: MoEConfig, weights: dict, backends: Iterable[str] | None = None,
                    log: TextIO | None = None) -> dict[str, MoELayer]:
    """One prepared layer per accepting backend (or per named backend)."""
    res = resolve(config)
    names = list(backends) if backends is not None else [
        c.name for c in res.candidates if c.decision.accepted]
    layers = {}
    for name in names:
        try:
            layers[name] = MoELayer(config, backend=name).load_weights(**weights).prepare()
        except MoEDispatchError as exc:
            if log is not None:
                print(f"  {name}: skipped ({exc})", file=log)
    return layers


def time_rounds(fns: dict[str, Runner], inputs: list, reps: int, warmup: int = 2,
                seed: int = 0) -> dict[str, list[float]]:
    """ms per call of each candidate, one sample per round.

    Every round calls each candidate once on the same input, in a fresh random order, so
    the machine's drift hits every candidate alike and no candidate always runs right after
    the same neighbour. Sample ``r`` of two candidates come from the same round: their
    ratio is a paired comparison.
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
            t0 = time.perf_counter()
            fn(*args)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return samples


def time_side_by_side(fns: dict[str, Runner], inputs: list, reps: int, warmup: int = 2
                      ) -> dict[str, float]:
    """Median ms per call of each candidate (see :func:`time_rounds`)."""
    return {n: statistics.median(v) for n, v in time_rounds(fns, inputs, reps, warmup).items()}


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


def paired_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """Median over rounds of ``name``'s time over ``baseline``'s in the same round."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[baseline]))


def bench_grid(config: MoEConfig, tokens: list[int], reps: int = 10,
               backends: Iterable[str] | None = None, progress: TextIO | None = sys.stderr
               ) -> list[dict]:
    """Time every accepting backend at each token count. Rows: tokens, backend, median_ms,
    ratio (to the fastest at that T), chosen (the resolver's pick)."""
    chosen = resolve(config).backend
    t0 = time.perf_counter()
    layers = prepared_layers(config, random_weights(config), backends, progress)
    rows = []
    for n, t in enumerate(tokens, 1):
        if progress is not None and time.perf_counter() - t0 > 1.0:
            print(f"  [{n}/{len(tokens)}] T={t} ...", file=progress, flush=True)
        med = time_side_by_side(dict(layers), random_inputs(config, t),
                                reps if t <= 128 else max(3, reps // 2))
        best = min(med.values())
        for name, ms in med.items():
            rows.append(dict(tokens=t, backend=name, median_ms=ms, ratio=ms / best,
                             chosen=name == chosen))
    return rows
