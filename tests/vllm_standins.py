"""Stand-ins for what the vLLM plugin reads and patches, with vLLM 0.32's names and method
signatures (tests/test_vllm_plugin*.py): a RoutedExperts-shaped layer after weight loading,
a CPUUnquantizedExperts-like experts class (its own path computes the float64 reference and
counts its calls) and an UnquantizedFusedMoEMethod-like method class (its first hook builds
the experts object).
tests/test_vllm_engine.py runs the real engine."""

from __future__ import annotations

import logging
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.testing import random_weights, reference

LOG = logging.getLogger("test.vllm_plugin")


class Act:
    def __init__(self, value: str) -> None:
        self.value = value


class MoEConf:
    def __init__(self, config: md.MoEConfig, activation: str) -> None:
        self.num_experts = config.num_experts
        self.experts_per_token = config.top_k
        self.hidden_dim = config.hidden_size
        self.intermediate_size_per_partition = config.intermediate_size
        self.activation = Act(activation)
        self.in_dtype = config.dtype
        self.has_bias = config.has_bias
        self.is_act_and_mul = True
        self.is_lora_enabled = False


class Layer(torch.nn.Module):
    """What the plugin reads of vLLM's RoutedExperts after weight loading."""

    def __init__(self, config: md.MoEConfig, seed: int = 0, activation: str | None = None):
        super().__init__()
        self.weights = random_weights(config, seed=seed)
        name = activation or str(config.activation)
        self.moe_config = MoEConf(config, name)
        self.activation = Act(name)
        self.expert_map = None
        self.global_num_experts = config.num_experts
        self.apply_router_weight_on_input = False
        self.w13_weight = torch.nn.Parameter(self.weights["w13"].clone(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(self.weights["w2"].clone(), requires_grad=False)
        if config.has_bias:
            self.w13_bias = torch.nn.Parameter(self.weights["w13_bias"].clone(),
                                               requires_grad=False)
            self.w2_bias = torch.nn.Parameter(self.weights["w2_bias"].clone(),
                                              requires_grad=False)


def experts_class() -> type:
    """A fresh stand-in for vLLM's CPUUnquantizedExperts (install() patches it in place):
    its own path prepacks by replacing the parameters, as vLLM's does, and computes the
    reference, counting its calls."""

    class Experts:
        def __init__(self, config: md.MoEConfig) -> None:
            self.config = config
            self.calls: list[str] = []

        def process_weights_after_loading(self, layer: Any) -> None:
            self.calls.append("prepack")
            layer.w13_weight = torch.nn.Parameter(layer.w13_weight.detach().clone(),
                                                  requires_grad=False)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                  workspace2, expert_tokens_meta, apply_router_weight_on_input):
            self.calls.append("apply")
            weights = {"w13": w1, "w2": w2, "w13_bias": None, "w2_bias": None}
            output.copy_(reference(self.config, weights, hidden_states, topk_weights, topk_ids))

    return Experts


def apply_experts(experts: Any, layer: Layer, x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor,
                  on_input: bool = False) -> torch.Tensor:
    out = torch.empty_like(x)
    experts.apply(out, x, layer.w13_weight, layer.w2_weight, tw, ids, layer.activation,
                  layer.global_num_experts, layer.expert_map, None, None, None, None, None,
                  on_input)
    return out


CONFIG = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)


def method_class(experts_cls: type) -> type:
    """A stand-in for vLLM's UnquantizedFusedMoEMethod: its first process_weights_after_loading
    builds the experts object and runs the experts' hook; a later one (a weight update:
    ``reload_weights``) does not, as in vLLM 0.32."""

    class Method:
        def __init__(self, config: md.MoEConfig) -> None:
            self.config, self.moe_kernel = config, None

        def process_weights_after_loading(self, layer: Any) -> None:
            if self.moe_kernel is None:
                from types import SimpleNamespace
                self.moe_kernel = SimpleNamespace(fused_experts=experts_cls(self.config))
                self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return Method
