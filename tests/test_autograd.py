"""Calls that autograd would record (moe_dispatch/_autograd.py): exact gradients on a
differentiable backend, a backward that raises on every other, never a silent zero."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moe_dispatch as md
from helpers import accepting as _accepting, copying_backends, random_routing, random_weights, rel_error
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing.strategies import small_configs

CFG = {d: md.MoEConfig(8, 2, 64, 48, dtype=d) for d in (torch.bfloat16, torch.float32)}


def _layer(config: md.MoEConfig, backend: str | None, w: dict) -> md.MoELayer:
    return md.MoELayer(config, backend=backend).load_weights(
        w["w13"], w["w2"], w13_bias=w["w13_bias"], w2_bias=w["w2_bias"]).prepare()


FORWARD_ONLY = [(d, b) for d, cfg in CFG.items() for b in copying_backends(cfg)]


@pytest.mark.parametrize(("dtype", "backend"), FORWARD_ONLY, ids=lambda v: str(v))
@pytest.mark.parametrize("needs", ["hidden_states", "topk_weights", "weights"])
def test_forward_only_backends_raise_in_backward(dtype, backend, needs):
    """The residual pattern of every transformer block: without the backward node, x's
    gradient would silently miss the experts' share."""
    cfg = CFG[dtype]
    w = random_weights(cfg, seed=3)
    if needs == "weights":
        w = {k: None if v is None else torch.nn.Parameter(v.clone()) for k, v in w.items()}
    layer = _layer(cfg, backend, w)
    x, tw, ids = random_routing(cfg, 5, seed=4)
    with torch.no_grad():
        want = layer(x, tw, ids)
    x = x.clone().requires_grad_(needs == "hidden_states")
    tw = tw.clone().requires_grad_(needs == "topk_weights")
    out = layer(x, tw, ids)
    assert out.requires_grad and torch.equal(out.detach(), want)
    loss = (out.float() + x.float()).sum() if needs == "hidden_states" else out.float().sum()
    with pytest.raises(md.NotDifferentiableError, match=f"backend {backend!r}.*backend='torch'"):
        loss.backward()


def test_no_grad_calls_take_the_native_entry_and_record_nothing():
    cfg = CFG[torch.float32]
    w = random_weights(cfg, seed=5)
    entries = [b for b in _accepting(cfg) if _layer(cfg, b, w).uses_native_entry]
    if not entries:
        pytest.skip("no backend with a native entry accepts fp32 here")
    x, tw, ids = random_routing(cfg, 3, seed=6)
    x.requires_grad_(True)
    for backend in entries:
        layer = _layer(cfg, backend, w)
        assert layer.plan.native(x, tw, ids) is None, backend  # grad mode: declined
        with torch.no_grad():
            got = layer.plan.native(x, tw, ids)
            assert got is not None and not got.requires_grad, backend
            assert torch.equal(layer(x, tw, ids), got)
        with torch.inference_mode():
            assert layer.plan.native(x, tw, ids) is not None, backend


@settings(max_examples=25)
@given(config=small_configs(max_hidden=48, max_inter=32, max_experts=6, dtypes=(torch.float32,)),
       tokens=st.integers(1, 6), seed=st.integers(0, 2 ** 20))
def test_torch_backend_gradients_match_the_float64_reference(config, tokens, seed):
    w = {k: None if v is None else torch.nn.Parameter(v.clone())
         for k, v in random_weights(config, seed=seed).items()}
    layer = _layer(config, "torch", w)
    x, tw, ids = random_routing(config, tokens, seed=seed + 1)
    x.requires_grad_(True)
    tw.requires_grad_(True)
    probe = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(seed))
    leaves = {"hidden_states": x, "topk_weights": tw, **{k: v for k, v in w.items() if v is not None}}
    got = dict(zip(leaves, torch.autograd.grad((probe * layer(x, tw, ids)).sum(), list(leaves.values()))))
    ref = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    out = moe_reference(config, ref["hidden_states"], ref["w13"], ref["w2"], ref["topk_weights"], ids,
                        ref.get("w13_bias"), ref.get("w2_bias"))
    want = dict(zip(ref, torch.autograd.grad((probe.double() * out).sum(), list(ref.values()),
                                             allow_unused=True)))
    for name, g in got.items():
        if want[name] is None:  # e.g. an expert no token chose: no gradient either way
            assert g is None or not g.any(), name
            continue
        assert rel_error(g, want[name]) <= 1e-5, (name, config.describe())


def test_training_steps_through_the_torch_backend():
    """An optimizer updates the weights in place between steps: the differentiable backend
    computes on them, so each step runs (no WeightsModifiedError) on the updated values."""
    config = CFG[torch.float32]
    w = {k: None if v is None else torch.nn.Parameter(v.clone())
         for k, v in random_weights(config, seed=5).items()}
    layer = _layer(config, "torch", w)
    params = [v for v in w.values() if v is not None]
    opt = torch.optim.SGD(params, lr=0.1)
    x, tw, ids = random_routing(config, 16, seed=6)
    losses = []
    for _ in range(3):
        out = layer(x, tw, ids)
        with torch.no_grad():
            want = moe_reference(config, x, w["w13"], w["w2"], tw, ids, w["w13_bias"], w["w2_bias"])
        assert rel_error(out, want) <= 1e-5
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]


def test_quantized_torch_backend_gives_the_hidden_states_gradient():
    cfg = md.MoEConfig(8, 2, 64, 48, dtype=torch.float32, weight_scheme=md.QuantScheme("int8"))
    w = random_weights(md.MoEConfig(8, 2, 64, 48, dtype=torch.float32), seed=7)
    qe = md.quantize_experts(w["w13"], w["w2"], cfg.weight_scheme)
    layer = md.MoELayer(cfg, backend="torch").load_weights(qe).prepare()
    x, tw, ids = random_routing(cfg, 4, seed=8)
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(layer(x, tw, ids).sum(), [x])
    w13, w2 = qe.dequantize()
    ref_x = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(moe_reference(cfg, ref_x, w13, w2, tw, ids).sum(), [ref_x])
    assert rel_error(g, want) <= 1e-5


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_compiled_layer_runs_in_grad_mode_and_raises_in_backward(compiler):
    """aot_eager traces the backward while it compiles: without the op's autograd rule the
    forward itself failed to compile whenever the hidden states required grad."""
    cfg = CFG[torch.float32]
    w = random_weights(cfg, seed=9)
    layer = _layer(cfg, None, w)
    x, tw, ids = random_routing(cfg, 3, seed=10)
    with torch.no_grad():
        want = layer(x, tw, ids)
    x.requires_grad_(True)
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c: layer(a, b, c), fullgraph=True, backend=compiler)
    out = fn(x, tw, ids)
    assert torch.equal(out.detach(), want)
    with pytest.raises(md.NotDifferentiableError, match="torch.compile"):
        (out + x).sum().backward()


def _forward_only_backend(config: md.MoEConfig) -> str:
    names = [n for d, n in FORWARD_ONLY if d == config.dtype]
    if not names:
        pytest.skip("every accepting backend here is differentiable")
    return names[0]


def test_output_of_a_recorded_call_can_be_written_in_place():
    """out += shared_expert(x), as models with shared experts do."""
    cfg = CFG[torch.float32]
    layer = _layer(cfg, _forward_only_backend(cfg), random_weights(cfg, seed=11))
    x, tw, ids = random_routing(cfg, 4, seed=12)
    x.requires_grad_(True)
    out = layer(x, tw, ids)
    out += x
    with pytest.raises(md.NotDifferentiableError):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["torch", "forward-only"])
def test_empty_batches_in_grad_mode_backpropagate(backend):
    cfg = CFG[torch.float32]
    name = backend if backend == "torch" else _forward_only_backend(cfg)
    layer = _layer(cfg, name, random_weights(cfg, seed=13))
    x = torch.randn(0, cfg.hidden_size, requires_grad=True)
    out = layer(x, torch.zeros(0, cfg.top_k), torch.zeros(0, cfg.top_k, dtype=torch.int32))
    (out + x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_jit_trace_of_a_recorded_call_stays_savable(tmp_path):
    cfg = CFG[torch.float32]
    layer = _layer(cfg, _forward_only_backend(cfg), random_weights(cfg, seed=14))
    x, tw, ids = random_routing(cfg, 4, seed=15)
    x.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracing warnings, and torch.jit.save/load's deprecation
        traced = torch.jit.trace(layer, (x, tw, ids), check_trace=False)
        torch.jit.save(traced, str(tmp_path / "layer.pt"))
        loaded = torch.jit.load(str(tmp_path / "layer.pt"))
    with torch.no_grad():
        assert torch.equal(loaded(x, tw, ids), layer(x, tw, ids))


def test_differentiable_must_be_a_bool():
    from moe_dispatch_backends import torch_loop

    with pytest.raises(TypeError, match="differentiable"):
        md.BackendSpec("x", 1, torch_loop.TorchLoopBackend(), differentiable="yes")
    assert md.get_registry().snapshot().by_name("torch").spec.differentiable


class _Copying(md.BackendBase):
    """Torch ops on its own copies of the weights: its output has a graph through the hidden
    states, none through the caller's weights (not differentiable in the spec's sense)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def supports_config(self, config, capabilities):
        return md.accept()

    def process_weights(self, weights, capabilities):
        return md.LayerWeights(weights.config, weights.w13.clone(), weights.w2.clone())

    def apply(self, state, x, tw, ids):
        if self.fail:
            raise RuntimeError("kernel failed")
        from moe_dispatch.kernels import expert_loop
        return expert_loop(state, x, tw, ids)


def test_a_fallback_from_the_differentiable_route_is_not_trusted_for_gradients():
    from helpers import torch_and

    cfg = md.MoEConfig(8, 2, 32, 16, dtype=torch.float32)
    w = {k: torch.nn.Parameter(v) for k, v in random_weights(cfg, seed=16).items() if v is not None}
    reg = torch_and(md.BackendSpec("flaky_exact", 900, _Copying(fail=True), differentiable=True),
                    md.BackendSpec("copying", 500, _Copying()))
    with md.use_registry(reg):
        layer = md.MoELayer(cfg).load_weights(w["w13"], w["w2"]).prepare()
        assert layer.backend == "flaky_exact"
        x, tw, ids = random_routing(cfg, 4, seed=17)
        out = layer(x, tw, ids)  # flaky_exact fails; copying takes over
        assert layer.backend == "copying"
        with pytest.raises(md.NotDifferentiableError, match="'copying'"):
            out.sum().backward()
