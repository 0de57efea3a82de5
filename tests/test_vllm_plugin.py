"""The vLLM plugin's rules and seam, without an engine: vLLM-shaped layers and an experts
class with vLLM 0.32's method signatures (tests/vllm_standins.py). A weight update:
tests/test_vllm_plugin_reload.py; tests/test_vllm_engine.py runs the real engine."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.testing import TOLERANCE, random_routing, random_weights, reference, rel_error
from moe_dispatch.vllm_plugin import _seam
from moe_dispatch.vllm_plugin._describe import NotServed, describe, summary

from vllm_standins import CONFIG, LOG, Act, Layer, apply_experts, experts_class


def test_describe_maps_a_layer_to_views_of_its_parameters() -> None:
    config = md.MoEConfig(8, 2, 64, 32, activation="gelu_tanh", dtype=torch.bfloat16,
                          has_bias=True)
    layer = Layer(config)
    got, weights = describe(layer)
    assert got == config
    assert weights["w13"].data_ptr() == layer.w13_weight.data_ptr()
    assert weights["w2_bias"].data_ptr() == layer.w2_bias.data_ptr()


@pytest.mark.parametrize("change, reason", [
    (lambda l: setattr(l, "expert_map", torch.arange(8)), "expert parallelism"),
    (lambda l: setattr(l.moe_config, "is_lora_enabled", True), "LoRA"),
    (lambda l: setattr(l.moe_config, "is_act_and_mul", False), "ungated experts"),
    (lambda l: setattr(l, "activation", Act("relu2")), "activation 'relu2'"),
    (lambda l: setattr(l, "activation", Act("swigluoai_uninterleave")), "swigluoai_uninterleave"),
    (lambda l: setattr(l, "w13_weight", torch.nn.Parameter(
        torch.zeros(8, 64, 64, dtype=torch.int8), requires_grad=False)), "torch.int8"),
    (lambda l: setattr(l, "apply_router_weight_on_input", True), "top_k=2"),
])
def test_describe_names_what_it_does_not_serve(change: Any, reason: str) -> None:
    layer = Layer(CONFIG)
    change(layer)
    with pytest.raises(NotServed, match=reason):
        describe(layer)


def test_swigluoai_constants_other_than_gpt_oss_are_not_served() -> None:
    layer = Layer(md.MoEConfig(8, 2, 64, 32, activation="swigluoai", dtype=torch.float32))
    layer.swiglu_alpha, layer.swiglu_limit = 1.702, 7.0
    assert describe(layer)[0].activation is md.Activation.SWIGLUOAI
    layer.swiglu_limit = 10.0
    with pytest.raises(NotServed, match="swiglu_limit=10.0"):
        describe(layer)


def test_summary_names_the_backend_per_token_count_and_every_skip() -> None:
    layer = md.MoELayer(CONFIG, backend="torch").load_weights(
        **{k: v for k, v in random_weights(CONFIG).items() if v is not None}).prepare()
    line = summary(layer)
    assert line.startswith(CONFIG.describe() + " -> torch (every T) [forced: torch]")
    assert "; not used: " in line and "torch_woq: runs int4/int8 weights" in line


def test_summary_groups_the_token_buckets_by_backend() -> None:
    from types import SimpleNamespace
    fake = SimpleNamespace(tuned_table={1: "a", 2: "a", 4: "b", 8: "b", 16: "c", 32: "a"},
                           backend="a", policy="auto", config=CONFIG,
                           resolution=SimpleNamespace(candidates=[], forced=None))
    assert summary(fake) == (CONFIG.describe() +
                             " -> a (T=1..2), b (T=3..8), c (T=9..16), a (T>=17) [policy=auto]")


def test_a_served_layer_runs_through_moe_dispatch_and_keeps_vllms_parameters(
        caplog: pytest.LogCaptureFixture) -> None:
    cls = experts_class()
    assert _seam.install(cls, [], dict, LOG)
    layer = Layer(CONFIG)
    before = (layer.w13_weight, layer.w13_weight._version, layer.w13_weight.detach().clone())
    experts = cls(CONFIG)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        experts.process_weights_after_loading(layer)
    assert experts.calls == []  # vLLM's prepack did not run
    assert "moe-dispatch: " + CONFIG.describe() + " -> " in caplog.text
    x, tw, ids = random_routing(CONFIG, 5, seed=3)
    got = apply_experts(experts, layer, x, tw, ids)
    assert experts.calls == []
    assert rel_error(got, reference(CONFIG, layer.weights, x, tw, ids)) < TOLERANCE[torch.float32]
    assert layer.w13_weight is before[0] and layer.w13_weight._version == before[1]
    assert torch.equal(layer.w13_weight, before[2])


def test_one_log_line_per_distinct_shape(caplog: pytest.LogCaptureFixture) -> None:
    _seam._LOGGED.clear()
    cls = experts_class()
    _seam.install(cls, [], dict, LOG)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        for seed in range(3):
            cls(CONFIG).process_weights_after_loading(Layer(CONFIG, seed=seed))
        other = md.MoEConfig(8, 2, 64, 64, dtype=torch.float32)
        cls(other).process_weights_after_loading(Layer(other))
    lines = [r for r in caplog.records if "moe-dispatch: E=" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines)


def test_a_layer_not_served_stays_on_vllms_path(caplog: pytest.LogCaptureFixture) -> None:
    _seam._LOGGED.clear()
    cls = experts_class()
    _seam.install(cls, [], dict, LOG)
    layer = Layer(CONFIG, activation="relu2")
    experts = cls(CONFIG)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        experts.process_weights_after_loading(layer)
    assert experts.calls == ["prepack"]
    assert "left to vLLM's MoE path: activation 'relu2'" in caplog.text
    apply_experts(experts, layer, *random_routing(CONFIG, 3))
    assert experts.calls == ["prepack", "apply"]


def test_an_unknown_backend_name_leaves_the_layer_to_vllm(caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _seam._LOGGED.clear()
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "no_such_backend")
    cls = experts_class()
    _seam.install(cls, [], dict, LOG)
    experts = cls(CONFIG)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        experts.process_weights_after_loading(Layer(CONFIG))
    assert experts.calls == ["prepack"]
    assert "no_such_backend" in caplog.text


def test_router_weight_on_the_input_combines_with_weight_one() -> None:
    config = md.MoEConfig(8, 1, 64, 32, dtype=torch.float32)
    cls = experts_class()
    _seam.install(cls, [], dict, LOG)
    layer = Layer(config)
    layer.apply_router_weight_on_input = True
    experts = cls(config)
    experts.process_weights_after_loading(layer)
    x, tw, ids = random_routing(config, 4, seed=5)
    scaled = x * tw  # what vLLM's prepare step hands the experts
    got = apply_experts(experts, layer, scaled, tw, ids, on_input=True)
    want = reference(config, layer.weights, scaled, torch.ones_like(tw), ids)
    assert rel_error(got, want) < TOLERANCE[torch.float32]


def test_a_run_time_failure_hands_the_layer_to_vllms_path(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cls = experts_class()
    _seam.install(cls, [], dict, LOG)
    layer = Layer(CONFIG)
    experts = cls(CONFIG)
    experts.process_weights_after_loading(layer)

    def broken(self: Any, *args: Any) -> torch.Tensor:
        raise md.KernelError("every backend failed")
    monkeypatch.setattr(md.MoELayer, "__call__", broken)
    x, tw, ids = random_routing(CONFIG, 3, seed=2)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        got = apply_experts(experts, layer, x, tw, ids)
    assert "vLLM's MoE path takes the layer over" in caplog.text
    assert experts.calls == ["prepack", "apply"]
    assert rel_error(got, reference(CONFIG, layer.weights, x, tw, ids)) < TOLERANCE[torch.float32]
    apply_experts(experts, layer, x, tw, ids)
    assert experts.calls == ["prepack", "apply", "apply"]  # for good


def test_a_vllm_with_other_signatures_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    class Other:
        def process_weights_after_loading(self, layer): ...
        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids): ...
    before = (Other.apply, Other.process_weights_after_loading)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert not _seam.install(Other, [], dict, LOG)
    assert (Other.apply, Other.process_weights_after_loading) == before
    assert "the plugin knows apply" in caplog.text


def test_quantized_experts_classes_log_that_they_stay_on_vllm(
        caplog: pytest.LogCaptureFixture) -> None:
    _seam._LOGGED.clear()

    class CPUExpertsInt8:
        def __init__(self) -> None:
            self.ran = False

        def process_weights_after_loading(self, layer: Any) -> None:
            self.ran = True
    _seam.install(experts_class(), [CPUExpertsInt8], dict, LOG)
    experts = CPUExpertsInt8()
    with caplog.at_level(logging.INFO, logger=LOG.name):
        experts.process_weights_after_loading(Layer(CONFIG))
    assert experts.ran
    assert "quantized experts (CPUExpertsInt8) are not mapped" in caplog.text


def test_register_is_off_with_the_env_and_never_raises(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import moe_dispatch.vllm_plugin as plugin
    monkeypatch.setenv(plugin.ENV, "0")
    assert not plugin.enabled()
    with caplog.at_level(logging.INFO):
        plugin.register()
    assert "plugin off" in caplog.text
    monkeypatch.delenv(plugin.ENV)
    assert plugin.enabled()
    plugin.register()  # here vLLM's engine may not import: a warning, never an exception


def test_the_plugin_is_registered_for_vllm() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("moe_dispatch") == "moe_dispatch.vllm_plugin:register"


def test_the_plugins_layers_leave_out_the_default_backends_unless_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import moe_dispatch.vllm_plugin as plugin
    monkeypatch.delenv(plugin.EXCLUDE_ENV, raising=False)
    monkeypatch.delenv("MOE_DISPATCH_BACKEND", raising=False)
    # by default: the backends whose spec avoids the host (zentorch declares it on CPUs
    # without AVX512-BF16, where it slowed the engine; it competes on those with it)
    registered = any(r.name == "zentorch" for r in md.get_registry().snapshot().records)
    avoided = ("zentorch",) if registered and not md.Capabilities.detect().avx512_bf16 else ()
    assert plugin.default_exclude() == avoided
    assert plugin.layer_options().get("exclude", ()) == avoided
    monkeypatch.setenv(plugin.EXCLUDE_ENV, " torch , onednn")
    assert plugin.layer_options()["exclude"] == ("torch", "onednn")
    monkeypatch.setenv(plugin.EXCLUDE_ENV, "")
    assert "exclude" not in plugin.layer_options()  # every backend competes
    monkeypatch.setattr(plugin, "LAYER_OPTIONS", {"exclude": ("vllm",)})
    monkeypatch.setenv(plugin.EXCLUDE_ENV, "zentorch")
    assert plugin.layer_options()["exclude"] == ("vllm", "zentorch")
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "zentorch")  # forced: never left out
    assert plugin.layer_options() == {"exclude": ("vllm",)}
    monkeypatch.setattr(plugin, "LAYER_OPTIONS", {"backend": "torch"})
    monkeypatch.delenv("MOE_DISPATCH_BACKEND")
    assert plugin.layer_options() == {"backend": "torch"}
    # the layer built from those options shows the exclusion in explain()
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    monkeypatch.setattr(plugin, "LAYER_OPTIONS", {})
    monkeypatch.delenv(plugin.EXCLUDE_ENV)
    if not avoided:  # zentorch competes here by default: leave it out by name instead
        monkeypatch.setenv(plugin.EXCLUDE_ENV, "zentorch")
    layer = md.MoELayer(cfg, tuning_cache=False, **plugin.layer_options())
    assert "zentorch" in layer.load_weights(**random_weights(cfg)).prepare().resolution.excluded


def test_the_default_exclusion_is_what_the_registered_backends_declare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin names no backend: a vendor's spec that avoids the host is left out like the
    built-in one, and none is when no registered backend declares it."""
    import moe_dispatch.vllm_plugin as plugin
    monkeypatch.delenv(plugin.EXCLUDE_ENV, raising=False)
    monkeypatch.delenv("MOE_DISPATCH_BACKEND", raising=False)
    loop = md.get_registry().snapshot().by_name("torch").spec.backend
    with md.use_registry(md.Registry(load_entry_points=False)):
        md.register(md.BackendSpec("plain", 10, loop))
        assert plugin.default_exclude() == ()
        assert "exclude" not in plugin.layer_options()
        md.register(md.BackendSpec("vendor_x", 20, loop, avoid_hosts=["vllm", "other_host"]))
        assert plugin.default_exclude() == ("vendor_x",)
        assert plugin.layer_options()["exclude"] == ("vendor_x",)
    for bad in (["vLLM engine"], [""]):
        with pytest.raises(ValueError, match="avoid_hosts"):
            md.BackendSpec("vendor_y", 1, loop, avoid_hosts=bad)


def test_a_blank_forced_backend_keeps_the_default_exclusions(monkeypatch):
    """A blank MOE_DISPATCH_BACKEND is unset (as the resolver reads it), not a forced backend
    that would lift the exclusions."""
    import moe_dispatch.vllm_plugin as plugin
    monkeypatch.setenv(plugin.EXCLUDE_ENV, "zentorch")
    monkeypatch.setenv("MOE_DISPATCH_BACKEND", "  ")
    assert plugin.layer_options()["exclude"] == ("zentorch",)
