"""transformers integration: tiny models built from configs with random weights (no downloads)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-dispatch[hf]')")

import moe_dispatch as md  # noqa: E402
import moe_dispatch.hf as mdhf  # noqa: E402
from moe_dispatch import hf_config  # noqa: E402
from helpers import TOLERANCE  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _config(kind: str, **extra):
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=32,
                                           num_experts=8, num_experts_per_tok=2, head_dim=16, **extra)
    if kind == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                          num_experts_per_tok=2, **extra)
    # Families whose experts' activation is not config.hidden_act and whose config has no
    # num_experts_per_tok (or one their router does not read).
    if kind == "gemma4":  # act_fn from hidden_activation='gelu_pytorch_tanh'; top_k_experts
        return transformers.Gemma4TextConfig(**COMMON, intermediate_size=48, moe_intermediate_size=32,
                                             num_experts=4, top_k_experts=2, enable_moe_block=True,
                                             head_dim=16, layer_types=["sliding_attention",
                                                                       "full_attention"], **extra)
    if kind == "lfm2_moe":  # act_fn = F.silu, no hidden_act
        return transformers.Lfm2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=32,
                                          num_experts=4, num_experts_per_tok=2, num_dense_layers=0,
                                          layer_types=["full_attention", "conv"], **extra)
    if kind == "aria":  # act_fn = SiLU whatever hidden_act says; top-k is moe_topk
        return transformers.AriaTextConfig(**COMMON, intermediate_size=32, moe_num_experts=4,
                                           moe_topk=2, moe_num_shared_experts=1, **extra)
    return transformers.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                     num_experts_per_tok=2, head_dim=16,
                                     layer_types=["full_attention"] * 2, **extra)


def _model(kind: str, dtype: torch.dtype, impl: str = "eager", **extra):
    mdhf.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **extra), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # fresh random weights, never zeros
    model.set_experts_implementation(impl)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.to(torch.float64)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_eager_and_params_untouched(kind, dtype):
    model = _model(kind, dtype)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_dispatch")
    ours = _logits(model, ids)
    assert _rel(ours, eager) <= TOLERANCE[dtype] * (1 if dtype == torch.float32 else 2)
    layers = [m._moe_dispatch_layer[1] for m in model.modules() if hasattr(m, "_moe_dispatch_layer")]
    assert len(layers) == 2
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), saved[n].view(torch.uint8)), n
    # explain --hf-config and the integration agree on every layer's backend.
    spec = hf_config.load(model.config.to_dict(), dtype=dtype)
    assert {layer.backend for layer in layers} == {md.resolve(spec.config).backend}
    assert all(layer.config == spec.config for layer in layers)


def test_switch_back_and_forth_and_from_config_argument():
    model = _model("qwen3_moe", torch.float32)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    eager = _logits(model, ids)
    for impl in ("moe_dispatch", "eager", "moe_dispatch", "grouped_mm"):
        model.set_experts_implementation(impl)
        assert _rel(_logits(model, ids), eager) <= 1e-5, impl
    built = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe"),
                                                         experts_implementation="moe_dispatch")
    assert built.config._experts_implementation == "moe_dispatch"


def test_layer_cached_and_rebuilt_after_weight_change():
    model = _model("mixtral", torch.float32, impl="moe_dispatch")
    ids = torch.randint(0, 128, (1, 4))
    _logits(model, ids)
    experts = next(m for m in model.modules() if hasattr(m, "_moe_dispatch_layer"))
    first = experts._moe_dispatch_layer[1]
    _logits(model, ids)
    assert experts._moe_dispatch_layer[1] is first  # built once
    with torch.no_grad():
        experts.down_proj.mul_(0.5)
    after = _logits(model, ids)
    assert experts._moe_dispatch_layer[1] is not first  # in-place change: rebuilt, never stale
    model.set_experts_implementation("eager")
    assert _rel(after, _logits(model, ids)) <= 1e-5
    assert "_moe_dispatch_layer" not in dict(model.named_modules())  # not a submodule


def test_layer_rebuilt_after_new_data_or_a_dtype_move():
    """model.to(dtype) and p.data = ... keep each parameter and its version but replace its
    data: the cached layer is rebuilt, never run on the old weights or the old dtype."""
    model = _model("mixtral", torch.float32, impl="moe_dispatch")
    ids = torch.randint(0, 128, (1, 4))
    _logits(model, ids)
    experts = next(m for m in model.modules() if hasattr(m, "_moe_dispatch_layer"))
    first = experts._moe_dispatch_layer[1]
    experts.down_proj.data = experts.down_proj.data * 1.5
    after = _logits(model, ids)
    assert experts._moe_dispatch_layer[1] is not first
    model.set_experts_implementation("eager")
    assert _rel(after, _logits(model, ids)) <= 1e-5
    model.to(torch.bfloat16)
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_dispatch")
    assert _rel(_logits(model, ids), eager) <= 2 * TOLERANCE[torch.bfloat16]  # as the bf16 parity test
    assert experts._moe_dispatch_layer[1].config.dtype == torch.bfloat16


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def test_data_writes_are_seen_only_after_invalidate():
    """Writes through .data into the same storage move neither the version counter nor the
    storage: the cache cannot see them (documented); invalidate(model) drops the cached
    layers, and the next forward matches eager on the new weights."""
    model = _model("mixtral", torch.float32, impl="moe_dispatch")
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    _logits(model, ids)
    first = [e._moe_dispatch_layer[1] for e in _experts(model)]
    for e in _experts(model):
        e.down_proj.data.mul_(3.0)
        e.gate_up_proj.data.normal_(0, 0.1)
    _logits(model, ids)
    assert [e._moe_dispatch_layer[1] for e in _experts(model)] == first  # not seen: the limitation
    assert mdhf.invalidate(model) == 2
    assert mdhf.invalidate(model) == 0  # nothing cached any more
    ours = _logits(model, ids)
    assert all(e._moe_dispatch_layer[1] is not f for e, f in zip(_experts(model), first))
    model.set_experts_implementation("eager")
    assert _rel(ours, _logits(model, ids)) <= 1e-5
    with pytest.raises(md.InvalidTypeError, match="model has"):
        mdhf.invalidate("model")


def test_register_with_new_options_rebuilds_cached_layers():
    """register(backend="torch") after a forward (the way to train that NotDifferentiableError
    names): the cached layers are rebuilt with the new options, so a backward through frozen
    experts works; register() again with the same options rebuilds nothing."""
    model = _model("qwen3_moe", torch.float32, impl="moe_dispatch")
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    _logits(model, ids)
    first = [e._moe_dispatch_layer[1] for e in _experts(model)]
    try:
        mdhf.register(backend="torch")
        model.train()
        for e in _experts(model):
            e.requires_grad_(False)
        model(ids).logits.float().square().mean().backward()
        torch_layers = [e._moe_dispatch_layer[1] for e in _experts(model)]
        assert all(new is not old for new, old in zip(torch_layers, first))
        assert {layer.resolution.backend for layer in torch_layers} == {"torch"}
        assert model.lm_head.weight.grad is not None
        mdhf.register(backend="torch")
        _logits(model, ids)
        assert [e._moe_dispatch_layer[1] for e in _experts(model)] == torch_layers
    finally:
        mdhf.register()
    _logits(model, ids)
    assert all(e._moe_dispatch_layer[1] not in torch_layers for e in _experts(model))


@pytest.mark.parametrize("kind, activation", [("gemma4", md.Activation.GELU_TANH),
                                              ("lfm2_moe", md.Activation.SILU)])
def test_activation_from_the_module_and_top_k_from_the_call(kind, activation):
    """Gemma 4 (act_fn GELUTanh from hidden_activation, no num_experts_per_tok) and Lfm2-MoE
    (act_fn = F.silu, no hidden_act) were refused; they run and match eager."""
    model = _model(kind, torch.float32)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_dispatch")
    assert _rel(_logits(model, ids), eager) <= TOLERANCE[torch.float32]
    configs = {e._moe_dispatch_layer[1].config for e in _experts(model)}
    assert {(c.activation, c.top_k) for c in configs} == {(activation, 2)}


def test_module_activation_wins_over_the_config():
    """Aria's experts run SiLU whatever config.hidden_act says: with hidden_act="gelu" the
    layer computes SiLU, as eager does (it computed GELU: rel err ~0.2, silently)."""
    model = _model("aria", torch.float32, hidden_act="gelu")
    model.config.num_experts_per_tok = 2  # what the old lookup needed to build at all
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_dispatch")
    assert _rel(_logits(model, ids), eager) <= TOLERANCE[torch.float32]
    configs = {e._moe_dispatch_layer[1].config for e in _experts(model)}
    assert {(c.activation, c.top_k) for c in configs} == {(md.Activation.SILU, 2)}


def test_a_model_with_cached_layers_copies_and_saves():
    """copy.deepcopy(model) and torch.save(model) after a forward: the cached layer stays
    behind (the copy builds its own at its first forward, from its own parameters)."""
    import copy
    import io
    model = _model("mixtral", torch.float32, impl="moe_dispatch")
    ids = torch.randint(0, 128, (1, 4))
    want = _logits(model, ids)
    clone = copy.deepcopy(model)
    assert _rel(_logits(clone, ids), want) <= 1e-6
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert _rel(_logits(torch.load(buffer, weights_only=False), ids), want) <= 1e-6


def test_compiled_model_builds_its_layers_eagerly():
    """Under torch.compile the layer is built outside Dynamo (a trace would time the tuning
    and run the backends' process_weights symbolically: zentorch refused there)."""
    torch._dynamo.reset()
    model = _model("qwen3_moe", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 6))
    eager = _logits(model, ids)
    model.set_experts_implementation("moe_dispatch")
    compiled = torch.compile(model, backend="aot_eager")
    assert _rel(_logits(compiled, ids), eager) <= 2 * TOLERANCE[torch.bfloat16]
    experts = next(m for m in model.modules() if hasattr(m, "_moe_dispatch_layer"))
    layer = experts._moe_dispatch_layer[1]
    assert "raised" not in layer.explain(), layer.explain()
    want = md.MoELayer(layer.config, tuning_cache=False).resolution.backend
    assert layer.resolution.backend == want


def test_unrepresentable_models_are_refused_clearly():
    model = _model("qwen3_moe", torch.float32, impl="moe_dispatch", hidden_act="relu")
    with pytest.raises(mdhf.HFIntegrationError, match=r"qwen3_moe \(Qwen3MoeExperts\).*act_fn=ReLU"):
        _logits(model, torch.randint(0, 128, (1, 3)))
    # The erf GELU and its approximations are different functions: never taken for another.
    quick = _model("qwen3_moe", torch.float32, impl="moe_dispatch", hidden_act="quick_gelu")
    with pytest.raises(mdhf.HFIntegrationError, match=r"act_fn=QuickGELUActivation.*GELUTanh"):
        _logits(quick, torch.randint(0, 128, (1, 3)))
    oss = _model("gpt_oss", torch.float32, impl="moe_dispatch", swiglu_limit=5.0)
    with pytest.raises(mdhf.HFIntegrationError, match=r"gpt_oss.*limit=5.0"):
        _logits(oss, torch.randint(0, 128, (1, 3)))
    q = _model("qwen3_moe", torch.float32, impl="moe_dispatch")
    for m in q.modules():
        if hasattr(m, "has_gate"):
            m.has_gate = False
    with pytest.raises(mdhf.HFIntegrationError, match="has_gate=False"):
        _logits(q, torch.randint(0, 128, (1, 3)))


@pytest.mark.parametrize("frozen", [False, True])
def test_training_through_the_experts_raises_instead_of_dropping_gradients(frozen):
    """Grad mode with trainable parameters: the experts' parameter gradients would be
    missing (the layer reads detached views), so backward raises; with the experts frozen,
    the hidden states' gradient would miss the fused kernel's share: it raises too."""
    model = _model("qwen3_moe", torch.float32, impl="moe_dispatch").train()
    if frozen:
        for m in model.modules():
            if hasattr(m, "gate_up_proj"):
                m.requires_grad_(False)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    loss = model(ids).logits.float().square().mean()
    backend = md.resolve(hf_config.load(model.config.to_dict(), dtype=torch.float32).config).backend
    if frozen and backend == "torch":
        loss.backward()  # the differentiable loop: exact gradients for the hidden states
        return
    with pytest.raises(md.NotDifferentiableError, match="experts_implementation='eager'"
                       if not frozen else "force backend='torch'"):
        loss.backward()
