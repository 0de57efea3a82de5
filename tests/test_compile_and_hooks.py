"""MoELayer under torch.compile (fullgraph, inductor, nn.Module.compile, a compiled caller) and
torch.jit.trace, with forward hooks and a replaced or subclassed forward: eager's results, the
hooks run, a trace keeps its layer alive; on both call paths (the C call slot and the Python
``__call__``) where the slot is in use."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe_dispatch as md
from helpers import random_routing, random_weights, rel_error

CFG = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)


@pytest.mark.usefixtures("call_path")
@pytest.mark.parametrize("backend", [c.name for c in md.resolve(CFG).candidates if c.decision.accepted])
def test_torch_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    w = random_weights(CFG)
    layer = md.MoELayer(CFG, backend=backend).load_weights(**w).prepare()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for t in (5, 9):
        x, tw, ids = random_routing(CFG, t, seed=t)
        assert torch.equal(compiled(x, tw, ids), layer(x, tw, ids))

    def block(x, logits):
        tw, ids = md.select_experts(logits, CFG.top_k)
        return md.moe_experts(layer, x * 2, tw, ids) + 1

    fn = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, logits = torch.randn(6, 64), torch.randn(6, 8)
    assert rel_error(fn(x, logits), block(x, logits)) <= 1e-6


def test_torch_compile_inductor_once():
    """The default inductor backend too (slower to compile: one small case)."""
    torch._dynamo.reset()
    w = random_weights(CFG)
    layer = md.MoELayer(CFG).load_weights(**w).prepare()
    compiled = torch.compile(layer, fullgraph=True)
    x, tw, ids = random_routing(CFG, 7)
    assert torch.equal(compiled(x, tw, ids), layer(x, tw, ids))


@pytest.mark.usefixtures("call_path")
def test_hooks_still_run_on_the_fast_path():
    """MoELayer.__call__ skips nn.Module's hook machinery only when no hook is registered."""
    w = random_weights(CFG)
    layer = md.MoELayer(CFG).load_weights(**w).prepare()
    x, tw, ids = random_routing(CFG, 4, seed=3)
    plain = layer(x, tw, ids)
    seen = []
    pre = layer.register_forward_pre_hook(lambda mod, args: (args[0] * 2, *args[1:]))
    post = layer.register_forward_hook(lambda mod, args, out: out + 1)
    assert torch.allclose(layer(x, tw, ids), layer.forward(x * 2, tw, ids) + 1)
    pre.remove(), post.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: seen.append(type(mod).__name__))
    try:
        assert torch.equal(layer(x, tw, ids), plain)
    finally:
        handle.remove()
    assert seen == ["MoELayer"]
    assert torch.equal(layer(x, tw, ids), plain)


class _WithSharedExpert(md.MoELayer):
    def forward(self, hidden_states, topk_weights, topk_ids):
        return super().forward(hidden_states, topk_weights, topk_ids) + hidden_states


@pytest.mark.usefixtures("call_path")
def test_a_replaced_or_subclassed_forward_still_runs():
    """The fast path skips forward(): it must not for a subclass's forward, nor for an
    instance whose forward was replaced (accelerate's hooks do that)."""
    w = random_weights(CFG)
    x, tw, ids = random_routing(CFG, 4, seed=3)
    layer = md.MoELayer(CFG).load_weights(**w).prepare()
    plain = layer(x, tw, ids)
    calls = []

    def replaced(*args):
        calls.append(len(args))
        return plain * 3

    layer.forward = replaced
    assert torch.equal(layer(x, tw, ids), plain * 3) and calls == [3]
    del layer.forward  # the class's forward again, and the fast path
    assert torch.equal(layer(x, tw, ids), plain) and calls == [3]
    layer.run = replaced  # forward calls run: an instance's run is honoured too
    assert torch.equal(layer(x, tw, ids), plain * 3) and calls == [3, 3]
    del layer.run
    sub = _WithSharedExpert(CFG).load_weights(**w).prepare()
    assert torch.allclose(sub(x, tw, ids), plain + x)


@pytest.mark.usefixtures("call_path")
def test_a_trace_keeps_its_layer_alive():
    """model = torch.jit.trace(model, ...) drops the last other reference to the layer: the
    trace holds its handle only, so the layer is kept for it."""
    import gc
    w = random_weights(CFG)
    x, tw, ids = random_routing(CFG, 4, seed=3)
    want = md.MoELayer(CFG, backend="torch").load_weights(**w).prepare()(x, tw, ids)
    model = md.MoELayer(CFG, backend="torch").load_weights(**w).prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.jit.trace(model, (x, tw, ids), check_trace=False)
    gc.collect()
    assert torch.allclose(model(x, tw, ids), want)


@pytest.mark.usefixtures("call_path")
def test_module_compile_in_place():
    """nn.Module.compile() (the in-place variant) goes through the custom op too."""
    torch._dynamo.reset()
    w = random_weights(CFG)
    layer = md.MoELayer(CFG).load_weights(**w).prepare()
    x, tw, ids = random_routing(CFG, 5, seed=5)
    eager = layer(x, tw, ids)
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    layer.compile(fullgraph=True, backend=counter)
    assert torch.equal(layer(x, tw, ids), eager)
    assert counter.frame_count == 1  # it really ran compiled


@pytest.mark.usefixtures("call_path")
def test_torch_jit_trace_of_a_layer_with_a_bucket_table():
    """Under torch.jit.trace a shape is a traced tensor: the bucket lookup takes its int."""
    layer = md.MoELayer(CFG, policy="fastest", tune_max_tokens=4, tuning_cache=False)
    layer.load_weights(**random_weights(CFG)).prepare()
    assert layer.plan.table is not None
    x, tw, ids = random_routing(CFG, 3, seed=4)
    with warnings.catch_warnings():  # tracing warnings (data-dependent branches)
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(layer, (x, tw, ids), check_trace=False)
    assert torch.allclose(traced(x, tw, ids), layer(x, tw, ids))


@pytest.mark.usefixtures("call_path")
def test_a_compiled_caller_traces_the_fast_path_once():
    """Dynamo traces MoELayer.__call__ when a compiled function calls the layer: its checks
    must steer it to the custom op without a guard that fails in eager (a recompile at every
    call) and without a graph break."""
    torch._dynamo.reset()
    layer = md.MoELayer(CFG).load_weights(**random_weights(CFG)).prepare()
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, tw, ids: layer(x, tw, ids) + 1, fullgraph=True, backend=counter)
    for seed in range(4):
        x, tw, ids = random_routing(CFG, 5, seed=seed)
        assert torch.equal(fn(x, tw, ids), layer(x, tw, ids) + 1)
    assert counter.frame_count == 1
