"""The native backend (moe-dispatch's own fused decode kernel): its gates on simulated
machines everywhere; every build this CPU can run, for real, against the float64 reference.

bf16 weights are checked within the bf16 tolerance; int8 / int4 weights within
``ERROR_BOUND`` of the reference computed on the dequantized weights (the kernel quantizes
its activations per 32 values as well, x per 128 above 16 tokens in the blocked layout;
tests/test_native_blocks.py holds layers of a model's size to ``AIM_BOUND``). ``MOE_DISPATCH_NATIVE_ISA`` selects a build, so
the AVX2 build runs on AVX-512 machines too."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, machine, random_routing, random_weights, rel_error, thread_disagreements
from moe_dispatch.testing.strategies import quant_schemes

from helpers import assert_unchanged, snapshot
from moe_dispatch_backends.native import ERROR_BOUND, MAX_TOKENS, NativeBackend, kernel  # noqa: E402

HERE = md.Capabilities.detect()
BUILDS = [isa for isa in kernel.ISAS if kernel.runs(isa, HERE)]
ZEN3, ZEN4 = machine("zen3"), machine("zen4")
SCHEMES = [None, md.QuantScheme("int8"), md.QuantScheme("int8", group_size=32),
           md.QuantScheme("int4", group_size=32), md.QuantScheme("int4", group_size=128),
           md.QuantScheme("int4", group_size=64, symmetric=False)]

# One scheme per weight format (bf16, int8, int4) and per schedule (rows, blocks of both kinds).
EACH_FORMAT = pytest.mark.parametrize(
    "scheme", [None, md.QuantScheme("int8"), md.QuantScheme("int4", group_size=32)],
    ids=lambda s: "bf16" if s is None else s.describe())


def _cfg(scheme=None, **kw):
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    base.update(kw)
    return md.MoEConfig(**base, weight_scheme=scheme)


def _built(isa):
    module = kernel.load(isa)
    if module is None:
        pytest.skip(f"the native kernel's {isa} build is unavailable: {kernel.status(isa)}")


@pytest.fixture(params=BUILDS or ["none"])
def build(request, monkeypatch):
    """Each build this CPU runs, selected as a user would (MOE_DISPATCH_NATIVE_ISA)."""
    if request.param == "none":
        pytest.skip(f"this CPU runs no build of the native kernel: {kernel.isa_for(HERE)[1]}")
    monkeypatch.setenv(kernel.ISA_ENV, request.param)
    _built(request.param)
    return request.param


def _layer(cfg, seed=1):
    """A forced native layer and the float weights its reference uses (dequantized)."""
    fcfg = _cfg(None, **{k: getattr(cfg, k) for k in
                         ("num_experts", "top_k", "hidden_size", "intermediate_size", "activation",
                          "apply_router_weight_on_input", "has_bias")}, )
    w = {k: v for k, v in random_weights(fcfg, seed=seed).items() if v is not None}
    layer = md.MoELayer(cfg, backend="native")
    if cfg.weight_scheme is None:
        w = {k: v.to(cfg.dtype) for k, v in w.items()}
        layer.load_weights(**w)
        return layer.prepare(), w, w
    bias = {k: w[k].to(cfg.dtype) for k in ("w13_bias", "w2_bias") if k in w}
    qe = md.quantize_experts(w["w13"].float(), w["w2"].float(), cfg.weight_scheme, **bias)
    d13, d2 = qe.dequantize()
    layer.load_weights(qe)
    return layer.prepare(), dict(w13=d13, w2=d2, **bias), qe


def _check(layer, cfg, ref_w, tokens, seed=2):
    x, tw, ids = random_routing(cfg, tokens, seed=seed)
    out = layer(x, tw, ids)
    assert out.dtype == cfg.dtype and out.shape == x.shape
    want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids, ref_w.get("w13_bias"),
                         ref_w.get("w2_bias"))
    bound = TOLERANCE[torch.bfloat16] if cfg.weight_scheme is None else ERROR_BOUND
    err = rel_error(out, want)
    assert err <= bound, (cfg.describe(), tokens, err)
    return err


# -- gates (simulated machines: everywhere) ------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gate_picks_the_widest_build_the_cpu_runs(scheme, monkeypatch):
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    assert "the avx2 build" in NativeBackend().supports_config(_cfg(scheme), ZEN3).reason
    assert "the avx512 build" in NativeBackend().supports_config(_cfg(scheme), ZEN4).reason
    # AVX-512 without BF16 (an Ice Lake) runs the AVX2 build: the avx512 one is compiled for
    # AVX512-BF16.
    assert "the avx2 build" in NativeBackend().supports_config(_cfg(scheme), machine("ice_lake")).reason


def test_gate_rejects_what_the_kernel_cannot_run(monkeypatch):
    cases = [
        (_cfg(dtype=torch.float32), ZEN3, "streams bfloat16 weights"),
        (_cfg(dtype=torch.float16), ZEN3, "streams bfloat16 weights"),
        (_cfg(md.QuantScheme("int8"), dtype=torch.float16), ZEN3, "bfloat16 or float32 activations"),
        (_cfg(), machine("neoverse_v1"), "x86_64 with AVX2, FMA and F16C"),
        (_cfg(), ZEN3.evolve(fma_f16c=False), "fma_f16c=False"),
    ]
    for cfg, caps, why in cases:
        d = NativeBackend().supports_config(cfg, caps)
        assert not d.accepted and why in d.reason, (cfg.describe(), d.reason)
    assert NativeBackend().supports_config(_cfg(md.QuantScheme("int8"), dtype=torch.float32), ZEN3).accepted


def test_the_isa_switch_and_the_off_switch(monkeypatch):
    monkeypatch.setenv(kernel.ISA_ENV, "avx2")
    assert "the avx2 build (MOE_DISPATCH_NATIVE_ISA)" in NativeBackend().supports_config(_cfg(), ZEN4).reason
    monkeypatch.setenv(kernel.ISA_ENV, "avx512")
    d = NativeBackend().supports_config(_cfg(), ZEN3)
    assert not d.accepted and "lacks the avx512 build's instructions" in d.reason
    monkeypatch.setenv(kernel.ISA_ENV, "sse")
    d = NativeBackend().supports_config(_cfg(), ZEN4)
    assert not d.accepted and "expected one of avx2, avx512" in d.reason
    monkeypatch.delenv(kernel.ISA_ENV)
    monkeypatch.setenv(kernel.SWITCH, "0")
    d = NativeBackend().supports_config(_cfg(), ZEN4)
    assert not d.accepted and "the native backend is off" in d.reason


def test_a_build_that_fails_is_a_rejection_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernel, "load", lambda isa: None)
    monkeypatch.setattr(kernel, "status", lambda isa: "unavailable: build failed (no compiler)")
    w = random_weights(_cfg())
    d = NativeBackend().supports_layer(md.LayerWeights(_cfg(), w["w13"], w["w2"]), ZEN3)
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
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "bf16" if s is None else s.describe())
@pytest.mark.parametrize("activation", list(md.Activation), ids=str)
def test_every_format_and_activation_matches_the_reference(build, scheme, activation):
    for on_input, top_k, bias in ((False, 2, True), (True, 1, False)):
        cfg = _cfg(scheme, activation=activation, top_k=top_k, apply_router_weight_on_input=on_input,
                   has_bias=bias)
        layer, ref_w, _ = _layer(cfg)
        for tokens in (1, 5, 33):  # 33: above max_tokens, forced: still exact
            _check(layer, cfg, ref_w, tokens, seed=tokens)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_shapes_including_odd_sizes(build, data):
    """H and I need not be multiples of anything for bf16 and per-channel int8 (the kernel
    pads the reduction axis); grouped schemes take multiples of their group."""
    scheme = data.draw(st.one_of(st.none(), quant_schemes()))
    if scheme is None:
        h, i = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 200))
    elif scheme.group_size is None:
        # Quantized activations bound the error relative to the magnitudes summed, not to the
        # sum: with a handful of values (H=1, I=11) one output can cancel to near zero, so
        # the relative bound is drawn on sizes of at least two blocks (odd ones included; one
        # expert, one token, H=I=32 and gelu measured 2.2e-2: 32 outputs of one block each).
        h, i = data.draw(st.integers(64, 300)), data.draw(st.integers(64, 200))
    else:
        g = scheme.group_size
        h, i = g * data.draw(st.integers(1, 3)), g * data.draw(st.integers(1, 2))
    experts = data.draw(st.integers(1, 12))
    dtype = torch.bfloat16 if scheme is None else data.draw(st.sampled_from([torch.bfloat16, torch.float32]))
    cfg = md.MoEConfig(experts, data.draw(st.integers(1, min(4, experts))), h, i,
                       activation=data.draw(st.sampled_from(list(md.Activation))), dtype=dtype,
                       weight_scheme=scheme, has_bias=data.draw(st.booleans()))
    layer, ref_w, _ = _layer(cfg, seed=data.draw(st.integers(0, 1000)))
    _check(layer, cfg, ref_w, data.draw(st.integers(1, 20)))


@pytest.mark.parametrize("scheme", [md.QuantScheme("int4", group_size=32, symmetric=False),
                                    md.QuantScheme("int4", group_size=32),
                                    md.QuantScheme("int4", group_size=64, symmetric=False)],
                         ids=lambda s: s.describe())
def test_int4_zero_point_term_over_eight_groups_a_vector_and_the_rest(build, scheme):
    """The zero-point term of an int4 row is summed eight groups a vector and the remainder
    one at a time: 11 and 3 groups of 32 (H=352, I=96; an odd block count too), 10 and 3 of 64."""
    g = scheme.group_size
    cfg = _cfg(scheme, hidden_size=11 * 32 if g == 32 else 10 * 64, intermediate_size=3 * g)
    layer, ref_w, _ = _layer(cfg)
    for tokens in (1, 2, 5):
        _check(layer, cfg, ref_w, tokens)


def test_zero_tokens_repeated_ids_and_bad_ids(build):
    cfg = _cfg(md.QuantScheme("int4", group_size=32))
    layer, ref_w, _ = _layer(cfg)
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
        cfg = _cfg(scheme, has_bias=True)
        layer, ref_w, loaded = _layer(cfg)
        tensors = loaded if scheme is None else {n: t for n, t in md.LayerWeights(
            cfg, loaded.w13.qweight, loaded.w2.qweight, quantized=loaded).tensors()}
        before = snapshot(tensors)
        _check(layer, cfg, ref_w, 4)
        assert_unchanged(tensors, before)
        target = loaded["w13"] if scheme is None else loaded.w13.scales
        target.mul_(2)
        x, tw, ids = random_routing(cfg, 2)
        with pytest.raises(md.WeightsModifiedError):
            layer(x, tw, ids)


@EACH_FORMAT
def test_a_tokens_result_does_not_depend_on_the_tokens_beside_it(build, scheme):
    # An expert's routed tokens are dotted two at a time (each weight widened once for
    # both); every sum keeps the one-token order, so a row is bit for bit the row alone.
    cfg = _cfg(scheme, has_bias=True)
    layer, _, _ = _layer(cfg)
    x, tw, _ = random_routing(cfg, 7, seed=5)
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1], [3, 3], [0, 5], [1, 0]])  # shared experts
    batch = layer(x, tw, ids)
    for t in range(7):
        assert torch.equal(batch[t], layer(x[t:t + 1], tw[t:t + 1], ids[t:t + 1])[0]), t


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
    cfg = _cfg(scheme, has_bias=True, hidden_size=2048)
    layer, ref_w, _ = _layer(cfg)
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
    cfg = _cfg(md.QuantScheme("int8"))
    layer, _, _ = _layer(cfg)
    inputs = [random_routing(cfg, t, seed=t) for t in (1, 2, 3, 8)]
    assert thread_disagreements(layer, inputs) == []


def test_the_native_entry_gives_the_python_paths_numbers(build):
    cfg = _cfg(None, apply_router_weight_on_input=True, top_k=1)
    layer, _, _ = _layer(cfg)
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
    cfg = _cfg(None)
    layer, _, _ = _layer(cfg)
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


def test_the_intermediate_keeps_fp32_precision_through_w2(build):
    """Two activated values near 100 that w2 subtracts: rounded to bf16 (steps of 0.5 there)
    before w2, as a bf16 dot product on bf16 inputs alone would, the output 0.625 comes out
    0.5 (20% off). The fused kernels keep their intermediate in fp32; so does this one (the
    avx512 build dots each input's bf16 remainder too). Rounding it had moved a random
    Mixtral's first-step logprobs by 0.9 inside vLLM's engine."""
    cfg = md.MoEConfig(2, 1, 32, 32, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(cfg.w13_shape, generator=g) * 0.05
    w2 = torch.randn(cfg.w2_shape, generator=g) * 0.05
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0  # h = column 0 of w13: gate 10 for units 0 and 1, up 10.0625 and 10
    w13[0, 0:2, 0] = 10.0
    w13[0, 32, 0], w13[0, 33, 0] = 10.0625, 10.0
    w2[0, 0, :] = 0.0
    w2[0, 0, 0], w2[0, 0, 1] = 1.0, -1.0  # out[0] = silu(10) * (10.0625 - 10) = 0.6250
    w13, w2, x = w13.bfloat16(), w2.bfloat16(), x.bfloat16()
    layer = md.MoELayer(cfg, backend="native").load_weights(w13, w2).prepare()
    tw, ids = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32)
    out = layer(x, tw, ids)
    want = moe_reference(cfg, x, w13, w2, tw, ids, None, None)
    assert abs(float(out[0, 0]) - float(want[0, 0])) <= 1e-2 * abs(float(want[0, 0])), (out[0, 0], want[0, 0])
    assert rel_error(out, want) <= TOLERANCE[torch.bfloat16]


def test_both_builds_agree_where_both_run():
    if len(BUILDS) < 2:
        pytest.skip(f"this CPU runs only {BUILDS or 'no'} build(s) of the kernel")
    for isa in BUILDS:
        _built(isa)
    for scheme in SCHEMES:
        cfg = _cfg(scheme)
        outs = []
        for isa in BUILDS:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(kernel.ISA_ENV, isa)
                layer, _, _ = _layer(cfg)
                x, tw, ids = random_routing(cfg, 4)
                outs.append(layer(x, tw, ids).float())
        # The same integer dots (int8 / int4), or fp32-precise sums of bf16 weights (the
        # avx512 build's vdpbf16ps dots each input's bf16 remainder too): what differs is the
        # order of the fp32 sums, then the bf16 rounding of the outputs.
        assert rel_error(outs[0], outs[1].double()) <= 1e-3, scheme


def test_priority_routes_large_token_counts_past_the_kernel(build):
    """Under "priority" the native backend serves T <= MAX_TOKENS and the next backend
    without a limit serves the rest (and "auto" never routes it beyond its limit)."""
    cfg = _cfg()
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
    cfg = _cfg(md.QuantScheme("int8"))
    _, ref_w, qe = _layer(cfg)
    priority = md.MoELayer(cfg, policy="priority", tuning_cache=False, exclude=["zentorch"])
    priority.load_weights(qe).prepare()
    if priority.backend != "native":
        pytest.skip(f"the resolver chose {priority.backend} here")
    assert priority.plan.table is None  # one route for every T: no limit to route around
    _check(priority, cfg, ref_w, MAX_TOKENS + 17)
    auto = md.MoELayer(cfg, policy="auto", tuning_cache=False, tune_max_tokens=64, exclude=["zentorch"])
    auto.load_weights(qe).prepare()
    assert "native" in auto.plan.tuned[64]["ms"]  # timed at the largest bucket


@EACH_FORMAT
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_a_nan_reaches_its_tokens_output_only(build, scheme, activation):
    """As in float math (docs/failure-modes.md): a NaN in a token's hidden states, or in its
    router weight applied to the input, makes that token's output NaN and no other's. The
    quantizers dropped it (max() keeps the number, NaN converted to int8 was 0), and
    swigluoai's clamps turned it into the limit."""
    for on_input in (False, True):
        cfg = _cfg(scheme, activation=activation, top_k=1 if on_input else 2,
                   apply_router_weight_on_input=on_input)
        layer, ref_w, _ = _layer(cfg)
        x, tw, ids = random_routing(cfg, 5, seed=4)
        if on_input:
            tw[2, 0] = math.nan
        else:
            x[2, 7] = math.nan
        out = layer(x, tw, ids)
        assert torch.isnan(out[2]).all(), (on_input, out[2])
        rest = [0, 1, 3, 4]
        want = moe_reference(cfg, x[rest], ref_w["w13"], ref_w["w2"], tw[rest], ids[rest])
        assert rel_error(out[rest], want) <= ERROR_BOUND, on_input


def test_a_negated_view_is_read_as_its_value(build):
    """torch._neg_view's bytes are its value's negation; the entry declines it and the Python
    path resolves it."""
    cfg = _cfg(md.QuantScheme("int8"))
    layer, ref_w, _ = _layer(cfg)
    x, tw, ids = random_routing(cfg, 3, seed=5)
    neg = torch._neg_view(x)
    assert neg.is_neg() and neg.is_contiguous()
    want = moe_reference(cfg, -x, ref_w["w13"], ref_w["w2"], tw, ids)
    assert rel_error(layer(neg, tw, ids), want) <= ERROR_BOUND
    assert rel_error(layer.run(neg, tw, ids, native=False), want) <= ERROR_BOUND


@EACH_FORMAT
@pytest.mark.parametrize("activation", list(md.Activation), ids=str)
def test_activations_hold_where_exp_saturates(build, scheme, activation):
    """Gate values far out on both sides (hidden states scaled up to 50x, 25x for swigluoai:
    gates past +-100), where the vectorised exp clamps its argument and builds 2^n from
    exponent bits: an exponent out of a float's range would give garbage or infinities there,
    not silu's 0 and g. (Not further: with quantized weights swigluoai's clamps leave an output
    that no longer grows with x while x's quantization error does; 5.3e-2 at 100x, int8, with
    std::exp as with the vectorised one.)"""
    cfg = _cfg(scheme, activation=activation)
    layer, ref_w, _ = _layer(cfg)
    x, tw, ids = random_routing(cfg, 4, seed=5)
    # swigluoai's exp takes 1.702 g: half the scale reaches as far (and its output stops
    # growing with x sooner, see above)
    oai = activation is md.Activation.SWIGLUOAI
    top, k = (25.0, 1.702) if oai else (50.0, 1.0)
    x = (x.float() * torch.tensor([[1.0], [10.0], [top / 2], [top]])).to(cfg.dtype)
    rows = k * torch.einsum("th,euh->teu", x.double(), ref_w["w13"].double())
    i = cfg.intermediate_size  # gate rows first or interleaved: every split reaches both sides
    for gates in (rows[..., :i], rows[..., i:], rows[..., 0::2], rows[..., 1::2]):
        assert gates.min() < -100 and gates.max() > 100  # e^-kg and e^kg past float's range
    want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids)
    bound = TOLERANCE[torch.bfloat16] if scheme is None else ERROR_BOUND
    for t in range(4):  # each token on its own: the largest would hide the others' errors
        assert rel_error(layer(x[t:t + 1], tw[t:t + 1], ids[t:t + 1]), want[t:t + 1]) <= bound, t
