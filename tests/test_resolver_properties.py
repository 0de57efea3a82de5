"""Routing properties over random configs, random machines and random backend sets."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, strategies as st

import torch

import moe_dispatch as md
from moe_dispatch.testing.strategies import capabilities, configs, expected_choice, synthetic_specs


def _registry(specs):
    reg = md.Registry(load_entry_points=False)
    for spec in specs:
        reg.register(spec)
    return reg


@given(specs=synthetic_specs(), config=configs(), caps=capabilities())
def test_first_accepting_backend_in_priority_order(specs, config, caps):
    with md.use_registry(_registry(specs)):
        want = expected_choice(specs, config, caps)
        if want is None:
            with pytest.raises(md.NoBackendError) as err:
                md.resolve(config, capabilities=caps)
            for spec in specs:  # the error lists every backend
                assert spec.name in str(err.value)
            return
        res = md.resolve(config, capabilities=caps)
        assert res.backend == want
        names = [c.name for c in res.candidates]
        assert names == [s.name for s in sorted(specs, key=lambda s: (-s.priority, s.name))]
        before = names[:names.index(want)]
        for cand in res.candidates:
            if cand.name in before:
                assert cand.status == "rejected" and cand.reason.strip()
        assert res.chosen.decision.accepted
        assert want in res.explain()


@given(specs=synthetic_specs(min_size=2), config=configs(), caps=capabilities(),
       seed=st.integers(0, 1000))
def test_independent_of_registration_order(specs, config, caps, seed):
    shuffled = list(specs)
    random.Random(seed).shuffle(shuffled)
    outcomes = []
    for order in (specs, shuffled):
        with md.use_registry(_registry(order)):
            try:
                res = md.resolve(config, capabilities=caps)
                outcomes.append((res.backend, [(c.name, c.status, c.reason) for c in res.candidates]))
            except md.NoBackendError:
                outcomes.append(None)
    assert outcomes[0] == outcomes[1]


@given(specs=synthetic_specs(min_size=2), config=configs(), caps=capabilities(), data=st.data())
def test_exclude_and_env_disable(specs, config, caps, data):
    excluded = frozenset(data.draw(st.sets(st.sampled_from([s.name for s in specs]))))
    via_env = data.draw(st.booleans())
    with md.use_registry(_registry(specs)), pytest.MonkeyPatch.context() as monkeypatch:
        if via_env:
            monkeypatch.setenv("MOE_DISPATCH_DISABLE", ",".join(sorted(excluded)))
            kwargs = {}
        else:
            monkeypatch.delenv("MOE_DISPATCH_DISABLE", raising=False)
            kwargs = {"exclude": excluded}
        want = expected_choice(specs, config, caps, excluded)
        if want is None:
            with pytest.raises(md.NoBackendError):
                md.resolve(config, capabilities=caps, **kwargs)
        else:
            res = md.resolve(config, capabilities=caps, **kwargs)
            assert res.backend == want and res.backend not in excluded
            for cand in res.candidates:
                if cand.name in excluded:
                    assert cand.status == "excluded" and "excluded" in cand.reason


@given(specs=synthetic_specs(), config=configs(), caps=capabilities(), data=st.data())
def test_forcing_is_strict(specs, config, caps, data):
    spec = data.draw(st.sampled_from(specs))
    via_env = data.draw(st.booleans())
    kwargs = {} if via_env else {"backend": spec.name.upper()}  # names are case-insensitive
    with md.use_registry(_registry(specs)), pytest.MonkeyPatch.context() as monkeypatch:
        if via_env:
            monkeypatch.setenv("MOE_DISPATCH_BACKEND", spec.name)
        if spec.backend.gate.accepts(config, caps):
            res = md.resolve(config, capabilities=caps, **kwargs)
            assert res.backend == spec.name and res.forced == spec.name
        else:
            with pytest.raises(md.BackendRejectedError) as err:
                md.resolve(config, capabilities=caps, **kwargs)
            assert err.value.backend == spec.name and err.value.reason


def test_unknown_forced_name_lists_registered():
    specs = [md.BackendSpec("alpha", 1, _always()), md.BackendSpec("beta", 2, _always())]
    with md.use_registry(_registry(specs)):
        with pytest.raises(md.UnknownBackendError, match="nope.*beta, alpha"):
            md.resolve(md.MoEConfig(4, 1, 8, 8), backend="nope")
        with pytest.raises(md.InvalidArgumentError, match="not also excluded"):
            md.resolve(md.MoEConfig(4, 1, 8, 8), backend="alpha", exclude=["alpha"])


@given(config=configs(), caps=capabilities())
def test_real_backends_gate_consistency(config, caps):
    """With the real built-in backends: the choice is the first acceptor, and a backend
    whose gate the machine fails is never chosen."""
    res = md.resolve(config, capabilities=caps)
    idx = [c.name for c in res.candidates].index(res.backend)
    assert all(not c.decision.accepted and c.reason for c in res.candidates[:idx])
    chosen = md.get_registry().snapshot().by_name(res.backend)
    for op, _ in chosen.spec.ops:  # a backend whose declared op is absent is never chosen
        assert caps.has_op(op), (res.backend, op)
    if res.backend == "zentorch":
        assert caps.is_amd_zen
    assert "torch" in [c.name for c in res.candidates]  # the portable path is always there


@given(data=st.data())
def test_mutated_schemas_differ_and_break_the_backend_that_passes_them(data):
    """The strategy's mutation really changes a schema; when it hits an argument a backend
    passes, that backend rejects the machine with the difference named."""
    from moe_dispatch.testing import machine
    from moe_dispatch.testing.strategies import declared_ops, mutated_schema
    from moe_dispatch.kernels import schema_arguments
    ops = declared_ops()
    name = data.draw(st.sampled_from(sorted(ops)))
    changed = data.draw(mutated_schema(ops[name]))
    assert changed != ops[name] and schema_arguments(changed) != schema_arguments(ops[name])
    if name == "mkldnn::_linear_pointwise":  # onednn passes every argument of this op
        caps = machine("ice_lake").evolve(ops={**ops, name: changed})
        res = md.resolve(md.MoEConfig(8, 2, 64, 32, dtype=torch.float32), capabilities=caps)
        cand = next(c for c in res.candidates if c.name == "onednn")
        assert not cand.decision.accepted and name in cand.reason


def test_resolution_is_cached_and_deterministic():
    c = md.MoEConfig(8, 2, 64, 32)
    assert md.resolve(c) is md.resolve(c)


def _always():
    from moe_dispatch.testing.strategies import Gate, SyntheticBackend
    import torch
    return SyntheticBackend(Gate(frozenset({torch.bfloat16, torch.float32, torch.float16}), None, 1))
