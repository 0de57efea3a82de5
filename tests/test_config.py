import pytest
import torch

import moe_dispatch as md


def test_defaults_and_hashable():
    c = md.MoEConfig(8, 2, 64, 32)
    assert c.activation is md.Activation.SILU and c.dtype == torch.bfloat16
    assert {c: 1}[md.MoEConfig(8, 2, 64, 32)] == 1
    assert c.w13_shape == (8, 64, 64) and c.w2_shape == (8, 64, 32)
    with pytest.raises(AttributeError):
        c.top_k = 3  # frozen


def test_string_activation_and_dtype_names():
    c = md.MoEConfig(8, 2, 64, 32, activation="gelu_tanh", dtype="fp32")
    assert c.activation is md.Activation.GELU_TANH and c.dtype == torch.float32


@pytest.mark.parametrize("field,value", [
    ("num_experts", 0), ("num_experts", -3), ("top_k", 0), ("hidden_size", -1),
    ("intermediate_size", 0),
])
def test_non_positive_sizes(field, value):
    kw = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
    kw[field] = value
    with pytest.raises(md.InvalidArgumentError) as err:
        md.MoEConfig(**kw)
    assert err.value.argument == field and str(value) in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("value", [2.0, "8", True, None])
def test_non_int_sizes_are_type_errors(value):
    with pytest.raises(md.InvalidTypeError, match="num_experts"):
        md.MoEConfig(value, 1, 64, 32)


def test_top_k_above_experts():
    with pytest.raises(md.InvalidArgumentError, match=r"top_k=9 .*num_experts \(8\)"):
        md.MoEConfig(8, 9, 64, 32)


def test_unknown_activation_lists_accepted():
    with pytest.raises(md.InvalidArgumentError, match="relu.*'silu', 'gelu', 'gelu_tanh', 'swigluoai'"):
        md.MoEConfig(8, 2, 64, 32, activation="relu")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "double", 3])
def test_bad_dtype(dtype):
    with pytest.raises(md.InvalidArgumentError, match="dtype"):
        md.MoEConfig(8, 2, 64, 32, dtype=dtype)


def test_router_weight_on_input_needs_top1():
    with pytest.raises(md.InvalidArgumentError, match="apply_router_weight_on_input.*top_k=2"):
        md.MoEConfig(8, 2, 64, 32, apply_router_weight_on_input=True)
    assert md.MoEConfig(8, 1, 64, 32, apply_router_weight_on_input=True).top_k == 1


def test_bool_fields_are_strict():
    with pytest.raises(md.InvalidTypeError, match="has_bias"):
        md.MoEConfig(8, 2, 64, 32, has_bias=1)
