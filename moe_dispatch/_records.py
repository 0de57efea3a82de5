"""The registry's records: failures, immutable snapshots, and the one duplicate-name rule."""

from __future__ import annotations

import os
from typing import Iterable

import attrs

from ._errors import UnknownBackendError
from ._spec import BackendRecord, normalize_name


def env_names(var: str) -> frozenset[str]:
    """A comma-separated list of names from the environment, normalised."""
    raw = os.environ.get(var, "")
    return frozenset(normalize_name(n) for n in raw.split(",") if n.strip())


@attrs.frozen(slots=True)
class PluginFailure:
    """A plugin that could not be used, and why (shown by explain and doctor)."""

    plugin: str
    source: str
    error: str


@attrs.frozen(slots=True)
class RegistrySnapshot:
    """An immutable view of the registry at one generation."""

    generation: int
    records: tuple[BackendRecord, ...]  # sorted by BackendRecord.sort_key
    failures: tuple[PluginFailure, ...]

    def by_name(self, name: str) -> BackendRecord:
        key = normalize_name(name)
        for rec in self.records:
            if rec.name == key:
                return rec
        raise UnknownBackendError(
            f"unknown backend {name!r}: registered backends are "
            f"{', '.join(r.name for r in self.records) or '(none)'}")

    def names(self) -> list[str]:
        return [r.name for r in self.records]


def origin(rec: BackendRecord) -> str:
    return rec.source if rec.plugin == "?" else f"{rec.source} (plugin {rec.plugin!r})"


def contested(records: Iterable[BackendRecord]) -> dict[str, list[BackendRecord]]:
    """The one duplicate-name rule: a backend name provided by more than one record."""
    by_name: dict[str, list[BackendRecord]] = {}
    for rec in records:
        by_name.setdefault(rec.name, []).append(rec)
    return {name: recs for name, recs in by_name.items() if len(recs) > 1}


def duplicate_message(name: str, recs: list[BackendRecord]) -> str:
    return f"duplicate backend name {name!r}: provided by " + " and by ".join(map(origin, recs))
