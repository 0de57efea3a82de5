"""policy="fastest": time the accepting backends on the real layer, per token bucket.

Buckets are powers of two up to a cap; a forward with T tokens uses the winner of the
smallest bucket >= T (the last bucket for larger T). Results persist in a JSON file keyed
by (config, capabilities fingerprint, backend versions). The file is data only: parsed
with ``json``, validated, and ignored with a WARNING when corrupt or stale.

:func:`tune` builds the per-bucket routes of an execution plan; it times routes, never a
layer (this module does not import the layer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ._capabilities import Capabilities
from ._config import MoEConfig, dtype_name
from ._options import TuningOptions
from ._plan import Route
from ._random import random_inputs
from ._resolution import Resolution, Status
from ._resolver import call_check
from ._spec import BackendRecord, LayerWeights
from ._timing import time_side_by_side
from .kernels import cache_dir

log = logging.getLogger("moe_dispatch")

CACHE_VERSION = 1
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bucket_sizes(cap: int) -> list[int]:
    sizes, t = [], 1
    while t < cap:
        sizes.append(t)
        t *= 2
    sizes.append(cap)
    return sizes


def tuning_key(config: MoEConfig, caps: Capabilities, versions: dict[str, str]) -> str:
    parts = [config.describe(), dtype_name(config.dtype), caps.fingerprint(), str(caps.threads),
             json.dumps(sorted(versions.items()))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def default_cache_path() -> Path:
    env = os.environ.get("MOE_DISPATCH_TUNING_CACHE")
    if env:
        return Path(env)
    return cache_dir() / "tuning.json"


class TuningCache:
    """A JSON file of tuned tables. Corrupt or mismatched content is ignored with a WARNING."""

    _lock = threading.Lock()

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("moe-dispatch: tuning cache %s unreadable (%s); ignored", self.path, exc)
            return {}
        try:
            data = json.loads(text)
        except ValueError as exc:
            log.warning("moe-dispatch: tuning cache %s is not valid JSON (%s); ignored", self.path, exc)
            return {}
        if (not isinstance(data, dict) or data.get("version") != CACHE_VERSION
                or not isinstance(data.get("entries"), dict)):
            log.warning("moe-dispatch: tuning cache %s has an unknown format; ignored", self.path)
            return {}
        return data["entries"]

    def get(self, key: str, candidates: list[str], sizes: list[int]) -> dict[int, str] | None:
        entry = self._read().get(key)
        if entry is None:
            return None
        table = _validate_entry(entry, candidates, sizes)
        if table is None:
            log.warning("moe-dispatch: tuning cache entry %s in %s is stale or malformed "
                        "(backends or buckets changed); re-tuning", key, self.path)
        return table

    def put(self, key: str, table: dict[int, str], timings: dict[int, dict[str, float]],
            config: MoEConfig) -> None:
        with self._lock:
            entries = self._read()
            entries[key] = {"config": config.describe(),
                            "buckets": {str(t): name for t, name in table.items()},
                            "timings_ms": {str(t): v for t, v in timings.items()},
                            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-")
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump({"version": CACHE_VERSION, "entries": entries}, fh, indent=1)
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("moe-dispatch: cannot write tuning cache %s (%s)", self.path, exc)


def _validate_entry(entry: Any, candidates: list[str], sizes: list[int]) -> dict[int, str] | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("buckets"), dict):
        return None
    table: dict[int, str] = {}
    for k, v in entry["buckets"].items():
        if not (isinstance(k, str) and k.isdigit() and isinstance(v, str) and v in candidates):
            return None
        table[int(k)] = v
    return table if sorted(table) == sizes else None


def measure(runners: dict[str, Runner], config: MoEConfig, sizes: list[int], budget_s: float,
            default: str, reps: int = 5) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """Time every runner at every bucket size, round-robin, medians. Buckets left when the
    budget runs out get ``default`` (the priority choice)."""
    start = time.perf_counter()
    table: dict[int, str] = {}
    timings: dict[int, dict[str, float]] = {}
    for n, tokens in enumerate(sizes, 1):
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            log.warning("moe-dispatch: tuning budget of %.0f s spent after %d of %d buckets; the "
                        "rest use the priority choice %r", budget_s, n - 1, len(sizes), default)
            for t in sizes[n - 1:]:
                table[t] = default
            break
        if elapsed > 1.0:
            log.info("moe-dispatch: tuning %s: bucket %d/%d (T=%d), %.1f s so far",
                     config.describe(), n, len(sizes), tokens, elapsed)
        med = time_side_by_side(runners, random_inputs(config, tokens, pool=3, seed=tokens),
                                reps, warmup=1)
        timings[tokens] = med
        table[tokens] = pick_winner(med, default)
    return table, timings


# A backend replaces the priority choice only when it is faster by more than this: timings
# on a shared machine move by a few percent from run to run (measured: the same kernel in
# two layers differs by up to ~5-8%), and a near-tie is not worth a second prepared state.
SWITCH_MARGIN = 0.02


def pick_winner(medians: dict[str, float], default: str, margin: float = SWITCH_MARGIN) -> str:
    """The fastest candidate, unless ``default`` is within ``margin`` of it (ties by name)."""
    best = min(medians, key=lambda name: (medians[name], name))
    if default in medians and medians[default] <= medians[best] * (1 + margin):
        return default
    return best


Build = Callable[[BackendRecord], Any]


def tune(config: MoEConfig, final: Resolution, chosen: Route, weights: LayerWeights,
         build: Build, options: TuningOptions
         ) -> tuple[tuple[Route, ...], dict[int, dict[str, Any]]]:
    """The route of every bucket, from the tuning cache or measured now, and bucket ->
    {"winner": name, name: ms...}. Only the winners' prepared states are kept (memory)."""
    caps = final.capabilities
    # The candidates: the resolver's choice, then every other backend that accepts the
    # layer, up to max_candidates. Nothing else is prepared before the cache is read.
    records: dict[str, BackendRecord] = {chosen.name: chosen.record}
    for cand in final.candidates:
        if options.max_candidates is not None and len(records) >= options.max_candidates:
            break
        if cand.name in records or cand.status not in (Status.STANDBY, Status.CHOSEN):
            continue
        other = final.record(cand.name)
        if other is not None and call_check(other, "supports_layer", weights, caps).accepted:
            records[other.name] = other
    sizes = bucket_sizes(options.max_tokens)
    names = sorted(records)
    cache = None if options.cache is False else TuningCache(
        None if options.cache in (None, True) else options.cache)  # type: ignore[arg-type]
    key = tuning_key(config, caps, {n: records[n].spec.version for n in names})
    table = cache.get(key, names, sizes) if cache is not None else None
    prepared: dict[str, Route] = {chosen.name: chosen}

    def prepare_all(wanted: list[str]) -> None:
        for name in wanted:
            if name not in prepared:
                try:
                    prepared[name] = Route(records[name], build(records[name]))
                except Exception as exc:  # a candidate that cannot prepare is not used
                    log.warning("moe-dispatch: %r could not be prepared for tuning (%s)", name, exc)

    timings: dict[int, dict[str, float]] = {}
    if table is not None:
        prepare_all(sorted(set(table.values())))  # a cache hit prepares only the winners
        if not set(table.values()) <= set(prepared):
            table = None  # a cached winner no longer prepares: measure again
    if table is None:
        prepare_all(names)
        x, tw, ids = random_inputs(config, 1, pool=1, seed=0)[0]
        for name in [n for n in prepared if n != chosen.name]:
            r = prepared[name]
            try:  # a candidate whose kernel fails is not timed (and never wins a bucket)
                r.apply(r.state, x, tw, ids)
            except Exception as exc:
                log.warning("moe-dispatch: %r failed a tuning call (%s: %s); not a candidate",
                            name, type(exc).__name__, exc)
                del prepared[name]
        runners = {n: (lambda x, tw, ids, _r=prepared[n]: _r.apply(_r.state, x, tw, ids))
                   for n in sorted(prepared)}
        table, timings = measure(runners, config, sizes, options.budget_s, chosen.name)
        if cache is not None:
            cache.put(key, table, timings, config)
    routes = tuple(prepared[table[t]] for t in sizes)
    tuned = {t: {"winner": table[t], **timings.get(t, {})} for t in sizes}
    return routes, tuned
