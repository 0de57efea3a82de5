"""The zentorch backend, run for real on AMD Zen; elsewhere these tests skip with the reason."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import assume, given, strategies as st

import moe_dispatch as md
from helpers import (TOLERANCE, ZENTORCH_OK, ZENTORCH_WHY, assert_unchanged, random_routing,
                     random_weights, reference, rel_error, snapshot)
from moe_dispatch.testing.strategies import configs

needs_zentorch = pytest.mark.skipif(not ZENTORCH_OK, reason=f"zentorch backend unavailable: {ZENTORCH_WHY}")
pytestmark = pytest.mark.zentorch

from moe_dispatch.testing import machine  # noqa: E402
from moe_dispatch_backends.zentorch import ZentorchBackend, schema_problem  # noqa: E402

REAL = md.Capabilities.detect()
# A simulated Zen 4 with the op schemas the backends were written for (the support
# matrix's machine definition), so these gate tests run on any machine.
ZEN4 = machine("zen4")
BF16_SILU = md.MoEConfig(64, 8, 256, 96)
# The dtypes the real op is accepted for on this machine (bf16 needs AVX512-BF16).
ZEN_DTYPES = [dt for dt in (torch.bfloat16, torch.float32)
              if ZentorchBackend().supports_config(md.MoEConfig(8, 2, 64, 32, dtype=dt), REAL).accepted]


def _decide(config, caps):
    return ZentorchBackend().supports_config(config, caps)


# -- gates (simulated machines: these run everywhere) ------------------------------------
def test_accepts_bf16_silu_on_zen():
    assert _decide(BF16_SILU, ZEN4).accepted


def test_missing_op_rejects_with_install_hint():
    d = _decide(BF16_SILU, ZEN4.evolve(ops={}))
    assert not d.accepted and "zentorch::zentorch_fused_moe is not registered" in d.reason
    assert "install zentorch==2.13.0.2" in d.reason


def test_switched_off_by_its_env_variable(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_NO_ZENTORCH", "1")
    d = _decide(BF16_SILU, ZEN4)
    assert not d.accepted and "MOE_DISPATCH_NO_ZENTORCH" in d.reason


def test_resolution_cache_sees_a_changed_gate_variable(monkeypatch):
    """The gate reads ZENDNNL_MATMUL_WEIGHT_CACHE; it is declared in BackendSpec.env_vars, so a
    change after a first resolution is seen by the next one (it used to be served stale)."""
    monkeypatch.delenv("ZENDNNL_MATMUL_WEIGHT_CACHE", raising=False)
    assert md.resolve(BF16_SILU, capabilities=ZEN4).backend == "zentorch"
    monkeypatch.setenv("ZENDNNL_MATMUL_WEIGHT_CACHE", "0")
    res = md.resolve(BF16_SILU, capabilities=ZEN4)
    assert res.backend != "zentorch" and "ZENDNNL_MATMUL_WEIGHT_CACHE=0" in res.explain()


def test_bf16_needs_avx512_bf16():
    d = _decide(BF16_SILU, md.Capabilities.preset("zen3", ops=dict(ZEN4.ops)))
    assert not d.accepted and "AVX512-BF16" in d.reason
    fp32 = md.MoEConfig(64, 8, 256, 96, dtype=torch.float32)
    assert _decide(fp32, md.Capabilities.preset("zen3", ops=dict(ZEN4.ops))).accepted


def test_vllm_layers_leave_it_out_only_where_it_slowed_the_engine():
    """Measured per kind of CPU (docs/vllm.md): inside vLLM's worker it slowed the engine on
    a Zen 3, made it faster on a Zen 4; Zen 1, not measured, keeps Zen 3's answer."""
    from moe_dispatch_backends.zentorch import avoided_hosts

    zen3 = md.Capabilities.preset("zen3")
    zen1 = zen3.evolve(cpu_model="AMD EPYC 7601", cpu_family=0x17, cpu_model_id=0x01, zen_generation=1)
    assert avoided_hosts(md.Capabilities.preset("zen4")) == ()
    assert avoided_hosts(md.Capabilities.preset("zen5")) == ()
    assert avoided_hosts(zen3) == avoided_hosts(zen1) == ("vllm",)
    assert avoided_hosts(md.Capabilities.preset("zen4").evolve(avx512=False, avx512_bw_vl=False,
                                                               avx512_bf16=False, avx512_vnni=False)) == ("vllm",)


def test_schema_mismatch_rejects_naming_the_difference():
    schema = ZEN4.op_schema("zentorch::zentorch_fused_moe")
    changed = schema.replace("Tensor topk_id,", "Tensor topk_ids,")
    d = _decide(BF16_SILU, ZEN4.evolve(ops={"zentorch::zentorch_fused_moe": changed}))
    assert not d.accepted and "different signature" in d.reason and "topk_ids" in d.reason
    assert schema_problem(schema) is None
    extra = schema.replace("str act,", "str act, int new_required,")
    assert "new_required" in schema_problem(extra)


@pytest.mark.parametrize("preset", ["sapphire_rapids", "ice_lake", "neoverse_v1"])
def test_non_zen_cpu_rejects(preset):
    caps = md.Capabilities.preset(preset, ops=dict(ZEN4.ops))
    d = _decide(BF16_SILU, caps)
    assert not d.accepted and "AMD Zen" in d.reason


def test_activation_and_dtype_gates():
    fp32 = dict(dtype=torch.float32)
    for act in ("gelu_tanh", "swigluoai"):
        d = _decide(md.MoEConfig(8, 2, 64, 32, activation=act, **fp32), ZEN4)
        assert not d.accepted and "bfloat16 only" in d.reason
        assert _decide(md.MoEConfig(8, 2, 64, 32, activation=act), ZEN4).accepted
    for act in ("silu", "gelu"):
        assert _decide(md.MoEConfig(8, 2, 64, 32, activation=act, **fp32), ZEN4).accepted
    d = _decide(md.MoEConfig(8, 2, 64, 32, dtype=torch.float16), ZEN4)
    assert not d.accepted and "avx512fp16" in d.reason
    assert _decide(md.MoEConfig(8, 2, 64, 32, dtype=torch.float16), ZEN4.evolve(avx512_fp16=True)).accepted


def test_cache_mode_zero_rejected(monkeypatch):
    monkeypatch.setenv("ZENDNNL_MATMUL_WEIGHT_CACHE", "0")
    d = _decide(BF16_SILU, ZEN4)
    assert not d.accepted and "ZENDNNL_MATMUL_WEIGHT_CACHE=0" in d.reason


# -- the real op -------------------------------------------------------------------------
def _zen_config_ok(config):
    return ZentorchBackend().supports_config(config, REAL).accepted


@needs_zentorch
def test_resolution_on_this_machine_picks_zentorch_and_explains():
    for dtype in ZEN_DTYPES:
        res = md.resolve(md.MoEConfig(64, 8, 256, 96, dtype=dtype))
        assert res.backend == "zentorch"
        text = res.explain()
        assert "zentorch" in text and "chosen" in text and "AMD Zen" in text
    if torch.bfloat16 not in ZEN_DTYPES:  # e.g. Zen 3: bf16 must not reach the op
        res = md.resolve(BF16_SILU)
        assert res.backend != "zentorch" and "AVX512-BF16" in res.explain()


@needs_zentorch
@given(config=configs(max_experts=128, max_hidden=96, max_inter=64, min_hidden=16, min_inter=8,
                      dtypes=(torch.bfloat16, torch.float32)),
       tokens=st.sampled_from((1, 3, 17, 300)), seed=st.integers(0, 10_000))
def test_parity_with_reference(config, tokens, seed):
    assume(_zen_config_ok(config))
    weights = random_weights(config, seed)
    before = snapshot(weights)
    x, tw, ids = random_routing(config, tokens, seed)
    layer = md.MoELayer(config, backend="zentorch").load_weights(**weights).prepare()
    out = layer(x, tw, ids)
    assert out.shape == x.shape and out.dtype == config.dtype
    assert rel_error(out, reference(config, weights, x, tw, ids)) <= TOLERANCE[config.dtype]
    assert_unchanged(weights, before)


@needs_zentorch
@pytest.mark.parametrize("dtype", ZEN_DTYPES)
def test_callers_weights_byte_identical_after_many_forwards(dtype):
    cfg = md.MoEConfig(16, 4, 128, 64, dtype=dtype, has_bias=True)
    weights = random_weights(cfg)
    before = snapshot(weights)
    layer = md.MoELayer(cfg, backend="zentorch").load_weights(**weights).prepare()
    assert_unchanged(weights, before)
    for step in range(20):
        layer(*random_routing(cfg, 1 + 7 * step, seed=step))
    assert_unchanged(weights, before)


@needs_zentorch
@pytest.mark.parametrize("dtype", ZEN_DTYPES)
def test_two_layers_and_a_layer_after_a_freed_one(dtype):
    cfg = md.MoEConfig(8, 2, 256, 128, dtype=dtype)
    x, tw, ids = random_routing(cfg, 5)
    w_a, w_b = random_weights(cfg, 1), random_weights(cfg, 2)
    a = md.MoELayer(cfg, backend="zentorch").load_weights(**w_a).prepare()
    b = md.MoELayer(cfg, backend="zentorch").load_weights(**w_b).prepare()
    for layer, w in ((a, w_a), (b, w_b), (a, w_a)):
        assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]
    # Free layers repeatedly, allocating same-shaped fresh ones: the allocator hands the
    # same addresses back, which the op's address-keyed cache would serve stale.
    for seed in range(3, 9):
        del a
        gc.collect()
        w = random_weights(cfg, seed)
        a = md.MoELayer(cfg, backend="zentorch").load_weights(**w).prepare()
        assert rel_error(a(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]


def test_the_ledger_finds_unseen_addresses_for_many_same_shaped_copies(monkeypatch):
    """Each copy prepared and freed burns the addresses the allocator hands the next one
    of its size; one start per allocation ran out at the 86th copy of a shape (the flaky
    "could not allocate a weight buffer" of test_two_layers_and_a_layer_after_a_freed_one).
    No zentorch needed: the ledger alone."""
    from moe_dispatch_backends.zentorch import _ledger

    monkeypatch.setattr(_ledger, "_BURNED", set())
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(8, 64, 32).to(dtype)
        for _ in range(150):
            copy = _ledger.private_copy(t)
            assert copy.is_contiguous() and copy.data_ptr() % _ledger.ALIGN == 0
            assert not (_ledger._addresses(copy) & _ledger._BURNED) and torch.equal(copy, t)
            _ledger.burn(copy)
            del copy  # freed now: the next allocation of its size gets its address back


@needs_zentorch
@pytest.mark.parametrize("dtype", ZEN_DTYPES)
def test_in_place_update_detected_then_prepare_gives_fresh_numbers(dtype):
    cfg = md.MoEConfig(8, 2, 128, 64, dtype=dtype)
    w = random_weights(cfg)
    layer = md.MoELayer(cfg, backend="zentorch").load_weights(**w).prepare()
    x, tw, ids = random_routing(cfg, 4)
    layer(x, tw, ids)
    w["w2"].copy_(random_weights(cfg, 9)["w2"])
    with pytest.raises(md.WeightsModifiedError):
        layer(x, tw, ids)
    layer.prepare()
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]


@needs_zentorch
def test_non_contiguous_inputs_and_views():
    cfg = md.MoEConfig(8, 2, 128, 64, dtype=torch.float32)
    w = random_weights(cfg)
    strided = {k: v.transpose(-1, -2).contiguous().transpose(-1, -2) if v is not None else None
               for k, v in w.items()}
    layer = md.MoELayer(cfg, backend="zentorch").load_weights(**strided).prepare()
    x, tw, ids = random_routing(cfg, 9)
    big = torch.randn(9, 256)
    big[:, ::2] = x
    out = layer(big[:, ::2], tw.t().contiguous().t(), ids.to(torch.int64).t().contiguous().t())
    assert rel_error(out, reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@needs_zentorch
@pytest.mark.parametrize("dtype", ZEN_DTYPES)
def test_duplicate_ids_computed_exactly(dtype):
    cfg = md.MoEConfig(6, 3, 64, 32, dtype=dtype)
    w = random_weights(cfg)
    layer = md.MoELayer(cfg, backend="zentorch").load_weights(**w).prepare()
    x = torch.randn(4, 64).to(dtype)
    ids = torch.tensor([[1, 1, 2], [0, 3, 5], [4, 4, 4], [2, 5, 2]], dtype=torch.int32)
    tw = torch.rand(4, 3)
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]
    assert ids.tolist()[0] == [1, 1, 2]  # the caller's ids are not rewritten


@needs_zentorch
def test_router_weight_on_input_maps_to_skip_weighted():
    cfg = md.MoEConfig(16, 1, 64, 32, apply_router_weight_on_input=True, dtype=torch.float32)
    w = random_weights(cfg)
    layer = md.MoELayer(cfg).load_weights(**w).prepare()
    assert layer.backend == "zentorch"
    x, tw, ids = random_routing(cfg, 11)
    tw = tw * 0.7  # not 1: the weight must really scale the input
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@needs_zentorch
def test_zero_tokens_never_reach_the_op():
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=ZEN_DTYPES[-1])
    layer = md.MoELayer(cfg, backend="zentorch").load_weights(**random_weights(cfg)).prepare()
    out = layer(torch.empty(0, 64, dtype=cfg.dtype), torch.empty(0, 2),
                torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, 64)


@needs_zentorch
@pytest.mark.parametrize("dtype", ZEN_DTYPES)
@pytest.mark.parametrize("native", [True, False], ids=["entry", "python"])
def test_a_thread_count_change_after_prepare(dtype, native):
    """The op keys (and, in bf16, reorders in place) its weights for the thread count of its
    first call: prepared at 1 thread, called at 2 or from a fresh thread, it failed closed
    and the layer demoted it. Each call runs with the count of prepare()."""
    import threading
    cfg = md.MoEConfig(8, 2, 128, 256, dtype=dtype)
    w = random_weights(cfg, seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = md.MoELayer(cfg, backend="zentorch").load_weights(**w).prepare()
        x, tw, ids = random_routing(cfg, 40, seed=1)
        want = layer.run(x, tw, ids, native=native)
        torch.set_num_threads(2)
        assert torch.equal(layer.run(x, tw, ids, native=native), want)
        got = []
        thread = threading.Thread(target=lambda: got.append(layer.run(x, tw, ids, native=native)))
        thread.start(), thread.join()
        assert len(got) == 1 and torch.equal(got[0], want) and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_OFF_THEN_ON = """
import os, torch
os.environ["MOE_DISPATCH_NO_ZENTORCH"] = "1"
import moe_dispatch as md
cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
zen = lambda: next(c for c in md.resolve(cfg).candidates if c.name == "zentorch").decision
print(zen().accepted, "MOE_DISPATCH_NO_ZENTORCH" in zen().reason)
del os.environ["MOE_DISPATCH_NO_ZENTORCH"]
print(zen().accepted, zen().reason)
"""


@pytest.mark.skipif(not ZENTORCH_OK, reason=ZENTORCH_WHY)
def test_the_off_switch_is_read_at_each_resolution():
    """MOE_DISPATCH_NO_ZENTORCH set at start, then unset in the same process: zentorch comes
    back (its 'off' answer was cached for the process, still quoting the variable as set)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", _OFF_THEN_ON], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = run.stdout.strip().splitlines()[-2:]
    assert first == "False True" and second.startswith("True"), run.stdout
