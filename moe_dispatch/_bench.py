"""Prepared layers timed side by side: the CLI's ``bench`` and ``benchmarks/`` use it."""

from __future__ import annotations

import sys
import time
from typing import Iterable, TextIO

from ._config import MoEConfig
from ._errors import MoEDispatchError
from ._layer import MoELayer
from ._random import random_inputs, random_weights
from ._resolution import Status
from ._resolver import resolve
from ._spec import normalize_name
from ._timing import time_side_by_side


def prepared_layers(config: MoEConfig, weights: dict, backends: Iterable[str] | None = None,
                    log: TextIO | None = None, exclude: Iterable[str] = ()) -> dict[str, MoELayer]:
    """One prepared layer per named backend, or per accepting backend that is not excluded
    (excluded ones are never prepared nor timed)."""
    res = resolve(config, exclude=exclude)
    names = [normalize_name(n) for n in backends] if backends is not None else [
        c.name for c in res.candidates if c.status in (Status.CHOSEN, Status.STANDBY)]
    layers = {}
    for name in names:
        try:
            layers[name] = MoELayer(config, backend=name).load_weights(**weights).prepare()
        except MoEDispatchError as exc:
            if log is not None:
                print(f"  {name}: skipped ({exc})", file=log)
    return layers


def bench_grid(config: MoEConfig, tokens: list[int], reps: int = 10,
               backends: Iterable[str] | None = None, progress: TextIO | None = sys.stderr,
               exclude: Iterable[str] = ()) -> list[dict]:
    """Time each backend at each token count. Rows: tokens, backend, median_ms, ratio (to the
    fastest at that T), chosen (the config-stage choice with the same ``backend``/``exclude``:
    what policy="priority" runs at every T; the default policy="auto" routes each T to the
    backend it measures fastest, which may be another)."""
    backends = None if backends is None else [normalize_name(n) for n in backends]
    forced = backends[0] if backends is not None and len(backends) == 1 else None
    chosen = resolve(config, backend=forced, exclude=exclude).backend
    t0 = time.perf_counter()
    layers = prepared_layers(config, random_weights(config), backends, progress, exclude)
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
