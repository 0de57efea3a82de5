"""Conformance tests for one moe-dispatch backend (the ``moe_backend`` fixture names it).

Parity with the float64 reference, weight ownership, gate consistency, and, for a backend
with a native entry (``BackendBase.fast_call``), that entry's contract.

    pytest --pyargs moe_dispatch.testing.conformance --moe-backend=NAME
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import (MACHINES, TOLERANCE, machine, machines_for, random_inputs,
                                  random_weights, rel_error)
from moe_dispatch.testing.strategies import MUST_DECLINE, call_variants

_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def moe_backend() -> str:
    # Replaced by the plugin's parametrisation when --moe-backend is given.
    pytest.skip("no backend named: pass --moe-backend=NAME")


@pytest.fixture(scope="module")
def backend_machines(moe_backend: str) -> list[md.Capabilities]:
    if moe_backend not in md.available_backends():
        pytest.fail(f"backend {moe_backend!r} is not registered: {md.available_backends()}")
    found = machines_for(moe_backend)
    if not found:
        pytest.fail(f"backend {moe_backend!r} accepts no config on this machine or any simulated one")
    return found


@pytest.fixture(scope="module")
def backend_kinds(moe_backend: str, backend_machines: list[md.Capabilities]) -> list[tuple]:
    """The (dtype, activation) pairs the backend accepts on its machines: drawing only
    those keeps Hypothesis from discarding most examples."""
    kinds = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for act in md.Activation:
            if _accepting(moe_backend, md.MoEConfig(8, 2, 64, 32, activation=act, dtype=dtype),
                          backend_machines) is not None:
                kinds.append((dtype, act))
    return kinds


def layers(kinds: list[tuple]) -> st.SearchStrategy[dict]:
    return st.tuples(st.sampled_from(kinds), st.builds(
        dict,
        num_experts=st.integers(2, 16), top_k=st.integers(1, 4),
        hidden_size=st.sampled_from((32, 64, 96)), intermediate_size=st.sampled_from((32, 64)),
        has_bias=st.booleans(), on_input=st.booleans(), tokens=st.sampled_from((1, 3, 17, 70)),
        seed=st.integers(0, 10_000))).map(lambda t: {**t[1], "dtype": t[0][0], "activation": t[0][1]})


def _config(d: dict) -> md.MoEConfig:
    top_k = 1 if d["on_input"] else min(d["top_k"], d["num_experts"])
    return md.MoEConfig(d["num_experts"], top_k, d["hidden_size"], d["intermediate_size"],
                        activation=d["activation"], dtype=d["dtype"], has_bias=d["has_bias"],
                        apply_router_weight_on_input=d["on_input"])


def _accepting(name: str, config: md.MoEConfig, caps_list: list[md.Capabilities]):
    rec = md.get_registry().snapshot().by_name(name)
    return next((c for c in caps_list if md.call_check(
        rec, "supports_config", config, c).accepted), None)


def _drawn_layer(name: str, machines: list[md.Capabilities], kinds: list[tuple], draw) -> tuple:
    """(config, data, caller's weights, prepared layer) for a drawn layer the backend accepts."""
    data = draw.draw(layers(kinds))
    config = _config(data)
    caps = _accepting(name, config, machines)
    assume(caps is not None)
    w = random_weights(config, data["seed"])
    layer = md.MoELayer(config, backend=name, capabilities=caps).load_weights(**w)
    return config, data, w, layer


@_SETTINGS
@given(draw=st.data())
def test_parity_with_reference(moe_backend, backend_machines, backend_kinds, draw):
    config, data, w, layer = _drawn_layer(moe_backend, backend_machines, backend_kinds, draw)
    layer.prepare()
    x, tw, ids = random_inputs(config, data["tokens"], pool=1, seed=data["seed"])[0]
    out = layer(x, tw, ids)
    assert out.shape == x.shape and out.dtype == config.dtype
    want = moe_reference(config, x, w["w13"], w["w2"], tw, ids, w["w13_bias"], w["w2_bias"])
    assert rel_error(out, want) <= TOLERANCE[config.dtype], config.describe()


@_SETTINGS
@given(draw=st.data())
def test_weight_ownership(moe_backend, backend_machines, backend_kinds, draw):
    config, data, w, layer = _drawn_layer(moe_backend, backend_machines, backend_kinds, draw)
    saved = {k: v.clone() for k, v in w.items() if v is not None}
    layer.prepare()
    for x, tw, ids in random_inputs(config, data["tokens"], pool=3, seed=data["seed"]):
        layer(x, tw, ids)
    for k, v in saved.items():
        assert torch.equal(w[k].view(torch.uint8), v.view(torch.uint8)), f"{k} was modified"


@_SETTINGS
@given(draw=st.data())
def test_in_place_update(moe_backend, backend_machines, backend_kinds, draw):
    """An in-place write to the caller's weights after prepare() (an optimizer's step), or new
    storage behind them (``w.data = ...``): a differentiable backend computes on those
    tensors, so it gives the new result; any other raises WeightsModifiedError, never a
    result from the old values."""
    config, data, w, layer = _drawn_layer(moe_backend, backend_machines, backend_kinds, draw)
    assume(config.weight_scheme is None)
    layer.prepare()
    x, tw, ids = random_inputs(config, data["tokens"], pool=1, seed=data["seed"])[0]
    layer(x, tw, ids)
    with torch.no_grad():
        w["w13"].mul_(0.5)
    differentiable = md.get_registry().snapshot().by_name(moe_backend).spec.differentiable
    if not differentiable:
        with pytest.raises(md.WeightsModifiedError, match="in place"):
            layer(x, tw, ids)
        # New storage, same version (w.data = ...; a module's .to() does this): detected too.
        layer.prepare()
        layer(x, tw, ids)
        w["w2"].data = w["w2"].data * 0.5
        with pytest.raises(md.WeightsModifiedError, match="storage was replaced"):
            layer(x, tw, ids)
        return
    want = moe_reference(config, x, w["w13"], w["w2"], tw, ids, w["w13_bias"], w["w2_bias"])
    assert rel_error(layer(x, tw, ids), want) <= TOLERANCE[config.dtype], config.describe()
    w["w2"].data = w["w2"].data * 0.5
    want = moe_reference(config, x, w["w13"], w["w2"], tw, ids, w["w13_bias"], w["w2_bias"])
    assert rel_error(layer(x, tw, ids), want) <= TOLERANCE[config.dtype], config.describe()


@pytest.fixture(scope="module")
def native_entries(moe_backend: str) -> None:
    backend = md.get_registry().snapshot().by_name(moe_backend).spec.backend
    if getattr(type(backend), "fast_call", md.BackendBase.fast_call) is md.BackendBase.fast_call:
        pytest.skip(f"backend {moe_backend!r} has no native entry (fast_call)")


@_SETTINGS
@given(draw=st.data())
def test_native_entry_agrees_with_the_python_path(moe_backend, backend_machines, backend_kinds,
                                                  native_entries, draw):
    """BackendBase.fast_call's contract: the entry declines what it must, and whatever it
    takes gives the Python path's numbers (within the dtype's tolerance)."""
    config, data, w, layer = _drawn_layer(moe_backend, backend_machines, backend_kinds, draw)
    assume(config.top_k >= 2 and config.num_experts > config.top_k)
    layer.prepare()
    assume(layer.uses_native_entry)  # a backend may offer no entry for some configs
    entry = layer.plan.native
    variant, args = draw.draw(call_variants(config))
    got = entry(*args)
    if variant in MUST_DECLINE:
        assert got is None, f"the entry took a call with {variant}"
    if got is not None:
        want = layer.run(*args, native=False)
        assert got.shape == want.shape and got.dtype == want.dtype, variant
        assert rel_error(got, want) <= TOLERANCE[config.dtype], (variant, config.describe())
    # inside torch.jit.trace (which records torch ops) a plain call must be declined too
    plain = random_inputs(config, max(1, data["tokens"]), pool=1, seed=data["seed"])[0]
    assume(entry(*plain) is not None)  # taken outside a trace (else the check proves nothing)
    taken: list = []
    with warnings.catch_warnings():  # tracing warnings
        warnings.simplefilter("ignore")
        torch.jit.trace(lambda *a: taken.append(entry(*a)) or a[0] * 1, plain, check_trace=False)
    assert taken == [None], "the entry took a call inside torch.jit.trace"
    # a call that autograd would record through a canonical weight must be declined
    if w["w13"].is_floating_point():
        w["w13"].requires_grad_(True)
        try:
            assert entry(*plain) is None, "the entry took a call while a weight requires grad"
        finally:
            w["w13"].requires_grad_(False)
    # a caller's in-place change to the canonical weights must be declined
    w["w2"].add_(0.0)
    assert entry(*args) is None, "the entry took a call after the weights changed in place"


_ANY = [(d, a) for d in (torch.bfloat16, torch.float32, torch.float16) for a in md.Activation]


@_SETTINGS
@given(data=layers(_ANY), machine_name=st.sampled_from(MACHINES))
def test_gate_consistency(moe_backend, backend_machines, data, machine_name):
    """supports_config answers with a Decision, deterministically, rejections carry a
    reason, and the resolver never picks the backend where its gate rejects."""
    config = _config(data)
    caps = machine(machine_name)
    rec = md.get_registry().snapshot().by_name(moe_backend)
    first = rec.spec.backend.supports_config(config, caps)
    assert isinstance(first, md.Decision)
    assert rec.spec.backend.supports_config(config, caps) == first
    if not first.accepted:
        assert first.reason.strip()
        with pytest.raises(md.BackendRejectedError):
            md.resolve(config, backend=moe_backend, capabilities=caps)
    else:
        assert md.resolve(config, backend=moe_backend, capabilities=caps).backend == moe_backend
