"""Faults the library must survive: failing kernels, broken plugins, garbage from hooks,
duplicate names, in-place weight changes, and plugin gating before import."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import moe_dispatch as md
from fakedist import make_dist, plugin_source
from helpers import (TOLERANCE, assert_unchanged, random_routing, random_weights, reference, rel_error,
                     snapshot, torch_and)

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


class FlakyBackend(md.BackendBase):
    """Accepts everything; its kernel raises like a library missing a symbol."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.calls = 0

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        return weights.w13.clone()  # its own copy: it keeps no reference to the caller's

    def apply(self, state, x, tw, ids):
        self.calls += 1
        raise self.exc


# -- 1. a kernel raises at run time ----------------------------------------------------
@pytest.mark.parametrize("exc", [RuntimeError("zentorch status -13"),
                                 OSError("undefined symbol: zendnn_matmul")])
def test_kernel_failure_falls_back_once_with_warning(exc, caplog):
    flaky = FlakyBackend(exc)
    w = random_weights(CFG)
    before = snapshot(w)
    with md.use_registry(torch_and(md.BackendSpec("flaky", 900, flaky))):
        layer = md.MoELayer(CFG).load_weights(**w).prepare()
        assert layer.backend == "flaky"
        x, tw, ids = random_routing(CFG, 5)
        with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
            out = layer(x, tw, ids)
            out2 = layer(x, tw, ids)
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
        assert torch.equal(out, out2)
        assert flaky.calls == 1  # the next call went straight to the fallback
        assert layer.backend == "torch"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "flaky" in warnings[0].message and str(exc) in warnings[0].message
        text = layer.explain()
        assert "demoted" in text and "flaky" in text and str(exc) in text
        assert layer.demotions[0].backend == "flaky"
    assert_unchanged(w, before)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_strict_mode_raises_instead(how, monkeypatch):
    flaky = FlakyBackend(RuntimeError("boom"))
    with md.use_registry(torch_and(md.BackendSpec("flaky", 900, flaky))):
        if how == "env":
            monkeypatch.setenv("MOE_DISPATCH_STRICT", "1")
            layer = md.MoELayer(CFG)
        else:
            layer = md.MoELayer(CFG, strict=True)
        layer.load_weights(**random_weights(CFG)).prepare()
        with pytest.raises(md.KernelError, match="flaky.*boom.*strict"):
            layer(*random_routing(CFG, 3))
        assert layer.backend == "flaky"


def test_forced_backend_never_falls_back():
    with md.use_registry(torch_and(md.BackendSpec("flaky", 900, FlakyBackend(RuntimeError("x"))))):
        layer = md.MoELayer(CFG, backend="flaky").load_weights(**random_weights(CFG)).prepare()
        with pytest.raises(md.KernelError, match="forced backend 'flaky'"):
            layer(*random_routing(CFG, 3))


def test_no_fallback_without_canonical_weights():
    with md.use_registry(torch_and(md.BackendSpec("flaky", 900, FlakyBackend(RuntimeError("x"))))):
        w = random_weights(CFG)
        layer = md.MoELayer(CFG, keep_canonical=False).load_weights(**w).prepare()
        del w
        with pytest.raises(md.KernelError, match="no fallback is possible.*keep_canonical=False"):
            layer(*random_routing(CFG, 3))


def test_process_weights_failure_moves_to_next_backend():
    class BadPrepack(FlakyBackend):
        def process_weights(self, weights, capabilities):
            raise MemoryError("cannot allocate prepacked buffer")

    with md.use_registry(torch_and(md.BackendSpec("bad", 900, BadPrepack(RuntimeError())))):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        assert layer.backend == "torch"
        assert "process_weights raised MemoryError" in layer.explain()


# -- 2. a plugin fails to import ---------------------------------------------------------
@pytest.mark.parametrize("kind,source,error", [
    ("missing_module", None, "ModuleNotFoundError"),
    ("import_error", "import not_a_real_dependency_xyz\n", "ModuleNotFoundError"),
    ("syntax_error", "def broken(:\n", "SyntaxError"),
    ("raises", "raise RuntimeError('vendor init failed')\n", "vendor init failed"),
])
def test_plugin_import_failure_is_isolated(kind, source, error, plugin_path, caplog):
    modules = {"good_vendor": plugin_source("goodvendor", 150)}
    if source is not None:
        modules[f"bad_{kind}"] = source
    make_dist(plugin_path, "vendor-dist", {"goodvendor": "good_vendor", "badone": f"bad_{kind}"}, modules)
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
        reg = md.Registry()
        with md.use_registry(reg):
            names = md.available_backends()
            assert "goodvendor" in names and "torch" in names
            failures = md.plugin_failures()
            bad = [f for f in failures if f.plugin == "badone"]
            assert bad and error in bad[0].error and "vendor-dist" in bad[0].source
            text = md.explain(CFG)
            assert "badone" in text and error in text
            md.available_backends()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "badone" in r.message]
    assert len(warnings) == 1


# -- 3. hooks that raise or return garbage -----------------------------------------------
GARBAGE = {
    "hook_raises": "raise ValueError('no license')",
    "returns_none": "return None",
    "returns_string": "return 'zentorch'",
    "returns_dicts": "return [{'name': 'x', 'priority': 1}]",
    "non_string_name": "return [md.BackendSpec(42, 1, Backend())]",
    "bad_priority": "return [md.BackendSpec('p', 'high', Backend())]",
    "missing_methods": "return [md.BackendSpec('p', 1, object())]",
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_hooks_excluded_with_source(case, plugin_path):
    body = GARBAGE[case]
    source = plugin_source("unused").replace(
        '    return [md.BackendSpec("unused", 100, Backend())]', "    " + body)
    make_dist(plugin_path, "garbage-dist", {"garbage": "garbage_mod"}, {"garbage_mod": source})
    with md.use_registry(md.Registry()):
        assert "torch" in md.available_backends()
        failure = next(f for f in md.plugin_failures() if f.plugin == "garbage")
        assert "garbage-dist" in failure.source and "garbage_mod" in failure.source
        assert md.resolve(CFG).backend  # the rest keeps working


@pytest.mark.parametrize("result", [None, True, "yes", 1, md.Decision])
def test_supports_config_garbage_is_a_rejection_naming_the_backend(result):
    class Garbage(FlakyBackend):
        def supports_config(self, config, capabilities):
            return result

    with md.use_registry(torch_and(md.BackendSpec("junk", 900, Garbage(RuntimeError())))):
        res = md.resolve(CFG)
        assert res.backend == "torch"
        cand = res.candidates[0]
        assert cand.name == "junk" and not cand.decision.accepted
        assert "instead of a Decision" in cand.reason and "junk" in cand.reason


def test_supports_layer_raising_is_a_layer_rejection():
    class Raises(FlakyBackend):
        def supports_layer(self, weights, capabilities):
            raise KeyError("layout")

    with md.use_registry(torch_and(md.BackendSpec("raises", 900, Raises(RuntimeError())))):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        assert layer.backend == "torch"
        assert "supports_layer raised KeyError" in layer.explain()


def test_rejection_needs_a_reason():
    with pytest.raises(ValueError, match="non-empty reason"):
        md.reject("  ")


# -- 4. duplicate backend names ----------------------------------------------------------
def test_duplicate_names_from_two_distributions(plugin_path):
    make_dist(plugin_path, "vendor-a", {"fastmoe": "vendor_a"}, {"vendor_a": plugin_source("fastmoe", 500)})
    make_dist(plugin_path, "vendor-b", {"fastmoe_b": "vendor_b"}, {"vendor_b": plugin_source("FastMoE", 600)})
    with md.use_registry(md.Registry()):
        assert "fastmoe" not in md.available_backends()  # contested: served by nobody
        failure = next(f for f in md.plugin_failures() if "duplicate" in f.error)
        assert "vendor-a" in failure.error and "vendor-b" in failure.error
        with pytest.raises(md.UnknownBackendError):
            md.resolve(CFG, backend="fastmoe")


def test_duplicate_programmatic_registration_names_both():
    with md.use_registry(torch_and()):
        with pytest.raises(md.PluginError, match="duplicate backend name 'torch': provided by .* and by "):
            md.register(md.BackendSpec("torch", 5, FlakyBackend(RuntimeError())))
        assert md.available_backends() == ["torch"]


# -- security: gating happens before import ----------------------------------------------
SIDE_EFFECT = "import pathlib\npathlib.Path({marker!r}).write_text('imported')\n"


@pytest.mark.parametrize("how", ["disable", "allow_list"])
def test_blocked_plugin_is_never_imported(how, plugin_path, monkeypatch):
    marker = plugin_path / "IMPORTED"
    source = plugin_source("sneaky", 999, preamble=SIDE_EFFECT.format(marker=str(marker)))
    make_dist(plugin_path, "sneaky-dist", {"sneaky": "sneaky_mod"}, {"sneaky_mod": source})
    make_dist(plugin_path, "nice-dist", {"nice": "nice_mod"}, {"nice_mod": plugin_source("nice", 150)})
    if how == "disable":
        monkeypatch.setenv("MOE_DISPATCH_DISABLE", "sneaky")
    else:
        monkeypatch.setenv("MOE_DISPATCH_PLUGINS", "nice")
    with md.use_registry(md.Registry()):
        names = md.available_backends()
    assert "sneaky" not in names and "nice" in names and "torch" in names
    assert not marker.exists(), "the blocked plugin's module ran"
    # Control: without the block the same plugin is imported (the test can fail).
    monkeypatch.delenv("MOE_DISPATCH_DISABLE", raising=False)
    monkeypatch.delenv("MOE_DISPATCH_PLUGINS", raising=False)
    importlib.invalidate_caches()
    with md.use_registry(md.Registry()):
        assert "sneaky" in md.available_backends()
    assert marker.exists()


# -- 6. bad expert ids: the layer's check, or the kernel's own (BackendSpec.validates_ids) --
class IndexingBackend(md.BackendBase):
    """A per-expert loop that indexes its weights by id: a bad id raises IndexError,
    except a negative one, which Python indexing silently wraps around."""

    def __init__(self) -> None:
        self.seen_ids: list[list[list[int]]] = []

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        return weights.w13.clone(), weights.w2.clone()

    def apply(self, state, x, tw, ids):
        self.seen_ids.append(ids.tolist())
        w13, w2 = state
        if int(ids.max()) >= w13.shape[0]:
            raise IndexError(f"index {int(ids.max())} is out of bounds for dimension 0")
        return torch.zeros_like(x)


@pytest.mark.parametrize("validates", [False, True])
@pytest.mark.parametrize("bad", [8, 100])
def test_bad_ids_are_the_callers_error_whoever_checks_them(validates, bad):
    backend = IndexingBackend()
    spec = md.BackendSpec("indexing", 50, backend, validates_ids=validates)
    with md.use_registry(torch_and(spec)):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        assert layer.backend == "indexing"
        x, tw, ids = random_routing(CFG, 3)
        ids[1, 0] = bad
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, ids)
        # The kernel saw the bad id only when it declared that it checks ids itself, and it
        # was not blamed for the caller's error either way.
        assert any(bad in row for rows in backend.seen_ids for row in rows) == validates
        assert layer.demotions == () and layer.backend == "indexing"


def test_negative_ids_never_reach_a_backend_that_does_not_check_them():
    backend = IndexingBackend()
    with md.use_registry(torch_and(md.BackendSpec("indexing", 50, backend))):
        layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
        x, tw, ids = random_routing(CFG, 3)
        ids[0, 0] = -1  # w13[-1] would silently be the last expert
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, ids)
        assert backend.seen_ids == []


def test_validates_ids_must_be_a_bool():
    with pytest.raises(TypeError, match="validates_ids"):
        md.BackendSpec("x", 1, IndexingBackend(), validates_ids="yes")


def test_layer_stage_walks_the_config_stage_snapshot():
    """A backend registered between MoELayer() and prepare() is not half-considered: the
    layer stage walks the records the config stage resolved against."""
    from moe_dispatch.testing.strategies import Gate, SyntheticBackend
    reg = torch_and()
    with md.use_registry(reg):
        cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
        layer = md.MoELayer(cfg).load_weights(**random_weights(cfg))
        gate = Gate(frozenset({torch.float32}), None, 1)
        reg.register(md.BackendSpec("newcomer", 99, SyntheticBackend(gate)))
        layer.prepare()
        assert layer.backend == "torch"
        assert [c.name for c in layer.resolution.candidates] == ["torch"]
        assert md.MoELayer(cfg).load_weights(**random_weights(cfg)).prepare().backend == "newcomer"
