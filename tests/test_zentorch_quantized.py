"""zentorch's int8 / int4 fused MoE (the op's scales arguments): gates on simulated
machines everywhere; the real op where it runs (AVX-512 VNNI with zentorch: Zen 4 and newer).

The op quantizes its activations too (W8A8 / W4A8, backends/zentorch/_quant.py), so its
bound against the float64 reference on the dequantized weights is ERROR_BOUND (3e-2), not
the bf16 weight-only tolerance."""

from __future__ import annotations

import math

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import machine, random_routing, rel_error, thread_disagreements

from moe_dispatch_backends.zentorch import ZentorchBackend  # noqa: E402
from moe_dispatch_backends.zentorch._quant import ERROR_BOUND  # noqa: E402

ZEN4 = machine("zen4")
SYMMETRIC = [md.QuantScheme("int8"), md.QuantScheme("int8", group_size=32),
             md.QuantScheme("int4", group_size=32), md.QuantScheme("int4", group_size=64),
             md.QuantScheme("int4", group_size=128)]


def _cfg(scheme, **kw):
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    base.update(kw)
    return md.MoEConfig(**base, weight_scheme=scheme)


# -- the gate (simulated machines) ---------------------------------------------------------
@pytest.mark.parametrize("scheme", SYMMETRIC)
def test_gate_accepts_symmetric_schemes_in_bf16_with_vnni(scheme):
    d = ZentorchBackend().supports_config(_cfg(scheme), ZEN4)
    assert d.accepted and f"W{scheme.bits}A8" in d.reason, d.reason
    # Its state holds about two copies of the quantized weights (the op's cache and the
    # buffer it reads): over a quantized layer's default memory limit, it runs when the
    # limit is lifted.
    lifted = md.resolve(_cfg(scheme), capabilities=ZEN4, max_weight_copies=math.inf)
    assert lifted.backend == "zentorch"
    res = md.resolve(_cfg(scheme), capabilities=ZEN4)
    cand = next(c for c in res.candidates if c.name == "zentorch")
    assert res.backend != "zentorch" and str(cand.status) == "excluded"
    assert "max_weight_copies=1.1" in cand.reason and "copies" in cand.reason, cand.reason


def test_gate_rejects_what_the_op_cannot_run():
    int4 = md.QuantScheme("int4", group_size=32)
    cases = [
        (_cfg(md.QuantScheme("int4", group_size=32, symmetric=False)), ZEN4, "no zero points"),
        (_cfg(int4, dtype=torch.float32), ZEN4, "status -17"),
        (_cfg(int4, activation="gelu"), ZEN4, "silu only"),
        (_cfg(md.QuantScheme("int8"), hidden_size=130), ZEN4, "multiples of 4"),
        (_cfg(int4), ZEN4.evolve(avx512_vnni=False), "AVX-512 VNNI"),
        (_cfg(int4), machine("zen3"), "AVX512-BF16"),
    ]
    for cfg, caps, why in cases:
        d = ZentorchBackend().supports_config(cfg, caps)
        assert not d.accepted and why in d.reason, (cfg.describe(), d.reason)
    # An op without the scales arguments (an older zentorch) is refused for quantized
    # weights with the schema's reason, and still accepted for float ones.
    schema = dict(ZEN4.ops)["zentorch::zentorch_fused_moe"]
    old = schema.replace(", Tensor? w13_scales=None, Tensor? w2_scales=None", "")
    older = ZEN4.evolve(ops={"zentorch::zentorch_fused_moe": old})
    d = ZentorchBackend().supports_config(_cfg(int4), older)
    assert not d.accepted and "w13_scales" in d.reason
    assert ZentorchBackend().supports_config(md.MoEConfig(8, 2, 256, 128), older).accepted


# -- the real op -------------------------------------------------------------------------------
def _runs_here(scheme) -> tuple[bool, str]:
    res = md.resolve(_cfg(scheme), max_weight_copies=math.inf)
    cand = next((c for c in res.candidates if c.name == "zentorch"), None)
    return (cand is not None and cand.decision.accepted,
            cand.reason if cand is not None else "the zentorch backend is not registered")


RUNS, WHY = _runs_here(SYMMETRIC[0])
needs_op = pytest.mark.skipif(not RUNS, reason=f"zentorch's quantized MoE does not run here: {WHY}")


def _layer(scheme, seed=0, **kw):
    cfg = _cfg(scheme, **kw)
    g = torch.Generator().manual_seed(seed)
    b13 = (torch.randn(cfg.w13_bias_shape, generator=g) * 0.1).bfloat16() if cfg.has_bias else None
    b2 = (torch.randn(cfg.w2_bias_shape, generator=g) * 0.1).bfloat16() if cfg.has_bias else None
    qe = md.quantize_experts(torch.randn(cfg.w13_shape, generator=g) * 0.1,
                             torch.randn(cfg.w2_shape, generator=g) * 0.1, scheme, b13, b2)
    return cfg, qe, md.MoELayer(cfg, backend="zentorch").load_weights(qe).prepare()


def _error(cfg, qe, out, x, tw, ids):
    d13, d2 = qe.dequantize()
    return rel_error(out, moe_reference(cfg, x, d13, d2, tw, ids, qe.w13_bias, qe.w2_bias))


@needs_op
@pytest.mark.parametrize("scheme", SYMMETRIC, ids=lambda s: s.describe())
@pytest.mark.parametrize("shape", [dict(), dict(has_bias=True), dict(num_experts=16, top_k=4,
                                                                       hidden_size=512, intermediate_size=256),
                                   dict(top_k=1, apply_router_weight_on_input=True)],
                         ids=["plain", "bias", "wider", "router-weight-on-input"])
def test_the_op_is_within_its_bound_of_the_reference(scheme, shape):
    cfg, qe, layer = _layer(scheme, **shape)
    before = [t.clone() for t in (qe.w13.qweight, qe.w13.scales, qe.w2.qweight, qe.w2.scales)]
    st = layer.plan.route.state  # what the op is handed shares no storage with the caller
    storage = lambda ts: {t.untyped_storage().data_ptr() for t in ts}  # noqa: E731
    assert not storage((qe.w13.qweight, qe.w13.scales, qe.w2.qweight, qe.w2.scales)) & storage(
        (st.w13, st.w2, st.w13_scales, st.w2_scales))
    for tokens in (1, 5, 33):
        x, tw, ids = random_routing(cfg, tokens, seed=tokens)
        out = layer(x, tw, ids)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert _error(cfg, qe, out, x, tw, ids) <= ERROR_BOUND
        assert torch.equal(out, layer.run(x, tw, ids, native=False))  # C++ entry and Python path
    for a, b in zip(before, (qe.w13.qweight, qe.w13.scales, qe.w2.qweight, qe.w2.scales)):
        assert torch.equal(a, b)  # the caller's tensors are only read


@needs_op
def test_repeated_ids_no_tokens_and_in_place_updates():
    scheme = md.QuantScheme("int4", group_size=64)
    cfg, qe, layer = _layer(scheme)
    x, tw, ids = random_routing(cfg, 6, seed=1)
    ids[:, 1] = ids[:, 0]
    assert _error(cfg, qe, layer(x, tw, ids), x, tw, ids) <= ERROR_BOUND
    assert layer(x[:0], tw[:0], ids[:0]).shape == (0, cfg.hidden_size)
    qe.w13.scales.mul_(1.5)  # the op caches by address: it would keep the old values
    with pytest.raises(md.WeightsModifiedError, match="w13.scales"):
        layer(x, tw, ids)
    layer.prepare()  # new private copies at new addresses
    assert _error(cfg, qe, layer(x, tw, ids), x, tw, ids) <= ERROR_BOUND


@needs_op
def test_eight_threads_agree_with_the_serial_result():
    cfg, qe, layer = _layer(md.QuantScheme("int8"))
    inputs = [random_routing(cfg, t, seed=t) for t in (1, 3, 9, 17)]
    assert thread_disagreements(layer, inputs) == []
