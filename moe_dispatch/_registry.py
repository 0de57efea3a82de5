"""The backend registry: plugin discovery, validation, ordering and failure records.

A plugin is anything pluggy can register that implements the ``moe_dispatch_backends``
hook (usually a module). Each hook implementation is called on its own, so one that
raises or returns garbage is excluded and reported with its source, and never takes the
other plugins down.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import types
from typing import Any, Iterable, Iterator

import pluggy

from ._errors import PluginError
from ._plugin_loading import BUILTIN_DISTRIBUTION, PluginLoading  # noqa: F401 (re-exported)
from ._records import (PluginFailure, RegistrySnapshot, contested, duplicate_message,  # noqa: F401
                       env_names, origin)  # env_names: re-exported
from ._spec import (PROJECT, BackendHookSpec, BackendRecord, BackendSpec,
                    hookimpl, normalize_name)

log = logging.getLogger("moe_dispatch")

# Generations are unique across registries, so resolution-cache keys never collide.
_GENERATIONS = itertools.count(1)


class Registry(PluginLoading):
    """Holds the plugin manager; snapshots are rebuilt only when plugins change."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._lock = threading.RLock()
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(BackendHookSpec)
        self._sources: dict[str, str] = {}
        self._dists: dict[str, str] = {}  # plugin name -> distribution (entry points only)
        self._contested_names: frozenset[str] = frozenset()  # served by nobody
        self._load_failures: list[PluginFailure] = []
        self._want_entry_points = load_entry_points
        self._entry_points_loaded = False
        self._loading = False  # entry points being imported: snapshots are partial, not cached
        self._generation = next(_GENERATIONS)
        self._snapshot: RegistrySnapshot | None = None
        self._warned: set[tuple[str, str]] = set()

    # -- registration ------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> str:
        """Register a plugin object, or a single :class:`BackendSpec`, programmatically.

        Returns the plugin name. A backend name that is already registered raises
        :class:`PluginError` naming both sources; nothing is registered then.
        """
        with self._lock:
            self._ensure_loaded()
            source = "registered programmatically with moe_dispatch.register()"
            before = self.snapshot()
            if isinstance(plugin, BackendSpec):
                # Its plugin takes the backend's name: check the name before pluggy does.
                clash = contested(list(before.records) + [BackendRecord(plugin, "?", source)])
                if clash:
                    raise PluginError(duplicate_message(*next(iter(clash.items()))))
                if plugin.name in self._contested_names:
                    raise PluginError(f"duplicate backend name {plugin.name!r}: already contested "
                                      "by two discovered plugins (see plugin_failures())")
                plugin = _SpecPlugin(plugin)
                name = name or plugin.spec.name
            if self._pm.is_registered(plugin):
                raise PluginError(f"plugin {_label(plugin)} is already registered as "
                                  f"{self._pm.get_name(plugin)!r}; register it once")
            pname = normalize_name(name) if name else self._default_name(plugin)
            if self._pm.has_plugin(pname):
                raise PluginError(f"a plugin named {pname!r} is already registered "
                                  f"({self._sources.get(pname, 'unknown source')}); pass "
                                  "another name=")
            problem = self._pm_register(plugin, pname)
            if problem:
                what = _label(plugin)
                what = repr(pname) if what == pname else f"{what} (as {pname!r})"
                raise PluginError(f"cannot register plugin {what}: {problem}")
            self._sources[pname] = source
            self._invalidate()
            new = self._collect_one(pname, plugin)
            if isinstance(new, PluginFailure):
                problem = f"plugin {pname!r} is invalid: {new.error}"
            else:
                clash = contested(list(before.records) + new)
                problem = duplicate_message(*next(iter(clash.items()))) if clash else None
            if problem:
                self._pm.unregister(name=pname)
                self._sources.pop(pname, None)
                self._invalidate()
                raise PluginError(problem)
            return pname

    def unregister(self, name: str) -> None:
        """Remove the plugin with this name, or the plugin providing this backend name."""
        with self._lock:
            self._ensure_loaded()
            key = normalize_name(name)
            if not self._pm.has_plugin(key):
                rec = self.snapshot().by_name(key)  # raises UnknownBackendError
                key = rec.plugin
            self._pm.unregister(name=key)
            self._sources.pop(key, None)
            self._invalidate()

    def reload(self) -> None:
        """Forget discovered plugins and failures, then discover again (env is re-read).

        Plugins added with :meth:`register` are kept: they were never discovered.
        """
        with self._lock:
            for pname in self._dists:  # exactly the entry-point plugins
                if self._pm.has_plugin(pname):
                    self._pm.unregister(name=pname)
                self._sources.pop(pname, None)
            self._dists.clear()
            self._load_failures.clear()
            self._entry_points_loaded = False
            self._invalidate()

    def _invalidate(self) -> None:
        self._generation = next(_GENERATIONS)
        self._snapshot = None

    def _default_name(self, plugin: Any) -> str:
        """The plugin's module or class name, numbered when that is taken (another instance)."""
        base = normalize_name(_label(plugin))
        name, n = base, 1
        while self._pm.has_plugin(name) or self._pm.is_blocked(name):
            n += 1
            name = f"{base}#{n}"
        return name

    # -- collection --------------------------------------------------------------------
    def _collect_one(self, pname: str, plugin: Any) -> list[BackendRecord] | PluginFailure:
        source = self._sources.get(pname, "unknown source")
        impls = [i for i in self._pm.hook.moe_dispatch_backends.get_hookimpls()
                 if i.plugin is plugin]
        records: list[BackendRecord] = []
        for impl in impls:
            try:
                result = impl.function()
            except Exception as exc:
                return PluginFailure(pname, source, f"moe_dispatch_backends() raised "
                                     f"{type(exc).__name__}: {exc}")
            if isinstance(result, BackendSpec):
                result = [result]
            if not isinstance(result, Iterable) or isinstance(result, (str, bytes)):
                return PluginFailure(pname, source, "moe_dispatch_backends() must return a list "
                                     f"of BackendSpec, got {type(result).__name__}")
            try:
                items = list(result)
            except Exception as exc:
                return PluginFailure(pname, source, f"iterating its backends raised "
                                     f"{type(exc).__name__}: {exc}")
            for item in items:
                if not isinstance(item, BackendSpec):
                    return PluginFailure(pname, source, "moe_dispatch_backends() returned "
                                         f"{type(item).__name__} {item!r:.60}, not a BackendSpec")
                records.append(BackendRecord(item, pname, source, self._dists.get(pname)))
        return records

    def snapshot(self) -> RegistrySnapshot:
        with self._lock:
            self._ensure_loaded()
            if self._snapshot is not None:
                return self._snapshot
            failures = list(self._load_failures)
            collected: list[BackendRecord] = []
            for pname, plugin in sorted(self._pm.list_name_plugin(), key=lambda np: np[0]):
                got = self._collect_one(pname, plugin)
                if isinstance(got, PluginFailure):
                    failures.append(got)
                    self._warn_once(got)
                    continue
                collected.extend(got)
            # Deterministic and never silent: a contested name is served by nobody.
            clash = contested(collected)
            self._contested_names = frozenset(clash)
            for name, recs in clash.items():
                failure = PluginFailure(name, " and ".join(origin(r) for r in recs),
                                        duplicate_message(name, recs) + "; neither is used "
                                        "until one is removed or disabled")
                failures.append(failure)
                self._warn_once(failure)
            records = sorted((r for r in collected if r.name not in clash),
                             key=BackendRecord.sort_key)
            snap = RegistrySnapshot(self._generation, tuple(records), tuple(failures))
            if not self._loading:  # a view taken mid-discovery is partial: never keep it
                self._snapshot = snap
            return snap

def _label(plugin: Any) -> str:
    """A plugin as a person knows it: its module's name, or its class's dotted name."""
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    if isinstance(plugin, _SpecPlugin):
        return f"BackendSpec {plugin.spec.name!r}"
    cls = plugin if isinstance(plugin, type) else type(plugin)
    return f"{cls.__module__}.{cls.__qualname__}"


class _SpecPlugin:
    """Wraps one BackendSpec given to register() as a plugin."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    @hookimpl
    def moe_dispatch_backends(self) -> list[BackendSpec]:
        return [self.spec]


_REGISTRY = Registry()


def get_registry() -> Registry:
    return _REGISTRY


@contextlib.contextmanager
def use_registry(registry: Registry) -> Iterator[Registry]:
    """Make ``registry`` the process-wide one for the duration (tests, sandboxes)."""
    global _REGISTRY
    previous, _REGISTRY = _REGISTRY, registry
    try:
        yield registry
    finally:
        _REGISTRY = previous
