"""The zentorch backend's C++ entry for plain calls, for real where zentorch and a C++
compiler are: plain calls run in C++, it takes only plain calls (Hypothesis-drawn variants)
and declines the rest; its module off by env, without a compiler and after a failed build
(fresh processes: the Python path runs, with one warning), the C++ object's own checks, and
doctor's report without a build. The entries' layer contract: tests/test_native.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moe_dispatch as md
from helpers import (TOLERANCE, ZENTORCH_OK, ZENTORCH_WHY, random_routing, random_weights,
                     reference, rel_error)
from moe_dispatch.testing.strategies import TOOLKIT_CONVERTS, call_variants


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
