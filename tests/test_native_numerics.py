"""The native backend's numbers, on every build this CPU runs, against the float64
reference: every weight format and activation, Hypothesis-drawn shapes with odd H and I, the
int4 zero-point term, a token's result alone and beside others, the fp32 intermediate, a
NaN that reaches its own token's output only, a negated view, and the activations where exp
saturates. Test layers and bounds: native_layers.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, random_routing, rel_error
from moe_dispatch.testing.strategies import quant_schemes

from moe_dispatch_backends.native import ERROR_BOUND
from native_layers import (EACH_FORMAT, SCHEMES, build, check_layer, layer_config,  # noqa: F401  (build: a fixture)
                           native_layer)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "bf16" if s is None else s.describe())
@pytest.mark.parametrize("activation", list(md.Activation), ids=str)
def test_every_format_and_activation_matches_the_reference(build, scheme, activation):
    for on_input, top_k, bias in ((False, 2, True), (True, 1, False)):
        cfg = layer_config(scheme, activation=activation, top_k=top_k, apply_router_weight_on_input=on_input,
                           has_bias=bias)
        layer, ref_w, _ = native_layer(cfg)
        for tokens in (1, 5, 33):  # 33: above max_tokens, forced: still exact
            check_layer(layer, cfg, ref_w, tokens, seed=tokens)


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
    layer, ref_w, _ = native_layer(cfg, seed=data.draw(st.integers(0, 1000)))
    check_layer(layer, cfg, ref_w, data.draw(st.integers(1, 20)))


@pytest.mark.parametrize("scheme", [md.QuantScheme("int4", group_size=32, symmetric=False),
                                    md.QuantScheme("int4", group_size=32),
                                    md.QuantScheme("int4", group_size=64, symmetric=False)],
                         ids=lambda s: s.describe())
def test_int4_zero_point_term_over_eight_groups_a_vector_and_the_rest(build, scheme):
    """The zero-point term of an int4 row is summed eight groups a vector and the remainder
    one at a time: 11 and 3 groups of 32 (H=352, I=96; an odd block count too), 10 and 3 of 64."""
    g = scheme.group_size
    cfg = layer_config(scheme, hidden_size=11 * 32 if g == 32 else 10 * 64, intermediate_size=3 * g)
    layer, ref_w, _ = native_layer(cfg)
    for tokens in (1, 2, 5):
        check_layer(layer, cfg, ref_w, tokens)


@EACH_FORMAT
def test_a_tokens_result_does_not_depend_on_the_tokens_beside_it(build, scheme):
    # An expert's routed tokens are dotted two at a time (each weight widened once for
    # both); every sum keeps the one-token order, so a row is bit for bit the row alone.
    cfg = layer_config(scheme, has_bias=True)
    layer, _, _ = native_layer(cfg)
    x, tw, _ = random_routing(cfg, 7, seed=5)
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1], [3, 3], [0, 5], [1, 0]])  # shared experts
    batch = layer(x, tw, ids)
    for t in range(7):
        assert torch.equal(batch[t], layer(x[t:t + 1], tw[t:t + 1], ids[t:t + 1])[0]), t


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


@EACH_FORMAT
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_a_nan_reaches_its_tokens_output_only(build, scheme, activation):
    """As in float math (docs/failure-modes.md): a NaN in a token's hidden states, or in its
    router weight applied to the input, makes that token's output NaN and no other's. The
    quantizers dropped it (max() keeps the number, NaN converted to int8 was 0), and
    swigluoai's clamps turned it into the limit."""
    for on_input in (False, True):
        cfg = layer_config(scheme, activation=activation, top_k=1 if on_input else 2,
                           apply_router_weight_on_input=on_input)
        layer, ref_w, _ = native_layer(cfg)
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
    cfg = layer_config(md.QuantScheme("int8"))
    layer, ref_w, _ = native_layer(cfg)
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
    cfg = layer_config(scheme, activation=activation)
    layer, ref_w, _ = native_layer(cfg)
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
