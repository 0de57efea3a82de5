"""The backend registry: plugin discovery, validation, ordering and failure records.

A plugin is anything pluggy can register that implements the ``moe_dispatch_backends``
hook (usually a module). Each hook implementation is called on its own, so one that
raises or returns garbage is excluded and reported with its source, and never takes the
other plugins down.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as importlib_metadata
import itertools
import logging
import threading
import types
from typing import Any, Iterable, Iterator

import pluggy

from ._errors import PluginError
from ._records import PluginFailure, RegistrySnapshot, contested, duplicate_message, env_names, origin
from ._spec import (ENTRY_POINT_GROUP, PROJECT, BackendHookSpec, BackendRecord, BackendSpec,
                    hookimpl, normalize_name)

log = logging.getLogger("moe_dispatch")

BUILTIN_DISTRIBUTION = "moe-dispatch"
HOOK = "moe_dispatch_backends"
HOOK_USAGE = ("a plugin must provide a function or method moe_dispatch_backends(), taking no "
              "arguments, decorated with @moe_dispatch.hookimpl and returning a list of "
              "BackendSpec")

# Generations are unique across registries, so resolution-cache keys never collide.
_GENERATIONS = itertools.count(1)


class Registry:
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

    # -- discovery -------------------------------------------------------------------
    def _load_entry_points(self) -> None:
        """Import every allowed entry point of the group. Disabled ones are never imported."""
        disabled = env_names("MOE_DISPATCH_DISABLE")
        allowed = env_names("MOE_DISPATCH_PLUGINS")
        # Built-ins first, so a third-party entry point that takes a built-in's name is the
        # one refused, whatever the names sort to; the rest by name for a fixed outcome.
        eps = sorted(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda ep: (not _is_builtin(ep), ep.name, ep.value))
        for ep in eps:
            dist = getattr(ep, "dist", None)
            dist_name = getattr(dist, "name", None) or "unknown distribution"
            builtin = _is_builtin(ep)
            version = getattr(dist, "version", "") or ""
            source = (f"built-in ({dist_name} {version}, entry point {ep.name} = {ep.value})"
                      if builtin else
                      f"entry point {ep.name} = {ep.value} from {dist_name} {version}".rstrip())
            name = normalize_name(ep.name)
            # Security: the decision to skip is taken before the module is imported.
            if name in disabled:
                log.debug("plugin %s skipped: listed in MOE_DISPATCH_DISABLE", ep.name)
                continue
            if allowed and not builtin and name not in allowed:
                log.debug("plugin %s skipped: not in MOE_DISPATCH_PLUGINS", ep.name)
                continue
            if self._pm.has_plugin(name):
                self._fail(name, source, f"the entry point name {name!r} is already taken by "
                           f"{self._sources.get(name, 'another plugin')}; this one "
                           "was not loaded: give it another name")
                continue
            try:
                plugin = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a plugin must never take us down
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                self._fail(name, source, f"import failed: {type(exc).__name__}: {exc}")
                continue
            problem = self._pm_register(plugin, name)
            if problem:
                self._fail(name, source, problem)
                continue
            self._sources[name] = source
            self._dists[name] = dist_name
            self._invalidate()  # a plugin reading the registry while later ones import

    def _fail(self, plugin: str, source: str, error: str) -> None:
        failure = PluginFailure(plugin, source, error)
        if failure not in self._load_failures:
            self._load_failures.append(failure)
            self._invalidate()
        self._warn_once(failure)

    def _ensure_loaded(self) -> None:
        # A plugin module may read the registry while it is imported (same thread, the lock
        # is re-entrant): that call sees the plugins loaded so far and must not load again.
        if not self._want_entry_points or self._entry_points_loaded or self._loading:
            return
        self._loading = True
        try:
            self._load_entry_points()
        finally:
            self._loading = False
            self._entry_points_loaded = True
            self._invalidate()  # drop any view built before the last plugin was registered

    def _pm_register(self, plugin: Any, name: str) -> str | None:
        """Register with pluggy; None, or why the plugin was refused (nothing registered)."""
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:  # a hook with a wrong signature
            return f"its hook is invalid: {' '.join(str(exc).splitlines())}; {HOOK_USAGE}"
        except Exception as exc:  # noqa: BLE001 - e.g. ValueError: registered twice
            return f"registration failed: {type(exc).__name__}: {exc}"
        if registered is None:  # pluggy returns None for a blocked name
            return f"the plugin name {name!r} is blocked"
        if not any(impl.plugin is plugin for impl in self._hookimpls()):
            # Unknown or unmarked hooks register silently in pluggy and would provide nothing.
            self._pm.unregister(plugin)
            return self._missing_hook(plugin)
        return None

    def _hookimpls(self) -> list[Any]:
        return self._pm.hook.moe_dispatch_backends.get_hookimpls()

    def _missing_hook(self, plugin: Any) -> str:
        if callable(getattr(plugin, HOOK, None)):
            detail = f"its {HOOK} is not decorated with @moe_dispatch.hookimpl"
        else:
            marked = [n for n in dir(plugin) if self._pm.parse_hookimpl_opts(plugin, n)]
            detail = (f"it marks {', '.join(marked)} with @moe_dispatch.hookimpl, but the hook "
                      f"is named {HOOK}" if marked else f"it has no {HOOK}")
        return f"it implements no moe_dispatch hook: {detail}; {HOOK_USAGE}"

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

    def _warn_once(self, failure: PluginFailure) -> None:
        key = (failure.plugin, failure.error)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("moe-dispatch plugin %s (%s) excluded: %s", failure.plugin,
                        failure.source, failure.error)


def _is_builtin(ep: importlib_metadata.EntryPoint) -> bool:
    """An entry point of this project's own distribution."""
    dist_name = getattr(getattr(ep, "dist", None), "name", None) or ""
    return normalize_name(dist_name) == normalize_name(BUILTIN_DISTRIBUTION)


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
