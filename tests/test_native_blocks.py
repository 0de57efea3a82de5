"""The blocked int8 / int4 path (backends/native/blocks_quant.h, forward_blocks.h): pairs of
16-row blocks, x quantized per 32 values up to 16 tokens and per 128 above (the activated
intermediate per 32 at every T), against the float64 reference on the dequantized weights,
on every build this CPU runs; and the blocked layout itself, unpacked back to the canonical
values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import random_routing, random_weights, rel_error, thread_disagreements
from moe_dispatch_backends.native import AIM_BOUND, _pack

from native_layers import build, check_layer, layer_config, native_layer  # noqa: F401  (build: a fixture)

INT8, INT8_G32 = md.QuantScheme("int8"), md.QuantScheme("int8", group_size=32)
INT4_G32, INT4_G128 = md.QuantScheme("int4", group_size=32), md.QuantScheme("int4", group_size=128)
INT4_G64_ZP = md.QuantScheme("int4", group_size=64, symmetric=False)
INT4_G128_ZP = md.QuantScheme("int4", group_size=128, symmetric=False)
# (scheme, H, I): units of 128 with a shorter last one (K % 128 != 0), units of a weight
# group smaller than the inputs' (g32, g64), per-channel rows padded to 32 (H=200, I=96),
# row counts that leave padding rows in a block (I=40: w13's last 16 units; H=200 or 96:
# w2's last pair of blocks).
SHAPES = [(INT8, 256, 128), (INT8, 192, 320), (INT8, 200, 40), (INT8_G32, 96, 160),
          (INT4_G32, 256, 96), (INT4_G128, 256, 384), (INT4_G64_ZP, 192, 320),
          (INT4_G128_ZP, 384, 128)]


def _ids(v):
    return v.describe() if isinstance(v, md.QuantScheme) else str(v)


@pytest.mark.parametrize("scheme,h,i", SHAPES, ids=_ids)
@pytest.mark.parametrize("activation", list(md.Activation), ids=str)
def test_every_activation_within_the_bound_both_sides_of_sixteen_tokens(build, scheme, h, i, activation):
    for on_input, top_k, bias in ((False, 2, True), (True, 1, False)):
        cfg = layer_config(scheme, hidden_size=h, intermediate_size=i, activation=activation, top_k=top_k,
                           apply_router_weight_on_input=on_input, has_bias=bias)
        layer, ref_w, _ = native_layer(cfg)
        # 1 and 16: x per 32 values; 17 and 64 (over 8 experts: full tiles of six and a
        # remainder): x per 128.
        for tokens in (1, 16, 17, 64):
            check_layer(layer, cfg, ref_w, tokens, seed=tokens)


@pytest.mark.parametrize("scheme", [INT8, INT8_G32, INT4_G128, INT4_G64_ZP], ids=_ids)
def test_layers_of_model_size_hold_the_aim(build, scheme):
    """On layers of a model's size the error is 1.1-1.3e-2 (ERROR_BOUND is for the suite's
    random layers of every drawn shape: tiny single-token layers reach 2.9e-2); AIM_BOUND
    holds it there, on both sides of 16 tokens."""
    cfg = layer_config(scheme, num_experts=8, top_k=2, hidden_size=1024, intermediate_size=512)
    layer, ref_w, _ = native_layer(cfg)
    for tokens in (1, 8, 64):
        x, tw, ids = random_routing(cfg, tokens, seed=tokens)
        want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids)
        assert rel_error(layer(x, tw, ids), want) <= AIM_BOUND, tokens


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_shapes_and_token_counts(build, data):
    scheme = data.draw(st.sampled_from([s for s, _, _ in SHAPES]))
    step = scheme.group_size or 32
    h, i = step * data.draw(st.integers(1, 8)), step * data.draw(st.integers(1, 8))
    experts, on_input = data.draw(st.integers(1, 12)), data.draw(st.booleans())
    cfg = md.MoEConfig(experts, 1 if on_input else data.draw(st.integers(1, min(4, experts))), h, i,
                       activation=data.draw(st.sampled_from(list(md.Activation))),
                       dtype=data.draw(st.sampled_from([torch.bfloat16, torch.float32])),
                       weight_scheme=scheme, has_bias=data.draw(st.booleans()),
                       apply_router_weight_on_input=on_input)
    layer, ref_w, _ = native_layer(cfg, seed=data.draw(st.integers(0, 1000)))
    check_layer(layer, cfg, ref_w, data.draw(st.integers(1, 80)))


@pytest.mark.parametrize("tokens", [8, 40])
@pytest.mark.parametrize("scheme", [INT8, INT4_G128_ZP], ids=_ids)
def test_a_tokens_result_does_not_depend_on_its_tile(build, scheme, tokens):
    """Each token's sums are its own (a tile shares weight loads, not sums): the same tokens
    in another order, so in other tiles, give the same rows bit for bit."""
    cfg = layer_config(scheme, has_bias=True)
    layer, _, _ = native_layer(cfg)
    x, tw, ids = random_routing(cfg, tokens, seed=5)
    batch = layer(x, tw, ids)
    perm = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    again = layer(x[perm].contiguous(), tw[perm].contiguous(), ids[perm].contiguous())
    assert torch.equal(batch[perm], again)


@pytest.mark.parametrize("scheme", [INT4_G32, INT4_G128], ids=_ids)
def test_the_largest_int4_values_and_inputs_do_not_overflow_the_sums(build, scheme):
    """The avx2 build adds four steps of maddubs in int16 before widening them (blocks_avx2.h):
    at the largest nibble (15) times the largest input (127 in magnitude) a row's partial sum
    is +-30480, inside int16's range, where a longer run of steps would wrap. Weights at one
    level and inputs all equal: token 0 (x = 1, quantized to 127) meets expert 0's gate rows of
    +1 (nibble 15), token 1 (x = -0.5, quantized to -127) expert 1's up rows of +1; both reach
    the output linearly (the other row of each unit is -1: silu(256) x -256 and
    silu(128) x -128 per unit, then w2's sum of them)."""
    cfg = layer_config(scheme, num_experts=2, top_k=1, hidden_size=256, intermediate_size=128)
    w13 = torch.ones(2, 256, 256)
    w13[0, 128:] = -1.0  # expert 0: gate +1, up -1
    w13[1, :128] = -1.0  # expert 1: gate -1, up +1
    qe = md.quantize_experts(w13, torch.ones(2, 256, 128), scheme)
    assert int(qe.w13.stored(0, torch.int16).max()) == 15  # the extreme nibble is there
    d13, d2 = qe.dequantize()
    layer = md.MoELayer(cfg, backend="native").load_weights(qe).prepare()
    for tokens in (2, 18):  # x per 32 values (units of 32: 4 steps), then per 128 (g128: 16)
        x, tw, ids = random_routing(cfg, tokens, seed=0)
        x = torch.tensor([[1.0], [-0.5]]).repeat(tokens // 2, 256).to(cfg.dtype).contiguous()
        tw, ids = torch.ones_like(tw), torch.tensor([[0], [1]], dtype=ids.dtype).repeat(tokens // 2, 1)
        want = moe_reference(cfg, x, d13, d2, tw, ids)
        assert want.abs().min() > 1e5  # the sums are as large as the test means them to be
        assert rel_error(layer(x, tw, ids), want) <= 1e-2, tokens


@pytest.mark.parametrize("scheme", [INT8, INT8_G32], ids=_ids)
def test_the_extreme_int8_values_and_inputs_are_exact(build, scheme):
    """The avx2 build multiplies |q| by the input carrying q's sign (maddubs's unsigned times
    signed operands; blocks_avx2.h): at q = -128 (a Q8_0 file may hold it; the quantizer
    stops at -127) and +127 against inputs of magnitude 127 each pair sum is 2 x 128 x 127,
    inside int16's range, and |-128| must read as 128, not as -128. Expert 0's gate rows hold
    -128, its up rows +127, so that a wrong product changes the output's sign or size."""
    cfg = layer_config(scheme, num_experts=2, top_k=1, hidden_size=256, intermediate_size=128)
    q13 = torch.full((2, 256, 256), 127, dtype=torch.int8)
    q13[0, :128] = -128
    q13[1, 128:] = -127
    q2 = torch.full((2, 256, 128), -128, dtype=torch.int8)
    q2[1] = 127
    groups = 1 if scheme.group_size is None else 256 // scheme.group_size
    sdtype = torch.float32 if scheme.group_size is None else torch.float16
    w13 = md.QuantizedTensor.of(scheme, q13, torch.full((2, 256, groups), 1 / 64, dtype=sdtype))
    w2 = md.QuantizedTensor.of(scheme, q2, torch.full((2, 256, 1 if scheme.group_size is None else 4),
                                                      1 / 4096, dtype=sdtype))
    qe = md.QuantizedExperts(scheme, w13, w2)
    d13, d2 = qe.dequantize()
    layer = md.MoELayer(cfg, backend="native").load_weights(qe).prepare()
    for tokens in (2, 18):
        x, tw, ids = random_routing(cfg, tokens, seed=0)
        x = torch.tensor([[-1.0], [0.5]]).repeat(tokens // 2, 256).to(cfg.dtype).contiguous()
        tw, ids = torch.ones_like(tw), torch.tensor([[0], [1]], dtype=ids.dtype).repeat(tokens // 2, 1)
        want = moe_reference(cfg, x, d13, d2, tw, ids)
        assert want.abs().min() > 1.0  # the sums are as large as the test means them to be
        assert rel_error(layer(x, tw, ids), want) <= 1e-2, tokens


def test_eight_threads_agree_with_the_serial_result(build):
    cfg = layer_config(INT4_G128)
    layer, _, _ = native_layer(cfg)
    inputs = [random_routing(cfg, t, seed=t) for t in (1, 7, 17, 24, 40)]
    assert thread_disagreements(layer, inputs) == []


# -- the layout (no kernel: everywhere) ----------------------------------------------------
def _stream(p: _pack.Packed, e: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's pairs' streams split into their scales [E, pairs, G, 2, 16] (as the
    scales' dtype) and their steps' bytes [E, pairs, Kp * bytes per value] in K order."""
    groups, dtype = p.scales.shape[2], p.scales.dtype
    head = 2 * 16 * p.scales.element_size()
    s = p.q.view(e, rows // 32, groups, -1)
    scales = s[..., :head].contiguous().view(dtype).view(e, rows // 32, groups, 2, 16)
    return scales, s[..., head:].reshape(e, rows // 32, -1)


def _unblock(p: _pack.Packed, bits: int, e: int, rows: int, kp: int) -> torch.Tensor:
    """The blocked bytes back to [E, rows, Kp] values (int8: signed; int4: u in 0..15)."""
    q = _stream(p, e, rows)[1]
    if bits == 8:  # [pairs, steps, 2, 16, 4] -> [pairs, 2, 16, steps, 4]
        v = q.view(e, rows // 32, kp // 4, 2, 16, 4).permute(0, 1, 3, 4, 2, 5).to(torch.int16) - 128
        return v.reshape(e, rows, kp)
    b = q.view(e, rows // 32, kp // 8, 2, 16, 4).permute(0, 1, 3, 4, 2, 5).to(torch.int16)
    return torch.stack((b & 15, b >> 4), dim=-2).reshape(e, rows, kp)


# Per channel: padding rows in w13's last 16 units (I=40) and w2's last pair of blocks
# (H=200), and K padded to 32; with groups, H and I are multiples of the group.
@pytest.mark.parametrize("scheme,h,i", [(INT8, 200, 40), (INT8_G32, 224, 96), (INT4_G32, 224, 96),
                                        (INT4_G64_ZP, 192, 128)], ids=_ids)
@pytest.mark.parametrize("activation", [md.Activation.SILU, md.Activation.SWIGLUOAI], ids=str)
def test_the_blocked_layout_holds_the_canonical_values_scales_and_zeros(scheme, h, i, activation):
    cfg = md.MoEConfig(3, 2, h, i, activation=activation, dtype=torch.bfloat16, weight_scheme=scheme)
    w = random_weights(cfg, seed=3)
    qe = md.quantize_experts(w["w13"].float(), w["w2"].float(), scheme)
    for t, order in ((qe.w13, _pack.w13_rows(cfg)), (qe.w2, _pack._blocks(list(range(h))))):
        e, _, k = t.shape
        p = _pack.pack_blocked(t, order)
        kp, rows, valid = _pack.padded(k), order.numel(), order >= 0
        values = _unblock(p, scheme.bits, e, rows, kp)
        assert torch.equal(values[:, valid, :k], t.stored(None, torch.int16)[:, order[valid]])
        assert not values[:, valid, k:].any()  # the padding of K is zero (int8 + 128 - 128)
        g = p.scales.shape[2]
        scales = p.scales.transpose(2, 3).reshape(e, rows, g)
        assert torch.equal(scales[:, valid], t.scales.to(scales.dtype)[:, order[valid]])
        assert not scales[:, ~valid].any()  # padding rows: zero scales
        # ... and the stream holds them: per pair and group, block 2p's 16, then 2p + 1's
        streamed = _stream(p, e, rows)[0]  # [E, pairs, G, 2, 16]
        assert torch.equal(streamed.permute(0, 1, 3, 4, 2).reshape(e, rows, g), scales)
        if t.zeros is not None:
            assert torch.equal(p.zeros.transpose(2, 3).reshape(e, rows, g)[:, valid], t.zeros[:, order[valid]])
    gate_up = _pack.w13_rows(cfg)[:32].tolist()  # units 0..15: gate rows, then up rows
    oai = activation is md.Activation.SWIGLUOAI
    assert gate_up[:16] == [2 * u if oai else u for u in range(16)]
    assert gate_up[16:] == [2 * u + 1 if oai else i + u for u in range(16)]
