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
    with pytest.raises(mdhf.HFIntegrationError, match=r"qwen3_moe \(Qwen3MoeExperts\).*activation 'relu'"):
        _logits(model, torch.randint(0, 128, (1, 3)))
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
