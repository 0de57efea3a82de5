"""The native backend (moe-dispatch's own fused decode kernel): its gates on simulated
machines everywhere; on every build this CPU runs, for real: ids checked before any weight is
read, the caller's tensors, the native entry, threads, the two builds side by side and the
routing around its token limit. Its numbers against the float64 reference:
test_native_numerics.py (test layers: native_layers.py). ``MOE_DISPATCH_NATIVE_ISA`` selects a
build, so the AVX2 build runs on AVX-512 machines too."""

from __future__ import annotations

import gc

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, machine, random_routing, random_weights, rel_error, thread_disagreements

from helpers import assert_unchanged, snapshot
from moe_dispatch_backends.native import ERROR_BOUND, MAX_TOKENS, NativeBackend, kernel
from native_layers import (BUILDS, EACH_FORMAT, SCHEMES, ZEN3, ZEN4, build, check_layer,  # noqa: F401  (build: a fixture)
                           layer_config, native_layer, require_build)


# -- gates (simulated machines: everywhere) ------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gate_picks_the_widest_build_the_cpu_runs(scheme, monkeypatch):
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    assert "the avx2 build" in NativeBackend().supports_config(layer_config(scheme), ZEN3).reason
    assert "the avx512 build" in NativeBackend().supports_config(layer_config(scheme), ZEN4).reason
    # AVX-512 without BF16 (an Ice Lake) runs the AVX2 build: the avx512 one is compiled for
    # AVX512-BF16.
    assert "the avx2 build" in NativeBackend().supports_config(layer_config(scheme), machine("ice_lake")).reason


def test_gate_rejects_what_the_kernel_cannot_run(monkeypatch):
    cases = [
        (layer_config(dtype=torch.float32), ZEN3, "streams bfloat16 weights"),
        (layer_config(dtype=torch.float16), ZEN3, "streams bfloat16 weights"),
        (layer_config(md.QuantScheme("int8"), dtype=torch.float16), ZEN3, "bfloat16 or float32 activations"),
        (layer_config(), machine("neoverse_v1"), "x86_64 with AVX2, FMA and F16C"),
        (layer_config(), ZEN3.evolve(fma_f16c=False), "fma_f16c=False"),
    ]
    for cfg, caps, why in cases:
        d = NativeBackend().supports_config(cfg, caps)
        assert not d.accepted and why in d.reason, (cfg.describe(), d.reason)
    assert NativeBackend().supports_config(layer_config(md.QuantScheme("int8"), dtype=torch.float32), ZEN3).accepted


def test_the_isa_switch_and_the_off_switch(monkeypatch):
    monkeypatch.setenv(kernel.ISA_ENV, "avx2")
    assert "the avx2 build (MOE_DISPATCH_NATIVE_ISA)" in NativeBackend().supports_config(layer_config(), ZEN4).reason
    monkeypatch.setenv(kernel.ISA_ENV, "avx512")
    d = NativeBackend().supports_config(layer_config(), ZEN3)
    assert not d.accepted and "lacks the avx512 build's instructions" in d.reason
    monkeypatch.setenv(kernel.ISA_ENV, "sse")
    d = NativeBackend().supports_config(layer_config(), ZEN4)
    assert not d.accepted and "expected one of avx2, avx512" in d.reason
    monkeypatch.delenv(kernel.ISA_ENV)
    monkeypatch.setenv(kernel.SWITCH, "0")
    d = NativeBackend().supports_config(layer_config(), ZEN4)
    assert not d.accepted and "the native backend is off" in d.reason


def test_a_build_that_fails_is_a_rejection_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernel, "load", lambda isa: None)
    monkeypatch.setattr(kernel, "status", lambda isa: "unavailable: build failed (no compiler)")
    w = random_weights(layer_config())
    d = NativeBackend().supports_layer(md.LayerWeights(layer_config(), w["w13"], w["w2"]), ZEN3)
    assert not d.accepted and "build failed (no compiler)" in d.reason


def test_max_tokens_is_declared_and_validated():
    spec = next(r.spec for r in md.get_registry().snapshot().records if r.name == "native")
    assert spec.token_limit("float") == MAX_TOKENS
    assert spec.serves(MAX_TOKENS) and not spec.serves(MAX_TOKENS + 1)
    assert spec.serves(10_000, "int8") and spec.serves(10_000, "int4")  # quantized: no limit
    with pytest.raises(ValueError, match="max_tokens=0"):
        md.BackendSpec("x", 1, NativeBackend(), max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens=.'int9': 4.*expected formats"):
        md.BackendSpec("x", 1, NativeBackend(), max_tokens={"int9": 4})
    with pytest.raises(ValueError, match="max_tokens=.'int8': 0"):
        md.BackendSpec("x", 1, NativeBackend(), max_tokens={"int8": 0})


# -- the kernel, for real --------------------------------------------------------------------
def test_zero_tokens_repeated_ids_and_bad_ids(build):
    cfg = layer_config(md.QuantScheme("int4", group_size=32))
    layer, ref_w, _ = native_layer(cfg)
    x = torch.randn(0, cfg.hidden_size).to(cfg.dtype)
    assert layer(x, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32)).shape == (0, cfg.hidden_size)
    x = torch.randn(3, cfg.hidden_size).to(cfg.dtype)
    tw, ids = torch.rand(3, 2), torch.tensor([[1, 1], [0, 7], [5, 5]])
    want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids)
    assert rel_error(layer(x, tw, ids), want) <= ERROR_BOUND  # a repeated id counts twice
    for bad in (8, -1):
        with pytest.raises(md.InvalidArgumentError, match="topk_ids"):
            layer(x, tw, torch.tensor([[0, bad]] * 3))
    # The kernel itself refuses an id out of range before it reads any weight, at every
    # thread count (the blocks route inside the team, while the other threads read ahead:
    # they must stop, and the next call runs), both sides of 16 inputs.
    experts = layer.plan.route.state.experts
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (3, 17):
                xr, twr = torch.randn(rows, cfg.hidden_size).to(cfg.dtype), torch.rand(rows, 2)
                with pytest.raises(IndexError, match="outside"):
                    experts.forward(xr, twr, torch.tensor([[0, 8]] * rows, dtype=torch.int32), False)
                # ids with no columns: no pair, so no active expert to read ahead of; zeros.
                none = experts.forward(xr, twr[:, :0], torch.zeros(rows, 0, dtype=torch.int32), False)
                assert torch.equal(none, torch.zeros_like(xr)), (threads, rows)
            assert rel_error(layer(x, tw, ids), want) <= ERROR_BOUND
    finally:
        torch.set_num_threads(before)


def test_caller_tensors_untouched_and_in_place_updates_detected(build):
    for scheme in (None, md.QuantScheme("int8", group_size=32)):
        cfg = layer_config(scheme, has_bias=True)
        layer, ref_w, loaded = native_layer(cfg)
        tensors = loaded if scheme is None else {n: t for n, t in md.LayerWeights(
            cfg, loaded.w13.qweight, loaded.w2.qweight, quantized=loaded).tensors()}
        before = snapshot(tensors)
        check_layer(layer, cfg, ref_w, 4)
        assert_unchanged(tensors, before)
        target = loaded["w13"] if scheme is None else loaded.w13.scales
        target.mul_(2)
        x, tw, ids = random_routing(cfg, 2)
        with pytest.raises(md.WeightsModifiedError):
            layer(x, tw, ids)


@EACH_FORMAT
def test_the_result_does_not_depend_on_the_kernels_thread_count(build, scheme):
    # Step 2's items go to threads in chunks, a thread that is done taking chunks from
    # another's range (team.h, Shares): every item must run whoever takes it (a lost one
    # leaves its units zero). Expert 0 is in every row, so the items of the thread that holds
    # it cost more and the others take from its range; H=2048 makes a chunk one item (bf16,
    # int8) or two (int4), so there are chunks to take. Each output sums in one order, so the
    # result is bit for bit the one-thread result at any thread count. 12 and 20 tokens: the
    # blocks' two schedules of steps 0-2 (forward_blocks.h: up to 16 inputs thread 0 makes
    # them while the others read ahead and then start step 2; above, a step of their own).
    cfg = layer_config(scheme, has_bias=True, hidden_size=2048)
    layer, ref_w, _ = native_layer(cfg)
    before = torch.get_num_threads()
    for tokens in (12, 20):
        x, tw, _ = random_routing(cfg, tokens, seed=6)
        ids = torch.tensor([[0, 1 + t % 7] for t in range(tokens)])
        try:
            torch.set_num_threads(1)
            serial = layer(x, tw, ids)
            for threads in (2, 3, 4):
                torch.set_num_threads(threads)
                for _ in range(3):
                    assert torch.equal(layer(x, tw, ids), serial), (tokens, threads)
        finally:
            torch.set_num_threads(before)
        want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids, ref_w.get("w13_bias"),
                             ref_w.get("w2_bias"))
        bound = TOLERANCE[torch.bfloat16] if scheme is None else ERROR_BOUND
        assert rel_error(serial, want) <= bound, tokens


def test_eight_threads_agree_with_the_serial_result(build):
    cfg = layer_config(md.QuantScheme("int8"))
    layer, _, _ = native_layer(cfg)
    inputs = [random_routing(cfg, t, seed=t) for t in (1, 2, 3, 8)]
    assert thread_disagreements(layer, inputs) == []


def test_the_native_entry_gives_the_python_paths_numbers(build):
    cfg = layer_config(None, apply_router_weight_on_input=True, top_k=1)
    layer, _, _ = native_layer(cfg)
    x, tw, ids = random_routing(cfg, 3)
    ids, tw = ids.to(torch.int32).contiguous(), tw.float().contiguous()
    entry = layer.plan.native_for(x)
    assert entry is not None
    fast = entry[0](x, tw, ids)
    assert fast is not None and torch.equal(fast, layer.plan.route.apply(layer.plan.route.state, x, tw, ids))


def test_the_entry_is_a_cpython_function_that_owns_its_kernel(build):
    """The toolkit's entry_function: three positional arguments or a TypeError that says so,
    None for a call that is not plain, and its own reference to the kernel's state (it runs
    after the layer that made it is gone)."""
    cfg = layer_config(None)
    layer, _, _ = native_layer(cfg)
    x, tw, ids = random_routing(cfg, 2)
    ids, tw = ids.to(torch.int32).contiguous(), tw.float().contiguous()
    entry = layer.plan.native
    assert entry.__name__ == "native_entry"
    expected = entry(x, tw, ids)
    with pytest.raises(TypeError, match=r"3 arguments \(hidden_states, topk_weights, topk_ids\), got 2"):
        entry(x, tw)
    with pytest.raises(TypeError, match="keyword"):
        entry(x, tw, topk_ids=ids)
    assert entry(x.float(), tw, ids) is None
    # int64 ids and bf16 / float64 router weights: converted in the entry as the Python path
    # converts them (ids after their range check: 2**32 + 1 would be 1 as int32).
    assert torch.equal(entry(x, tw, ids.long()), expected)
    assert torch.equal(entry(x, tw.double(), ids.long()), expected)
    assert torch.equal(entry(x, tw.bfloat16(), ids), entry(x, tw.bfloat16().float(), ids))
    past = ids.long()
    past[1, 0] += 2**32
    assert entry(x, tw, past) is None
    del layer
    gc.collect()
    assert torch.equal(entry(x, tw, ids), expected)


def test_both_builds_agree_where_both_run():
    if len(BUILDS) < 2:
        pytest.skip(f"this CPU runs only {BUILDS or 'no'} build(s) of the kernel")
    for isa in BUILDS:
        require_build(isa)
    for scheme in SCHEMES:
        cfg = layer_config(scheme)
        outs = []
        for isa in BUILDS:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(kernel.ISA_ENV, isa)
                layer, _, _ = native_layer(cfg)
                x, tw, ids = random_routing(cfg, 4)
                outs.append(layer(x, tw, ids).float())
        # The same integer dots (int8 / int4), or fp32-precise sums of bf16 weights (the
        # avx512 build's vdpbf16ps dots each input's bf16 remainder too): what differs is the
        # order of the fp32 sums, then the bf16 rounding of the outputs.
        assert rel_error(outs[0], outs[1].double()) <= 1e-3, scheme


def test_priority_routes_large_token_counts_past_the_kernel(build):
    """Under "priority" the native backend serves T <= MAX_TOKENS and the next backend
    without a limit serves the rest (and "auto" never routes it beyond its limit)."""
    cfg = layer_config()
    w = random_weights(cfg)
    for policy in ("priority", "auto"):
        # zentorch (priority 400) takes bf16 where AVX512-BF16 is: left out so that this
        # runs on every machine with the kernel.
        layer = md.MoELayer(cfg, policy=policy, tuning_cache=False, exclude=["zentorch"])
        layer.load_weights(**w).prepare()
        if layer.backend != "native":
            pytest.skip(f"the resolver chose {layer.backend} here")
        assert layer.plan.route_for(1).name == "native" or policy == "auto"
        assert layer.plan.route_for(MAX_TOKENS + 1).name != "native"
        assert layer.plan.route_for(10_000).name != "native"


def test_quantized_weights_have_no_token_limit(build):
    """int8 / int4: "priority" keeps the native kernel at every T (no other quantized path
    was faster beyond decode), and "auto" times it at every bucket."""
    cfg = layer_config(md.QuantScheme("int8"))
    _, ref_w, qe = native_layer(cfg)
    priority = md.MoELayer(cfg, policy="priority", tuning_cache=False, exclude=["zentorch"])
    priority.load_weights(qe).prepare()
    if priority.backend != "native":
        pytest.skip(f"the resolver chose {priority.backend} here")
    assert priority.plan.table is None  # one route for every T: no limit to route around
    check_layer(priority, cfg, ref_w, MAX_TOKENS + 17)
    auto = md.MoELayer(cfg, policy="auto", tuning_cache=False, tune_max_tokens=64, exclude=["zentorch"])
    auto.load_weights(qe).prepare()
    assert "native" in auto.plan.tuned[64]["ms"]  # timed at the largest bucket
