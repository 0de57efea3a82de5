"""The PyTorch backend against the float64 reference, on fresh random data."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st

import moe_dispatch as md
from helpers import TOLERANCE, assert_unchanged, random_weights, reference, rel_error, snapshot
from moe_dispatch.testing.strategies import routing, small_configs


@given(config=small_configs(), data=st.data(), seed=st.integers(0, 10_000))
def test_parity_with_reference(config, data, seed):
    weights = random_weights(config, seed)
    before = snapshot(weights)
    x, tw, ids = data.draw(routing(config))
    layer = md.MoELayer(config, backend="torch").load_weights(**weights).prepare()
    out = layer(x, tw, ids)
    assert out.dtype == config.dtype and out.shape == x.shape
    assert rel_error(out, reference(config, weights, x, tw, ids)) <= TOLERANCE[config.dtype]
    assert_unchanged(weights, before)


@given(config=small_configs(dtypes=(torch.float32,)), seed=st.integers(0, 10_000))
def test_non_contiguous_views(config, seed):
    weights = random_weights(config, seed)
    # Transposed-storage weights and strided inputs: same values, other strides.
    strided = {k: (v.transpose(-1, -2).contiguous().transpose(-1, -2) if v is not None and v.dim() == 3
                   else v) for k, v in weights.items()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 2 * config.hidden_size, generator=g)[:, ::2]
    tw, ids = md.select_experts(torch.randn(7, config.num_experts, generator=g), config.top_k)
    tw_nc = tw.t().contiguous().t()
    ids_nc = ids.to(torch.int64).t().contiguous().t()
    layer = md.MoELayer(config, backend="torch").load_weights(**strided).prepare()
    out = layer(x, tw_nc, ids_nc)
    assert rel_error(out, reference(config, weights, x, tw, ids)) <= TOLERANCE[config.dtype]


def test_duplicate_ids_count_twice():
    config = md.MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    weights = random_weights(config)
    x = torch.randn(3, 16)
    ids = torch.tensor([[1, 1], [0, 2], [3, 3]], dtype=torch.int32)
    tw = torch.rand(3, 2)
    layer = md.MoELayer(config, backend="torch").load_weights(**weights).prepare()
    assert rel_error(layer(x, tw, ids), reference(config, weights, x, tw, ids)) <= 1e-5
