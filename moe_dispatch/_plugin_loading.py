"""The registry's discovery half: entry points imported in a fixed order (built-ins
first), each plugin registered with pluggy and checked to implement the hook, and every
failure recorded with its source instead of raised, so one broken plugin never takes the
others down. :class:`~moe_dispatch._registry.Registry` is the other half.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import logging
from typing import Any

import pluggy

from ._records import PluginFailure, env_names
from ._spec import ENTRY_POINT_GROUP, normalize_name

log = logging.getLogger("moe_dispatch")

BUILTIN_DISTRIBUTION = "moe-dispatch"
HOOK = "moe_dispatch_backends"
HOOK_USAGE = ("a plugin must provide a function or method moe_dispatch_backends(), taking no "
              "arguments, decorated with @moe_dispatch.hookimpl and returning a list of "
              "BackendSpec")


class PluginLoading:
    """Entry-point discovery and plugin registration; the Registry sets these attributes."""

    _pm: pluggy.PluginManager
    _sources: dict[str, str]
    _dists: dict[str, str]
    _load_failures: list[PluginFailure]
    _want_entry_points: bool
    _entry_points_loaded: bool
    _loading: bool
    _warned: set[tuple[str, str]]

    def _invalidate(self) -> None:  # the Registry's
        raise NotImplementedError

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
