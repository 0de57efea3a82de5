"""Quantized expert weights: schemes, the packed layout, round-to-nearest, dequantization
(the math is in docs/quantization.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.testing.strategies import quant_schemes, quantizable_experts
from helpers import copying_backends


def _step(q: md.QuantizedTensor) -> torch.Tensor:
    """The stored scale of every element."""
    return q.scales.float().repeat_interleave(q.shape[2] // q.scales.shape[-1], dim=-1)


def _bound(q: md.QuantizedTensor, w: torch.Tensor) -> torch.Tensor:
    """Half a step, exactly, plus float32's error in w / scale (|q| <= 127: < 1e-4 steps)."""
    s = _step(q)
    s = s * (1 + 1e-4)
    if q.scheme.symmetric:
        top = 127.0 if q.scheme.bits == 8 else 7.0
        # half a step, plus what the clamp cuts where the stored (fp16) scale rounded down
        return s / 2 + (w.abs() - top * s).clamp(min=0)
    return s  # the top of [min, max] may round one step past 15 and be clamped


@given(data=st.data(), scheme=quant_schemes())
def test_round_to_nearest_within_half_a_step(data, scheme):
    w13, w2 = data.draw(quantizable_experts(scheme))
    before = w13.clone(), w2.clone()
    qe = md.quantize_experts(w13, w2, scheme)
    assert torch.equal(w13, before[0]) and torch.equal(w2, before[1])  # only read
    d13, d2 = qe.dequantize()
    for q, w, d in ((qe.w13, w13, d13), (qe.w2, w2, d2)):
        assert d.dtype == torch.float32 and d.shape == w.shape
        assert bool(((d - w).abs() <= _bound(q, w)).all())
        assert bool((d[w == 0] == 0).all())  # zero stays exactly zero


@given(data=st.data(), scheme=quant_schemes())
def test_dequantized_weights_quantize_to_themselves(data, scheme):
    """Symmetric schemes: the largest element of a group is exactly +-top * scale, so a
    second quantization of the dequantized weights finds the same scales and values."""
    assume(scheme.symmetric)
    w13, w2 = data.draw(quantizable_experts(scheme))
    qe = md.quantize_experts(w13, w2, scheme)
    again = md.quantize_experts(*qe.dequantize(), scheme)
    d1, d2 = qe.dequantize(), again.dequantize()
    assert torch.allclose(d1[0], d2[0], rtol=0, atol=float(_step(qe.w13).max()) * 1e-3)
    assert torch.allclose(d1[1], d2[1], rtol=0, atol=float(_step(qe.w2).max()) * 1e-3)


def test_the_packed_layout_is_the_documented_one():
    w = torch.tensor([[[-8.0, 7.0, 0.0, 1.0] * 8]])  # [1, 1, 32]; amax 8 -> scale 8/7
    from moe_dispatch._quant import quantize
    q = quantize(w, md.QuantScheme("int4", group_size=32))
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (1, 1, 16)
    assert q.scales.dtype == torch.float16 and q.scales.shape == (1, 1, 1)
    s = float(q.scales)
    values = [round(v / s) for v in (-8.0, 7.0, 0.0, 1.0)]  # q in [-8, 7]
    low, high = values[0] + 8, values[1] + 8  # element 2j in the low nibble, 2j+1 high
    assert int(q.qweight[0, 0, 0]) == low | (high << 4)
    assert q.values()[0, 0, :4].tolist() == values
    q8 = quantize(w, md.QuantScheme("int8"))
    assert q8.qweight.dtype == torch.int8 and q8.scales.dtype == torch.float32
    assert q8.scales.shape == (1, 1, 1) and int(q8.qweight[0, 0, 0]) == -127
    qz = quantize(w, md.QuantScheme("int4", group_size=32, symmetric=False))
    assert qz.zeros is not None and qz.zeros.dtype == torch.uint8 and qz.zeros.shape == (1, 1, 1)


def test_memory_targets_of_the_schemes():
    """<= 0.55x the bf16 bytes for int8, <= 0.30x for int4 (issue targets), at C1's shape."""
    e, h, i = 8, 1024, 1408
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    bf16 = (w13.numel() + w2.numel()) * 2
    for scheme, target in ((md.QuantScheme("int8"), 0.55), (md.QuantScheme("int8", group_size=32), 0.55),
                           (md.QuantScheme("int4", group_size=32), 0.30),
                           (md.QuantScheme("int4", group_size=32, symmetric=False), 0.30),
                           (md.QuantScheme("int4", group_size=128), 0.30)):
        ratio = md.quantize_experts(w13, w2, scheme).nbytes / bf16
        assert ratio <= target, (scheme, ratio)


def test_bad_schemes_and_shapes_name_the_field():
    with pytest.raises(md.InvalidArgumentError, match="kind='int3'"):
        md.QuantScheme("int3")
    with pytest.raises(md.InvalidArgumentError, match="group_size=64.*'int8'"):
        md.QuantScheme("int8", group_size=64)
    with pytest.raises(md.InvalidArgumentError, match="group_size=None.*'int4'"):
        md.QuantScheme("int4", group_size=None)
    with pytest.raises(md.InvalidArgumentError, match="symmetric=False"):
        md.QuantScheme("int8", symmetric=False)
    with pytest.raises(md.InvalidTypeError, match="symmetric"):
        md.QuantScheme("int4", symmetric=1)
    assert md.QuantScheme("int4").group_size == 128 and md.QuantScheme("int8").group_size is None
    scheme = md.QuantScheme("int4", group_size=64)
    with pytest.raises(md.InvalidArgumentError, match=r"w13.shape\[2\].*group_size=64.*96"):
        md.quantize_experts(torch.randn(2, 128, 96), torch.randn(2, 96, 64), scheme)
    with pytest.raises(md.InvalidArgumentError, match="w2"):
        md.quantize_experts(torch.randn(2, 128, 64), torch.randn(2, 64, 128), scheme)
    with pytest.raises(md.InvalidTypeError, match="scheme"):
        md.quantize_experts(torch.randn(2, 128, 64), torch.randn(2, 64, 64), "int4")
    with pytest.raises(md.InvalidArgumentError, match="w13"):
        md.quantize_experts(torch.randn(128, 64), torch.randn(2, 64, 64), scheme)
    q = md.quantize_experts(torch.randn(2, 128, 64), torch.randn(2, 64, 64), scheme).w13
    from moe_dispatch._quant import QuantizedTensor
    with pytest.raises(md.InvalidArgumentError, match="scales"):
        QuantizedTensor(scheme, q.qweight, q.scales.float(), None, q.shape)
    with pytest.raises(md.InvalidArgumentError, match="qweight"):
        QuantizedTensor(scheme, q.qweight[:, :, :-1], q.scales, None, q.shape)
    with pytest.raises(md.InvalidArgumentError, match="zeros"):
        QuantizedTensor(md.QuantScheme("int4", group_size=64, symmetric=False), q.qweight,
                        q.scales, None, q.shape)


@pytest.mark.parametrize("kind,group", [("int4", 32.0), ("int4", 128.0), ("int8", 32.0)])
def test_a_group_size_that_is_not_an_int_is_a_type_error(kind, group):
    # 32.0 == 32: accepted once, it failed later inside a reshape with a bare TypeError.
    with pytest.raises(md.InvalidTypeError, match=f"group_size has {group!r}.*an int"):
        md.QuantScheme(kind, group_size=group)


def test_quantized_tensor_of_names_a_bad_qweight():
    scheme = md.QuantScheme("int8")
    with pytest.raises(md.InvalidArgumentError, match=r"qweight='torch.int8 \[4, 4\]'.*\[E, N, K\]"):
        md.QuantizedTensor.of(scheme, torch.zeros(4, 4, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(md.InvalidTypeError, match="qweight.*a torch.Tensor"):
        md.QuantizedTensor.of(scheme, [[[1]]], torch.ones(1, 1, 1))
    with pytest.raises(md.InvalidTypeError, match="scheme"):
        md.QuantizedTensor.of("int8", torch.zeros(1, 4, 4, dtype=torch.int8), torch.ones(1, 4, 1))


# -- quantized layers -------------------------------------------------------------------
from moe_dispatch.reference import moe_reference  # noqa: E402
from moe_dispatch.testing import TOLERANCE, random_routing, rel_error  # noqa: E402
from moe_dispatch.testing.strategies import routing  # noqa: E402


def _quantized_layer(scheme, dtype=torch.bfloat16, activation="silu", bias=False, on_input=False,
                     e=8, k=2, h=64, i=64, seed=0, **layer_kw):
    cfg = md.MoEConfig(e, 1 if on_input else k, h, i, activation=activation, dtype=dtype,
                       has_bias=bias, apply_router_weight_on_input=on_input, weight_scheme=scheme)
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(cfg.w13_shape, generator=g) * 0.2
    w2 = torch.randn(cfg.w2_shape, generator=g) * 0.2
    b13 = (torch.randn(cfg.w13_bias_shape, generator=g) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(cfg.w2_bias_shape, generator=g) * 0.1).to(dtype) if bias else None
    qe = md.quantize_experts(w13, w2, scheme, b13, b2)
    layer_kw.setdefault("backend", "torch")  # the portable path (zentorch's: its own tests)
    return cfg, qe, md.MoELayer(cfg, **layer_kw).load_weights(qe)


def _reference(cfg, qe, x, tw, ids):
    d13, d2 = qe.dequantize()
    return moe_reference(cfg, x, d13, d2, tw, ids, qe.w13_bias, qe.w2_bias)


@given(data=st.data(), scheme=quant_schemes(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       activation=st.sampled_from(list(md.Activation)), bias=st.booleans(), on_input=st.booleans())
def test_a_quantized_layer_matches_the_reference_on_its_dequantized_weights(
        data, scheme, dtype, activation, bias, on_input):
    step = scheme.group_size or 32
    h, i = step * data.draw(st.integers(1, 3)), step * data.draw(st.integers(1, 2))
    cfg, qe, layer = _quantized_layer(scheme, dtype, activation, bias, on_input, h=h, i=i,
                                      seed=data.draw(st.integers(0, 1000)))
    layer.prepare()
    assert layer.backend == "torch"  # the portable path runs every scheme
    x, tw, ids = data.draw(routing(cfg, max_tokens=9))
    out = layer(x, tw, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_error(out, _reference(cfg, qe, x, tw, ids)) <= TOLERANCE[dtype]


def test_only_backends_that_declare_the_format_are_asked():
    scheme = md.QuantScheme("int8")
    cfg = md.MoEConfig(8, 2, 64, 64, weight_scheme=scheme)
    res = md.resolve(cfg)
    declared = ("zentorch", "native", "torch_woq", "torch")  # the built-ins that declare int8
    assert res.backend in declared
    for cand in res.candidates:
        if cand.name not in declared:
            assert "runs float weights; this config has int8 per channel weights" in cand.reason
    class Any_(md.BackendBase):
        def supports_config(self, config, capabilities):
            return md.accept()

        def process_weights(self, weights, capabilities):
            return weights

        def apply(self, state, x, tw, ids):
            return x

    with pytest.raises(ValueError, match="int9"):
        md.BackendSpec("x", 1, Any_(), weights=("int9",))
    assert md.BackendSpec("x", 1, Any_(), weights=("int4", "float")).weights == ("float", "int4")


def test_wrong_weights_for_the_config_name_the_field():
    scheme = md.QuantScheme("int4", group_size=32)
    cfg, qe, layer = _quantized_layer(scheme)
    with pytest.raises(md.InvalidTypeError, match="w13.*QuantizedExperts"):
        layer.load_weights(torch.randn(cfg.w13_shape).bfloat16(), torch.randn(cfg.w2_shape).bfloat16())
    float_cfg = md.MoEConfig(8, 2, 64, 64)
    with pytest.raises(md.InvalidTypeError, match="w13.*float weights"):
        md.MoELayer(float_cfg).load_weights(qe)
    other = md.quantize_experts(*qe.dequantize(), md.QuantScheme("int4", group_size=64))
    with pytest.raises(md.InvalidArgumentError, match="w13.scheme"):
        layer.load_weights(other)
    with pytest.raises(md.InvalidArgumentError, match="w2"):
        layer.load_weights(qe, torch.zeros(1))
    small = md.quantize_experts(torch.randn(4, 128, 64), torch.randn(4, 64, 64), scheme)
    with pytest.raises(md.InvalidArgumentError, match=r"w13.shape"):
        layer.load_weights(small)
    with pytest.raises(md.InvalidArgumentError, match="weight_scheme.*divides hidden_size=48"):
        md.MoEConfig(8, 2, 48, 64, weight_scheme=scheme)
    with pytest.raises(md.InvalidTypeError, match="weight_scheme"):
        md.MoEConfig(8, 2, 64, 64, weight_scheme="int4")
    with pytest.raises(md.InvalidArgumentError, match="w13_bias"):  # the config has no bias
        layer.load_weights(md.quantize_experts(*qe.dequantize(), scheme, torch.zeros(8, 128)))


def test_caller_tensors_untouched_and_in_place_updates_detected():
    scheme = md.QuantScheme("int8", group_size=32)
    cfg, qe, layer = _quantized_layer(scheme)
    before = [t.clone() for t in (qe.w13.qweight, qe.w13.scales, qe.w2.qweight, qe.w2.scales)]
    layer.prepare()
    x, tw, ids = random_routing(cfg, 5)
    layer(x, tw, ids)
    for a, b in zip(before, (qe.w13.qweight, qe.w13.scales, qe.w2.qweight, qe.w2.scales)):
        assert torch.equal(a, b)
    copying = copying_backends(cfg)
    others = [md.MoELayer(cfg, backend=n).load_weights(qe).prepare() for n in copying]
    qe.w2.scales.mul_(2)  # a scale written in place after prepare()
    # The torch loop (differentiable) computes on the caller's tensors: it sees the change.
    assert rel_error(layer(x, tw, ids), _reference(cfg, qe, x, tw, ids)) <= TOLERANCE[torch.bfloat16]
    for other in others:  # a private copy: the change is detected, never run on stale values
        with pytest.raises(md.WeightsModifiedError, match="w2.scales"):
            other(x, tw, ids)
        other.prepare()  # rebuilt from the current values
        assert rel_error(other(x, tw, ids), _reference(cfg, qe, x, tw, ids)) <= 3e-2, other.backend


def test_a_quantized_layer_holds_only_the_quantized_bytes():
    """The torch path keeps no dequantized copy: what the layer holds beyond the caller's
    QuantizedExperts is nothing, and that is <= 0.55x (int8) / 0.30x (int4) of bf16."""
    for scheme, target in ((md.QuantScheme("int8"), 0.55), (md.QuantScheme("int4", group_size=128), 0.30)):
        cfg, qe, layer = _quantized_layer(scheme, e=4, h=256, i=128, keep_canonical=False)
        layer.prepare()
        assert layer.plan.route.state.quantized is qe
        bf16 = (cfg.w13_shape[0] * cfg.w13_shape[1] * cfg.w13_shape[2]
                + cfg.w2_shape[0] * cfg.w2_shape[1] * cfg.w2_shape[2]) * 2
        assert qe.nbytes / bf16 <= target


@pytest.mark.parametrize("scheme", [md.QuantScheme("int8"), md.QuantScheme("int4", group_size=32),
                                    md.QuantScheme("int4", group_size=128, symmetric=False)],
                         ids=lambda s: s.describe())
def test_torchs_weight_only_kernels_match_the_reference(scheme):
    """torch_woq: torch's int8/int4 matmuls per expert, bf16 activations (weight-only: the
    bf16 tolerance), biases and repeated ids included."""
    cfg, qe, layer = _quantized_layer(scheme, bias=True, backend="torch_woq", h=128, i=128)
    layer.prepare()
    for tokens in (1, 7, 40):
        x, tw, ids = random_routing(cfg, tokens, seed=tokens)
        ids[0, 1] = ids[0, 0]
        assert rel_error(layer(x, tw, ids), _reference(cfg, qe, x, tw, ids)) <= TOLERANCE[torch.bfloat16]


def test_column_major_quantized_weights_run_on_every_accepting_backend():
    """A QuantizedTensor whose qweight is stored column-major is valid input: every backend
    that accepts it gives the reference (torch's int8 kernel itself needs a contiguous one)."""
    scheme = md.QuantScheme("int8")
    cfg, qe, _ = _quantized_layer(scheme, e=3, h=128, i=64)
    col = lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    qn = md.QuantizedExperts(scheme, *(md.QuantizedTensor(scheme, col(t.qweight), t.scales, None, t.shape)
                                       for t in (qe.w13, qe.w2)))
    x, tw, ids = random_routing(cfg, 4, seed=2)
    for c in md.resolve(cfg).candidates:
        if c.decision.accepted:
            layer = md.MoELayer(cfg, backend=c.name).load_weights(qn).prepare()
            assert rel_error(layer(x, tw, ids), _reference(cfg, qe, x, tw, ids)) <= 3e-2, c.name


def test_torchs_weight_only_gate():
    from moe_dispatch_backends.torch_woq import TorchWoqBackend
    caps = md.Capabilities.detect()
    d = TorchWoqBackend().supports_config(md.MoEConfig(8, 2, 64, 64, dtype=torch.float32,
                                                       weight_scheme=md.QuantScheme("int8")), caps)
    assert not d.accepted and "bfloat16 activations only" in d.reason
    d = TorchWoqBackend().supports_config(md.MoEConfig(8, 2, 64, 64, weight_scheme=md.QuantScheme(
        "int8", group_size=32)), caps)
    assert not d.accepted and "per output channel only" in d.reason
    # torch's int8 kernel is wrong or crashes unless K (H for w13, I for w2) % 16 == 0
    for h, i, field in ((200, 64, "hidden_size=200"), (64, 72, "intermediate_size=72")):
        d = TorchWoqBackend().supports_config(md.MoEConfig(
            4, 2, h, i, weight_scheme=md.QuantScheme("int8")), caps)
        assert not d.accepted and field in d.reason and "multiple of 16" in d.reason
    assert TorchWoqBackend().supports_config(md.MoEConfig(
        4, 2, 208, 80, weight_scheme=md.QuantScheme("int8")), caps).accepted
    res = md.resolve(md.MoEConfig(8, 2, 64, 64))  # float weights: it is not asked
    cand = next(c for c in res.candidates if c.name == "torch_woq")
    assert "runs int4/int8 weights; this config has float weights" in cand.reason


@pytest.mark.parametrize("scheme", [md.QuantScheme("int8"), md.QuantScheme("int4", group_size=32),
                                    md.QuantScheme("int4", group_size=32, symmetric=False)],
                         ids=lambda s: s.describe())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 5e6])
def test_weights_whose_scale_cannot_be_stored_are_refused(scheme, bad):
    """A NaN or infinite weight, or a group beyond float16's range (fp16 scales), would
    dequantize to NaN: quantize_experts names the field instead."""
    w13 = torch.randn(2, 64, 64)
    w13[1, 3, 5] = bad
    if bad == 5e6 and scheme.group_size is None:  # float32 scales: it fits
        assert torch.isfinite(md.quantize_experts(w13, torch.randn(2, 64, 32), scheme).dequantize()[0]).all()
        return
    with pytest.raises(md.InvalidArgumentError, match="w13=.*finite weights whose scale fits"):
        md.quantize_experts(w13, torch.randn(2, 64, 32), scheme)
