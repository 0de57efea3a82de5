"""The native kernel's int8 / int4 path above 16 tokens (the avx512 build's tiles: two rows by
up to six tokens, inputs quantized per group of 128 values, backends/native/tiles_quant.h),
against the float64 reference on the dequantized weights, on every build this CPU runs (the
avx2 build has no tiles: the same calls take its loop there, and must hold the same bound)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.testing import random_routing, thread_disagreements

from test_native_backend import _cfg, _check, _layer, build  # noqa: F401  (build: a fixture)

# Shapes the tiles serve: the reduction axes in steps of 64, units of 128 (or the weight
# group of 64) with a 64-value last unit where K % 128 == 64 (H=192, I=320).
TILED = [(md.QuantScheme("int8"), 256, 128), (md.QuantScheme("int8"), 192, 320),
         (md.QuantScheme("int4", group_size=128), 256, 384),
         (md.QuantScheme("int4", group_size=64, symmetric=False), 192, 320),
         (md.QuantScheme("int4", group_size=128, symmetric=False), 384, 128)]
# Shapes they leave to the loop at every T: groups of 32, K not in steps of 64.
LOOPED = [(md.QuantScheme("int8", group_size=32), 256, 128), (md.QuantScheme("int4", group_size=32), 256, 128),
          (md.QuantScheme("int8"), 200, 96)]


@pytest.mark.parametrize("scheme,h,i", TILED + LOOPED,
                         ids=lambda v: v.describe() if isinstance(v, md.QuantScheme) else str(v))
@pytest.mark.parametrize("activation", list(md.Activation), ids=str)
def test_above_sixteen_tokens_every_activation_within_the_bound(build, scheme, h, i, activation):
    for on_input, top_k, bias in ((False, 2, True), (True, 1, False)):
        cfg = _cfg(scheme, hidden_size=h, intermediate_size=i, activation=activation, top_k=top_k,
                   apply_router_weight_on_input=on_input, has_bias=bias)
        layer, ref_w, _ = _layer(cfg)
        for tokens in (17, 64):  # 64 tokens over 8 experts: full tiles of six and a remainder
            _check(layer, cfg, ref_w, tokens, seed=tokens)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_shapes_above_sixteen_tokens(build, data):
    scheme = data.draw(st.sampled_from([s for s, _, _ in TILED + LOOPED]))
    step = scheme.group_size or 64
    h, i = step * data.draw(st.integers(1, 6)), step * data.draw(st.integers(1, 6))
    experts, on_input = data.draw(st.integers(1, 12)), data.draw(st.booleans())
    cfg = md.MoEConfig(experts, 1 if on_input else data.draw(st.integers(1, min(4, experts))), h, i,
                       activation=data.draw(st.sampled_from(list(md.Activation))),
                       dtype=data.draw(st.sampled_from([torch.bfloat16, torch.float32])),
                       weight_scheme=scheme, has_bias=data.draw(st.booleans()),
                       apply_router_weight_on_input=on_input)
    layer, ref_w, _ = _layer(cfg, seed=data.draw(st.integers(0, 1000)))
    _check(layer, cfg, ref_w, data.draw(st.integers(17, 80)))


@pytest.mark.parametrize("scheme", [md.QuantScheme("int8"), md.QuantScheme("int4", group_size=128)],
                         ids=lambda s: s.describe())
def test_a_tokens_result_does_not_depend_on_its_tile(build, scheme):
    """Each token's sums are its own (a tile shares weight loads, not sums): the same tokens
    in another order, so in other tiles, give the same rows bit for bit."""
    cfg = _cfg(scheme, has_bias=True)
    layer, _, _ = _layer(cfg)
    x, tw, ids = random_routing(cfg, 40, seed=5)
    batch = layer(x, tw, ids)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    again = layer(x[perm].contiguous(), tw[perm].contiguous(), ids[perm].contiguous())
    assert torch.equal(batch[perm], again)


def test_eight_threads_agree_with_the_serial_result_above_sixteen_tokens(build):
    cfg = _cfg(md.QuantScheme("int4", group_size=128))
    layer, _, _ = _layer(cfg)
    inputs = [random_routing(cfg, t, seed=t) for t in (17, 24, 40)]
    assert thread_disagreements(layer, inputs) == []
