"""The tuning cache: tuned routing tables persisted in a JSON file.

Keyed by (config, capabilities fingerprint, CPU model, the thread count the table is measured
with, candidates' versions and the values of the environment variables they read, this
library's version), so a table is reused only on the machine, shape and kernels it was
measured for. The file is data only: parsed with ``json``, validated, and ignored with a
WARNING when corrupt or stale. Writers in several processes take an advisory lock on a file
beside it, so that one's entry is never lost to another's read-merge-write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import attrs
import torch

try:  # POSIX; elsewhere writers in one process are still serialised by the thread lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from ._capabilities import Capabilities
from ._config import MoEConfig, dtype_name
from .kernels import cache_dir

log = logging.getLogger("moe_dispatch")

# Raised whenever the tuner measures differently (2: the runoff of near-ties), so that a
# table an older tuner measured is measured again, not trusted.
CACHE_VERSION = 2


@attrs.frozen(slots=True)
class CachedTable:
    """A table read back: the winner per bucket and which buckets were measured (the others
    took the nearest measured bucket's winner, or the priority choice)."""

    winners: dict[int, str]
    measured: tuple[int, ...]
    timings: dict[int, dict[str, float]]
    # The budget that ran out while it was measured (None: the tuning finished): a layer
    # with a larger budget measures again instead of taking a table cut shorter than its own.
    partial_budget_s: float | None = None


def tuning_key(config: MoEConfig, caps: Capabilities, versions: dict[str, str],
               max_weight_copies: float = math.inf,
               env: dict[str, str | None] | None = None) -> str:
    """The entry's key. The thread count is torch's now (what the table is measured with),
    not ``caps.threads``, which ``Capabilities.detect()`` read once per process; ``env``: the
    candidates' environment variables (``BackendSpec.env_vars``) and their values, which
    may pick another build of a kernel (its ISA, say) under the same version."""
    from . import __version__  # built-in backends' versions are torch's: this names their code
    parts = [config.describe(), dtype_name(config.dtype), caps.fingerprint(), caps.cpu_model,
             str(torch.get_num_threads()), json.dumps(sorted(versions.items())),
             json.dumps(sorted((env or {}).items())), f"moe-dispatch {__version__}"]
    if math.isfinite(max_weight_copies):  # a table fitted to a memory limit is its own
        parts.append(f"max_weight_copies={max_weight_copies:g}")
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
        except (OSError, ValueError) as exc:  # ValueError: bytes that are not UTF-8
            log.warning("moe-dispatch: tuning cache %s unreadable (%s); ignored", self.path, exc)
            return {}
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            log.warning("moe-dispatch: tuning cache %s is not valid JSON (%s: %s); ignored",
                        self.path, type(exc).__name__, exc)
            return {}
        if (not isinstance(data, dict) or data.get("version") != CACHE_VERSION
                or not isinstance(data.get("entries"), dict)):
            log.warning("moe-dispatch: tuning cache %s has an unknown format; ignored", self.path)
            return {}
        return data["entries"]

    # Tables this process measured but kept out of the file (a candidate missing for a
    # reason of the moment), by (file, key): they still serve the other layers of the same
    # shape, so that a model tunes once per process, not once per layer.
    _session: dict[tuple[str, str], CachedTable] = {}

    def remember(self, key: str, table: CachedTable) -> None:
        with self._lock:
            self._session[(str(self.path), key)] = table

    def get(self, key: str, candidates: list[str], sizes: list[int]) -> CachedTable | None:
        known = self._session.get((str(self.path), key))
        if known is not None and sorted(known.winners) == sizes and \
                set(known.winners.values()) <= set(candidates):
            return known
        entry = self._read().get(key)
        if entry is None:
            return None
        table = _validate_entry(entry, candidates, sizes)
        if table is None:
            log.warning("moe-dispatch: tuning cache entry %s in %s is stale or malformed "
                        "(backends or buckets changed); re-tuning", key, self.path)
        return table

    def put(self, key: str, table: dict[int, str], timings: dict[int, dict[str, float]],
            config: MoEConfig, partial_budget_s: float | None = None) -> None:
        """Store ``table``; the buckets with ``timings`` are the measured ones;
        ``partial_budget_s``: the budget that ran out while measuring it, if one did."""
        entry: dict[str, Any] = {"config": config.describe(),
                                 "buckets": {str(t): name for t, name in table.items()},
                                 "measured": sorted(timings),
                                 "timings_ms": {str(t): v for t, v in timings.items()},
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if partial_budget_s is not None:
            entry["partial_budget_s"] = partial_budget_s
        with self._lock:  # the file is the source of truth from now on
            self._session.pop((str(self.path), key), None)
        tmp = None
        try:
            with self._lock, self._locked():
                entries = self._read()
                entries[key] = entry
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-")
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump({"version": CACHE_VERSION, "entries": entries}, fh, indent=1)
                os.replace(tmp, self.path)
                tmp = None
        except OSError as exc:
            log.warning("moe-dispatch: cannot write tuning cache %s (%s)", self.path, exc)
        finally:
            if tmp is not None:  # the replace failed (the path is a directory, say)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive advisory lock on ``<path>.lock`` (POSIX), held across the read, the
        merge and the replace: another process's entry written meanwhile is kept."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _validate_entry(entry: Any, candidates: list[str], sizes: list[int]) -> CachedTable | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("buckets"), dict):
        return None
    table: dict[int, str] = {}
    for k, v in entry["buckets"].items():
        if not (_bucket_key(k) and isinstance(v, str) and v in candidates):
            return None
        table[int(k)] = v
    if sorted(table) != sizes:
        return None
    # Entries without the list were written by an exhaustive tuning: every bucket measured.
    measured = entry.get("measured", sizes)
    if not (isinstance(measured, list) and all(isinstance(t, int) and t in table for t in measured)):
        return None
    timings: dict[int, dict[str, float]] = {}
    raw = entry.get("timings_ms")
    if isinstance(raw, dict):
        for k, row in raw.items():
            if _bucket_key(k) and isinstance(row, dict) and all(
                    isinstance(n, str) and isinstance(ms, (int, float)) for n, ms in row.items()):
                timings[int(k)] = {n: float(ms) for n, ms in row.items()}
    partial = entry.get("partial_budget_s")
    if partial is not None and (isinstance(partial, bool) or not isinstance(partial, (int, float))):
        return None
    return CachedTable(table, tuple(sorted(measured)), timings,
                       None if partial is None else float(partial))


def _bucket_key(k: Any) -> bool:
    # str.isdigit() also accepts digits int() rejects ("\u00b9"); ASCII digits only.
    return isinstance(k, str) and k.isascii() and k.isdigit()
