"""Registry loading: a plugin that reads the registry while it is imported, an entry point
that takes a built-in's name, plugins that provide no hook, and reload_plugins().

Entry-point plugins are fake distributions on sys.path (fakedist.make_dist) loaded by a fresh
Registry under use_registry, so the process's own registry is never touched."""

from __future__ import annotations

import re
import types

import pytest
import torch

import moe_dispatch as md
from fakedist import make_dist, plugin_source
from helpers import torch_and

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


class _Backend(md.BackendBase):
    def supports_config(self, config, capabilities):
        return md.accept("test")

    def process_weights(self, weights, capabilities):
        return weights

    def apply(self, state, x, tw, ids):
        return md.kernels.expert_loop(state, x, tw, ids)


# -- a plugin that reads the registry while entry points are imported ---------------------
READS_AT_IMPORT = """
import moe_dispatch as md
SEEN_AT_IMPORT = md.available_backends()
"""


def test_plugin_reading_the_registry_at_import_leaves_every_backend_registered(plugin_path):
    # "aaa" sorts before every built-in's entry point name: with names alone it loads first.
    make_dist(plugin_path, "reader-dist", {"aaa_reader": "aaa_reader_mod"},
              {"aaa_reader_mod": plugin_source("aaa_b", -20, preamble=READS_AT_IMPORT)})
    with md.use_registry(md.Registry()):
        names = md.available_backends()
        assert "torch" in names and "aaa_b" in names, (names, md.plugin_failures())
        assert md.resolve(CFG, backend="torch").backend == "torch"
        assert md.resolve(CFG, backend="aaa_b").backend == "aaa_b"
        import aaa_reader_mod
        # Built-ins load first, so a vendor's module sees them all while it is imported.
        assert "torch" in aaa_reader_mod.SEEN_AT_IMPORT
        assert "aaa_b" not in aaa_reader_mod.SEEN_AT_IMPORT


# -- an entry point named like a built-in ----------------------------------------------
def test_entry_point_taking_a_builtins_name_never_replaces_it(plugin_path):
    # "clash_mod" sorts before "moe_dispatch_backends.torch_loop": by (name, value) it won.
    make_dist(plugin_path, "clash-vendor", {"torch": "clash_mod"},
              {"clash_mod": plugin_source("clash_b", 999)})
    with md.use_registry(md.Registry()):
        names = md.available_backends()
        assert "torch" in names and "clash_b" not in names
        assert "built-in" in md.get_registry().snapshot().by_name("torch").source
        failure = next(f for f in md.plugin_failures() if f.plugin == "torch")
        assert "clash-vendor" in failure.source and "clash_mod" in failure.source
        assert "moe_dispatch_backends.torch_loop" in failure.error  # names the built-in too
        assert md.resolve(CFG, backend="torch").backend == "torch"


# -- plugins that provide no hook ------------------------------------------------------
class Misnamed:
    @md.hookimpl
    def moe_dispatch_backend(self):
        return [md.BackendSpec("misnamed_b", 1, _Backend())]


class Unmarked:
    def moe_dispatch_backends(self):
        return [md.BackendSpec("unmarked_b", 1, _Backend())]


class WrongSignature:
    @md.hookimpl
    def moe_dispatch_backends(self, config):
        return []


@pytest.mark.parametrize("plugin,says", [
    (Misnamed(), "marks moe_dispatch_backend with @moe_dispatch.hookimpl"),
    (Unmarked(), "is not decorated with @moe_dispatch.hookimpl"),
    (WrongSignature(), "{'config'} are declared in the hookimpl"),
    (types.ModuleType("empty_vendor"), "it has no moe_dispatch_backends"),
], ids=["misnamed", "unmarked", "wrong_signature", "empty_module"])
def test_register_refuses_a_plugin_without_a_usable_hook(plugin, says):
    with md.use_registry(torch_and()):
        with pytest.raises(md.PluginError) as err:
            md.register(plugin)
        message = str(err.value)
        assert says in message and "taking no arguments" in message  # what is accepted
        label = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__name__
        assert label in message
        assert md.available_backends() == ["torch"] and md.plugin_failures() == []
        assert not md.get_registry()._pm.is_registered(plugin)


class ReturnsNone:
    @md.hookimpl
    def moe_dispatch_backends(self):
        return None


class Provides:
    def __init__(self, name: str) -> None:
        self.name = name

    @md.hookimpl
    def moe_dispatch_backends(self):
        return [md.BackendSpec(self.name, 1, _Backend())]


def test_register_names_plugins_by_class_not_by_id():
    with md.use_registry(torch_and()):
        with pytest.raises(md.PluginError, match="(?i)returnsnone") as err:
            md.register(ReturnsNone())
        assert not re.search(r"\d{6,}", str(err.value)), str(err.value)
        first, second = md.register(Provides("p1")), md.register(Provides("p2"))
        assert "provides" in first and "provides" in second and first != second
        assert md.available_backends() == ["p1", "p2", "torch"]
        md.unregister(first)
        assert md.available_backends() == ["p2", "torch"]


@pytest.mark.parametrize("body,says", [
    ("@md.hookimpl\ndef moe_dispatch_backend():\n    return []\n",
     "marks moe_dispatch_backend with @moe_dispatch.hookimpl"),
    ("def moe_dispatch_backends():\n    return []\n", "is not decorated"),
    ("@md.hookimpl\ndef moe_dispatch_backends(config):\n    return []\n", "taking no arguments"),
], ids=["misnamed", "unmarked", "wrong_signature"])
def test_entry_point_without_a_usable_hook_is_a_recorded_failure(body, says, plugin_path):
    make_dist(plugin_path, "hookless-dist", {"hookless": "hookless_mod"},
              {"hookless_mod": "import moe_dispatch as md\n" + body})
    with md.use_registry(md.Registry()):
        assert "torch" in md.available_backends()
        failure = next(f for f in md.plugin_failures() if f.plugin == "hookless")
        assert says in failure.error and "hookless-dist" in failure.source


# -- reload_plugins() ------------------------------------------------------------------
def test_reload_keeps_registered_backends_and_rediscovers_entry_points(plugin_path):
    make_dist(plugin_path, "late-dist", {"late": "late_mod"}, {"late_mod": plugin_source("late_b")})
    with md.use_registry(md.Registry()):
        md.register(md.BackendSpec("mine", 1, _Backend()))
        assert {"mine", "late_b", "torch"} <= set(md.available_backends())
        md.reload_plugins()
        assert {"mine", "late_b", "torch"} <= set(md.available_backends())
        assert md.plugin_failures() == []  # rediscovery did not collide with itself
        assert "moe_dispatch.register()" in md.get_registry().snapshot().by_name("mine").source
        md.unregister("mine")
        assert "mine" not in md.available_backends()
