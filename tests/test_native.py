"""Native entries for plain calls (BackendBase.fast_call) and the zentorch one in C++.

The layer contract runs everywhere on a pure-Python backend with a fast_call; the C++
entry of the zentorch backend runs for real where zentorch and a C++ compiler are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moe_dispatch as md
from helpers import (TOLERANCE, ZENTORCH_OK, ZENTORCH_WHY, random_routing, random_weights,
                     reference, rel_error, torch_and)
from moe_dispatch_backends import torch_loop
from moe_dispatch.testing.strategies import TOOLKIT_CONVERTS, call_variants

CFG = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)


class EntryBackend(md.BackendBase):
    """The torch loop, plus a fast_call entry that counts calls and declines, returns or
    raises as told."""

    def __init__(self, mode: str = "run") -> None:
        self.mode = mode
        self.entry_calls = self.apply_calls = 0
        self.guards: list[md.FastGuard] = []

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        return torch_loop.TorchLoopBackend().process_weights(weights, capabilities)

    def apply(self, state, x, tw, ids):
        self.apply_calls += 1
        return torch_loop.TorchLoopBackend().apply(state, x, tw, ids)

    def fast_call(self, state, guard):
        self.guards.append(guard)
        if self.mode == "broken_at_prepare":
            raise RuntimeError("cannot build the entry")

        def entry(x, tw, ids):
            self.entry_calls += 1
            if self.mode == "decline" or torch._C._get_tracing_state():
                return None  # declined (inside torch.jit.trace, as the contract asks)
            if self.mode == "raise":
                raise RuntimeError("native kernel status -7")
            return torch_loop.TorchLoopBackend().apply(state, x, tw, ids)
        return entry


@contextlib.contextmanager
def _entry_layer(mode: str = "run") -> Iterator[tuple[EntryBackend, md.MoELayer, dict]]:
    """(backend, prepared layer on it, the caller's weights), the backend registered first
    in front of the torch loop."""
    backend = EntryBackend(mode)
    with md.use_registry(torch_and(md.BackendSpec("entry", 900, backend))):
        weights = random_weights(CFG)
        yield backend, md.MoELayer(CFG).load_weights(**weights).prepare(), weights


# -- the layer's contract (any backend) ---------------------------------------------------
@pytest.mark.usefixtures("call_path")
def test_plain_calls_take_the_entry_and_the_guard_names_the_canonical_weights():
    with _entry_layer() as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 5)
        out = layer(x, tw, ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 0
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
        guard = backend.guards[-1]
        assert guard.watched[0] is w["w13"] and guard.watched[1] is w["w2"]
        assert guard.versions == tuple(t._version for t in guard.watched)
        # keyword arguments take the Python path; with a hook, forward runs the entry
        layer(hidden_states=x, topk_weights=tw, topk_ids=ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 1
        seen = []
        handle = layer.register_forward_hook(lambda mod, args, out: seen.append(out))
        assert torch.equal(layer(x, tw, ids), out) and len(seen) == 1
        handle.remove()
        assert backend.entry_calls == 2 and backend.apply_calls == 1
        # torch.jit.trace records the layer's op (moe_dispatch::moe_forward), whose run is
        # not traced (so the entry serves it); the trace, when it runs, runs the layer, entry
        # included, for any routing
        with warnings.catch_warnings():  # deprecation and data-dependent-branch warnings
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(layer, (x, tw, ids), check_trace=False)
        assert "moe_dispatch::moe_forward" in str(traced.graph) and backend.apply_calls == 1
        calls = backend.entry_calls
        assert torch.allclose(traced(x, tw, ids), out)
        assert backend.entry_calls == calls + 1 and backend.apply_calls == 1
        x2, tw2, ids2 = random_routing(CFG, 9, seed=21)
        assert torch.allclose(traced(x2, tw2, ids2), layer(x2, tw2, ids2))


def test_a_tuned_layer_takes_the_entry_when_one_backend_wins_every_bucket():
    backend = EntryBackend()
    with md.use_registry(torch_and(md.BackendSpec("entry", 900, backend))):
        layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=4, max_candidates=1,
                            tuning_cache=False).load_weights(**random_weights(CFG)).prepare()
        assert set(layer.tuned_table.values()) == {"entry"} and layer.uses_native_entry
        assert layer.plan.native is not None  # one route for every bucket: its entry
        layer(*random_routing(CFG, 3))
        assert backend.entry_calls == 1


@pytest.mark.usefixtures("call_path")
def test_a_declined_call_runs_the_python_path():
    with _entry_layer("decline") as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 4)
        out = layer(x, tw, ids)
        assert backend.entry_calls == 1 and backend.apply_calls == 1
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@pytest.mark.usefixtures("call_path")
def test_an_entry_that_raises_is_a_kernel_failure(caplog):
    with _entry_layer("raise") as (backend, layer, w):
        x, tw, ids = random_routing(CFG, 4)
        with caplog.at_level(logging.WARNING, logger="moe_dispatch"):
            out = layer(x, tw, ids)
        assert layer.backend == "torch" and layer.demotions[0].backend == "entry"
        assert "native kernel status -7" in layer.demotions[0].error
        assert rel_error(out, reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
        assert sum("demoted" in r.message for r in caplog.records) == 1


@pytest.mark.usefixtures("call_path")
def test_bad_input_is_the_callers_error_even_if_the_entry_raises_on_it():
    # a careless entry: it raises instead of declining
    with _entry_layer("raise") as (backend, layer, _):
        x, tw, ids = random_routing(CFG, 3)
        ids[0, 0] = 99
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, ids)
        assert layer.demotions == () and layer.backend == "entry"


def test_fast_call_failing_at_prepare_costs_speed_only(caplog):
    with caplog.at_level(logging.WARNING, logger="moe_dispatch"), \
            _entry_layer("broken_at_prepare") as (backend, layer, w):
        assert layer.backend == "entry" and not layer.uses_native_entry
        assert any("cannot build the entry" in r.message for r in caplog.records)
        x, tw, ids = random_routing(CFG, 2)
        assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_in_place_weight_change_is_caught_with_an_entry():
    # a correct entry declines a changed version
    with _entry_layer("decline") as (backend, layer, w):
        w["w13"].mul_(1.0)
        with pytest.raises(md.WeightsModifiedError):
            layer(*random_routing(CFG, 2))


# -- the zentorch C++ entry, for real ------------------------------------------------------
needs_zentorch = pytest.mark.skipif(not ZENTORCH_OK, reason=f"zentorch backend unavailable: {ZENTORCH_WHY}")
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler on PATH: the zentorch native entry cannot be built")
ZEN_CFG = md.MoEConfig(16, 4, 128, 64, dtype=torch.float32)


def _zen_dtypes() -> list[torch.dtype]:
    if not ZENTORCH_OK:
        return [torch.float32]
    caps = md.Capabilities.detect()
    return [dt for dt in (torch.float32, torch.bfloat16)
            if md.resolve(md.MoEConfig(16, 4, 128, 64, dtype=dt), capabilities=caps).backend == "zentorch"]


@pytest.fixture(scope="module")
def zen_layers():
    layers = {}
    for dt in _zen_dtypes():
        cfg = md.MoEConfig(16, 4, 128, 64, dtype=dt)
        w = random_weights(cfg, seed=3)
        layers[dt] = (cfg, w, md.MoELayer(cfg).load_weights(**w).prepare())
    return layers


@pytest.mark.zentorch
@needs_zentorch
@needs_compiler
@pytest.mark.parametrize("dtype", _zen_dtypes())
def test_zentorch_plain_calls_run_in_cpp(zen_layers, dtype):
    from moe_dispatch_backends.zentorch import native as zentorch_native

    cfg, w, layer = zen_layers[dtype]
    assert layer.backend == "zentorch"
    assert zentorch_native.status().startswith("in use"), zentorch_native.status()
    assert layer.plan.native.__name__ == "native_entry" and layer.uses_native_entry
    assert "native entry" in layer.explain()
    for tokens in (1, 7, 64):
        x, tw, ids = random_routing(cfg, tokens, seed=tokens)
        native = layer.plan.native(x, tw, ids)
        assert native is not None
        assert torch.equal(native, layer.run(x, tw, ids, native=False))  # the same op, same numbers
        assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]


@pytest.mark.zentorch
@needs_zentorch
@needs_compiler
@settings(max_examples=60)
@given(data=st.data())
def test_zentorch_entry_takes_only_plain_calls(zen_layers, data):
    cfg, w, layer = zen_layers[torch.float32]
    variant, args = data.draw(call_variants(cfg))
    native = layer.plan.native(*args)
    if variant not in ("plain", "strided_ids", "strided_weights",
                       "strided_hidden") + TOOLKIT_CONVERTS:
        assert native is None, variant
    if variant in TOOLKIT_CONVERTS:  # the entry converts them (the toolkit's PlainCall)
        assert native is not None, variant
    if native is not None:
        assert all(a.is_contiguous() for a in args), variant  # a (1, K) transpose is contiguous
        assert torch.equal(native, layer.run(*args, native=False))
    # The layer's answer whatever the entry did: the Python path's answer.
    try:
        want = layer.run(*args, native=False)
    except md.MoEDispatchError as exc:
        with pytest.raises(type(exc)):
            layer(*args)
        assert variant in ("id_too_large", "negative_id", "id_past_int32", "no_tokens"), variant
        return
    got = layer(*args)
    assert torch.equal(got, want), variant
    if got.shape[0]:
        assert rel_error(got, reference(cfg, w, *args)) <= TOLERANCE[torch.float32]


@pytest.mark.zentorch
@needs_zentorch
@needs_compiler
def test_zentorch_entry_declines_other_devices_dtypes_and_changed_weights(zen_layers):
    cfg, w, layer = zen_layers[torch.float32]
    x, tw, ids = random_routing(cfg, 3)
    assert layer.plan.native(x.to("meta"), tw, ids) is None
    assert layer.plan.native(x.double(), tw, ids) is None
    assert layer.plan.native(x[:, :64], tw, ids) is None
    assert layer.plan.native(x.unsqueeze(0), tw, ids) is None
    assert layer.plan.native(x, tw[:2], ids) is None
    assert layer.plan.native(x, tw.to_sparse(), ids) is None
    assert layer.plan.native("x", tw, ids) is None
    # a weight tensor changed in place: declined, and the layer says what happened
    fresh = random_weights(cfg, seed=9)
    own = md.MoELayer(cfg).load_weights(**fresh).prepare()
    assert own.plan.native(x, tw, ids) is not None
    fresh["w2"].add_(1.0)
    assert own.plan.native(x, tw, ids) is None
    with pytest.raises(md.WeightsModifiedError):
        own(x, tw, ids)


# -- building the module: off, no compiler, a failed build (fresh processes) -----------------
_PROBE = textwrap.dedent("""
    import json, logging, torch
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    import moe_dispatch as md
    from moe_dispatch_backends.zentorch import native as zentorch_native
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(*cfg.w13_shape, generator=g) / 8
    w2 = torch.randn(*cfg.w2_shape, generator=g) / 6
    layer = md.MoELayer(cfg).load_weights(w13, w2).prepare()
    x = torch.randn(3, 64, generator=g)
    tw, ids = md.select_experts(torch.randn(3, 8, generator=g), 2)
    want = md.reference.moe_reference(cfg, x, w13, w2, tw, ids)
    err = float((layer(x, tw, ids).double() - want).norm() / want.norm())
    print(json.dumps(dict(backend=layer.backend, native=layer.uses_native_entry,
                          status=zentorch_native.status(), err=err)))
""")


def _probe(env: dict[str, str]) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


@pytest.mark.zentorch
@needs_zentorch
@pytest.mark.parametrize("value", ["0", "off"])
def test_native_off_by_env(value):
    out, err = _probe({"MOE_DISPATCH_NATIVE": value})
    assert out["backend"] == "zentorch" and not out["native"]
    assert out["status"].startswith(f"off (MOE_DISPATCH_NATIVE={value})")
    assert out["err"] <= TOLERANCE[torch.float32] and "WARNING" not in err


@pytest.mark.zentorch
@needs_zentorch
def test_no_compiler_warns_once_and_runs_the_python_path():
    out, err = _probe({"CXX": "no-such-compiler-here"})
    assert out["backend"] == "zentorch" and not out["native"]
    assert "no C++ compiler ('no-such-compiler-here' is not on PATH)" in out["status"]
    assert err.count("WARNING") == 1 and "the Python path runs" in err
    assert out["err"] <= TOLERANCE[torch.float32]


@pytest.mark.zentorch
@needs_zentorch
@needs_compiler
def test_a_failed_build_warns_and_runs_the_python_path(tmp_path: Path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the build directory should go")
    out, err = _probe({"MOE_DISPATCH_NATIVE_DIR": str(blocker)})
    assert out["backend"] == "zentorch" and not out["native"]
    assert out["status"].startswith("unavailable: build failed")
    assert "NotADirectoryError" in out["status"] or "FileExistsError" in out["status"]
    assert err.count("WARNING") == 1 and str(blocker) in err
    assert out["err"] <= TOLERANCE[torch.float32]


@pytest.mark.zentorch
@needs_zentorch
@needs_compiler
def test_fast_call_object_checks_without_running_the_op():
    """The C++ object on its own, in both dtypes (bf16 reaches the op only with AVX512-BF16;
    these calls are all declined before the op, so they run on any Zen)."""
    from moe_dispatch_backends.zentorch import native as zentorch_native

    native = zentorch_native.load()
    assert native is not None, zentorch_native.status()
    for dtype in (torch.bfloat16, torch.float32):
        w13, w2 = torch.randn(8, 64, 32).to(dtype), torch.randn(8, 32, 32).to(dtype)
        fc = native.FastCall(w13, w2, None, None, "silu", 32, 2, 8, dtype, [w13], [w13._version]).entry()
        x = torch.randn(3, 32).to(dtype)
        tw, ids = md.select_experts(torch.randn(3, 8), 2)
        bad = ids.clone()
        bad[2, 1] = 8
        assert fc(x, tw, bad) is None                       # id out of range
        assert fc(x.float() if dtype == torch.bfloat16 else x.bfloat16(), tw, ids) is None
        dup = ids.clone()
        dup[0, 1] = dup[0, 0]
        assert fc(x, tw, dup) is None                       # repeated id in a row
        assert fc(x, tw, dup.long()) is None                # the same, int64
        past = ids.long()
        past[0, 0] += 2**32
        assert fc(x, tw, past) is None                      # valid only once narrowed to int32
        with pytest.raises(TypeError, match="3 arguments"):
            fc(x, tw)
        w13.add_(0.0)
        assert fc(x, tw, ids) is None                       # watched weight changed
    with pytest.raises(RuntimeError, match="plain config"):
        native.FastCall(w13, w2, None, None, "silu", 32, 1, 8, torch.float32, [], [])
    with pytest.raises(RuntimeError, match="one version per watched tensor"):
        native.FastCall(w13, w2, None, None, "silu", 32, 2, 8, torch.float32, [w13], [])


@pytest.mark.zentorch
@needs_zentorch
def test_doctor_reports_the_entry_without_building_it(tmp_path: Path):
    empty = tmp_path / "native"
    run = subprocess.run([sys.executable, "-m", "moe_dispatch", "doctor", "--json"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MOE_DISPATCH_NATIVE_DIR": str(empty)})
    assert run.returncode == 0, run.stderr
    zen = next(b for b in json.loads(run.stdout)["backends"] if b["name"] == "zentorch")
    status = zen["diagnostics"]["C++ decode entry"]
    assert status.startswith("not built yet") and "python -m moe_dispatch_backends.zentorch.native" in status
    assert not empty.exists()  # doctor looked, and built nothing


def test_a_modules_own_header_is_part_of_its_build_arguments(tmp_path):
    """torch's builder hashes sources only: an edit to a header named in ``headers`` must
    change the build's arguments (and so rebuild); without headers the toolkit's alone."""
    from moe_dispatch.kernels import NativeExtension

    header = tmp_path / "mine.h"
    header.write_text("// one\n")

    def flags(**kw):
        return NativeExtension("m", [tmp_path / "m.cpp"], switch="X", dir_env="Y", what="m", **kw).extra_cflags

    before = flags(headers=[header])
    header.write_text("// two\n")
    assert flags(headers=[header]) != before
    assert flags() == flags(headers=())
    assert flags() != before
