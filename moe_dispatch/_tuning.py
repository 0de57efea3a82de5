"""policy="fastest": time the accepting backends on the real layer, per token bucket.

Buckets are powers of two up to a cap; a forward with T tokens uses the winner of the
smallest bucket >= T (the last bucket for larger T). Results persist in a JSON file keyed
by (config, capabilities fingerprint, backend versions). The file is data only: parsed
with ``json``, validated, and ignored with a WARNING when corrupt or stale.
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

log = logging.getLogger("moe_dispatch")

CACHE_VERSION = 1
POLICIES = ("priority", "fastest")
Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bucket_sizes(cap: int) -> list[int]:
    sizes, t = [], 1
    while t < cap:
        sizes.append(t)
        t *= 2
    sizes.append(cap)
    return sizes


def bucket_index(tokens: int, n_buckets: int) -> int:
    """Index of the smallest power-of-two bucket >= tokens, clamped to the last (O(1))."""
    return min((tokens - 1).bit_length(), n_buckets - 1)


def tuning_key(config: MoEConfig, caps: Capabilities, versions: dict[str, str]) -> str:
    parts = [config.describe(), dtype_name(config.dtype), caps.fingerprint(), str(caps.threads),
             json.dumps(sorted(versions.items()))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def user_cache_dir() -> Path:
    """moe-dispatch's directory under the user cache ($XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-dispatch"


def default_cache_path() -> Path:
    env = os.environ.get("MOE_DISPATCH_TUNING_CACHE")
    if env:
        return Path(env)
    return user_cache_dir() / "tuning.json"


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
    from ._bench import random_inputs, time_side_by_side
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
