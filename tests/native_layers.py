"""The native backend's test layers, shared by its test modules (test_native_backend.py,
test_native_numerics.py, test_native_blocks.py, test_native_extension.py): the builds this
CPU runs (the ``build`` fixture selects each as a user would), small configs, forced native
layers with the float weights their reference uses, and the check against that reference.

bf16 weights are checked within the bf16 tolerance; int8 / int4 weights within
``ERROR_BOUND`` of the reference computed on the dequantized weights (the kernel quantizes
its activations per 32 values as well, x per 128 above 16 tokens in the blocked layout;
test_native_blocks.py holds layers of a model's size to ``AIM_BOUND``)."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, machine, random_routing, random_weights, rel_error
from moe_dispatch_backends.native import ERROR_BOUND, kernel

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


def layer_config(scheme=None, **kw) -> md.MoEConfig:
    """E=8 top-2 H=256 I=128 bf16, with ``scheme``'s weights and any field of ``kw``."""
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, dtype=torch.bfloat16)
    base.update(kw)
    return md.MoEConfig(**base, weight_scheme=scheme)


def require_build(isa: str) -> None:
    """Skips, with the build's status, where this CPU's ``isa`` build cannot be loaded."""
    module = kernel.load(isa)
    if module is None:
        pytest.skip(f"the native kernel's {isa} build is unavailable: {kernel.status(isa)}")


@pytest.fixture(params=BUILDS or ["none"])
def build(request, monkeypatch):
    """Each build this CPU runs, selected as a user would (MOE_DISPATCH_NATIVE_ISA)."""
    if request.param == "none":
        pytest.skip(f"this CPU runs no build of the native kernel: {kernel.isa_for(HERE)[1]}")
    monkeypatch.setenv(kernel.ISA_ENV, request.param)
    require_build(request.param)
    return request.param


def native_layer(cfg: md.MoEConfig, seed: int = 1):
    """A forced native layer, the float weights its reference uses (dequantized), and what
    it was loaded from (the weights dict, or the QuantizedExperts)."""
    fcfg = layer_config(None, **{k: getattr(cfg, k) for k in
                                 ("num_experts", "top_k", "hidden_size", "intermediate_size", "activation",
                                  "apply_router_weight_on_input", "has_bias")})
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


def check_layer(layer: md.MoELayer, cfg: md.MoEConfig, ref_w: dict, tokens: int, seed: int = 2) -> float:
    """``tokens`` random tokens through ``layer`` against the float64 reference on ``ref_w``,
    within the format's bound; returns the relative error."""
    x, tw, ids = random_routing(cfg, tokens, seed=seed)
    out = layer(x, tw, ids)
    assert out.dtype == cfg.dtype and out.shape == x.shape
    want = moe_reference(cfg, x, ref_w["w13"], ref_w["w2"], tw, ids, ref_w.get("w13_bias"),
                         ref_w.get("w2_bias"))
    bound = TOLERANCE[torch.bfloat16] if cfg.weight_scheme is None else ERROR_BOUND
    err = rel_error(out, want)
    assert err <= bound, (cfg.describe(), tokens, err)
    return err
