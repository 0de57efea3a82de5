"""Hugging Face ``config.json`` -> MoEConfig plus routing parameters.

Supported families (``model_type``): mixtral, qwen2_moe, qwen3_moe, deepseek_v2,
deepseek_v3, gpt_oss, llama4 (and llama4_text), olmoe. Anything else, or a missing key, is a
:class:`HFConfigError` naming the model type or the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from ._config import Activation, MoEConfig, to_dtype
from ._errors import MoEDispatchError

SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
             "llama4", "llama4_text", "olmoe")


class HFConfigError(MoEDispatchError, ValueError):
    """A config.json that cannot be read or represented."""


@attrs.frozen(slots=True)
class Routing:
    """How the router turns logits into (weights, ids): arguments for ``select_experts``."""

    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # the model has a learned e_score_correction_bias

    def select_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(scoring=self.scoring, renormalize=self.renormalize,
                                  routed_scaling_factor=self.routed_scaling_factor)
        if self.num_expert_group is not None:
            kw.update(num_expert_group=self.num_expert_group, topk_group=self.topk_group)
        return kw


@attrs.frozen(slots=True)
class SharedExperts:
    """Dense shared experts that run beside the routed ones (not dispatched by us)."""

    count: int
    intermediate_size: int


@attrs.frozen(slots=True)
class ModelMoE:
    """The MoE part of a model: one config per distinct MoE layer shape, and its layers."""

    family: str
    config: MoEConfig
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    routing: Routing
    shared_experts: SharedExperts | None = None
    notes: tuple[str, ...] = ()

    def layer_shapes(self) -> dict[MoEConfig, tuple[int, ...]]:
        """Every distinct MoE layer shape with the layer indices that have it."""
        return {self.config: self.moe_layers}


def read_json(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise HFConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise HFConfigError(f"{path} is not UTF-8 text (a config.json is): {exc}") from exc
    except ValueError as exc:  # a path with a NUL byte
        raise HFConfigError(f"cannot read {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HFConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def load(source: str | Path | Mapping[str, Any], *, dtype: Any = None) -> ModelMoE:
    """Parse a config.json (path or dict). ``dtype`` overrides the file's torch_dtype."""
    data = dict(source) if isinstance(source, Mapping) else read_json(source)
    if data.get("model_type") in ("llama4",) and isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": "llama4"}
    family = data.get("model_type")
    if family not in SUPPORTED:
        raise HFConfigError(f"model_type {family!r} is not supported; supported families: "
                            f"{', '.join(SUPPORTED)}")
    cfg = _Keys(data, family)
    if dtype is None:
        raw = data.get("torch_dtype", data.get("dtype", "bfloat16"))
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}.get(raw, torch.bfloat16)
    dtype = to_dtype(dtype)
    return _PARSERS[family.replace("_text", "")](cfg, family, dtype)


class _Keys:
    """Required-key access with errors that name the key and the family."""

    def __init__(self, data: dict[str, Any], family: str) -> None:
        self.data, self.family = data, family

    def need(self, *names: str) -> Any:
        for name in names:
            if name in self.data and self.data[name] is not None:
                return self.data[name]
        raise HFConfigError(f"{self.family} config is missing the key {names[0]!r}"
                            + (f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""))

    def get(self, name: str, default: Any) -> Any:
        value = self.data.get(name, default)
        return default if value is None else value


# transformers' hidden_act names with an exact moe-dispatch activation (also used by hf.py).
HF_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU,
                  "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_new": Activation.GELU_TANH}


def _activation(keys: _Keys) -> Activation:
    act = keys.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise HFConfigError(f"{keys.family}: hidden_act {act!r} has no MoE activation here "
                            f"(supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[act]


def _every(n: int, step: int = 1, skip: tuple[int, ...] = (), first: int = 0) -> tuple[int, ...]:
    return tuple(i for i in range(n) if i >= first and (i + 1) % step == 0 and i not in skip)


def _mixtral(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    config = MoEConfig(int(k.need("num_local_experts")), int(k.need("num_experts_per_tok")),
                       int(k.need("hidden_size")), int(k.need("intermediate_size")),
                       activation=_activation(k), dtype=dtype)
    return ModelMoE(family, config, n, tuple(range(n)), Routing("softmax", True))


def _qwen(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    step = int(k.get("decoder_sparse_step", 1))
    skip = tuple(k.get("mlp_only_layers", []))
    config = MoEConfig(int(k.need("num_experts", "num_local_experts")), int(k.need("num_experts_per_tok")),
                       int(k.need("hidden_size")), int(k.need("moe_intermediate_size")),
                       activation=_activation(k), dtype=dtype)
    shared = None
    notes: list[str] = []
    if family == "qwen2_moe" and k.get("shared_expert_intermediate_size", 0):
        shared = SharedExperts(1, int(k.need("shared_expert_intermediate_size")))
        notes.append("a gated shared expert runs beside the routed experts (dense MLP, "
                     "not dispatched by moe-dispatch)")
    return ModelMoE(family, config, n, _every(n, step, skip),
                    Routing("softmax", bool(k.get("norm_topk_prob", family == "qwen3_moe"))),
                    shared, tuple(notes))


def _deepseek(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    first_dense = int(k.get("first_k_dense_replace", 0))
    freq = int(k.get("moe_layer_freq", 1))
    layers = tuple(i for i in range(n) if i >= first_dense and i % freq == 0)
    scoring = k.get("scoring_func", "softmax" if family == "deepseek_v2" else "sigmoid")
    if scoring not in ("softmax", "sigmoid"):
        raise HFConfigError(f"{family}: scoring_func {scoring!r} is not supported (softmax, sigmoid)")
    topk_method = k.get("topk_method", "greedy" if family == "deepseek_v2" else "noaux_tc")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    config = MoEConfig(int(k.need("n_routed_experts")), int(k.need("num_experts_per_tok")),
                       int(k.need("hidden_size")), int(k.need("moe_intermediate_size")),
                       activation=_activation(k), dtype=dtype)
    routing = Routing(
        scoring, bool(k.get("norm_topk_prob", family == "deepseek_v3")),
        int(k.need("n_group")) if grouped else None,
        int(k.need("topk_group")) if grouped else None,
        float(k.get("routed_scaling_factor", 1.0)),
        correction_bias=topk_method == "noaux_tc")
    shared = SharedExperts(int(k.get("n_shared_experts", 0)), int(k.need("moe_intermediate_size"))) \
        if k.get("n_shared_experts", 0) else None
    notes = [f"layers 0..{first_dense - 1} are dense (first_k_dense_replace={first_dense})"] if first_dense else []
    if routing.correction_bias:
        notes.append("routing uses the per-layer e_score_correction_bias: pass it to "
                     "select_experts(correction_bias=...)")
    if shared:
        notes.append(f"{shared.count} shared expert(s) run beside the routed ones (dense, "
                     "not dispatched by moe-dispatch)")
    return ModelMoE(family, config, n, layers, routing, shared, tuple(notes))


def _gpt_oss(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    limit = float(k.get("swiglu_limit", 7.0))
    if limit != 7.0:
        raise HFConfigError(f"gpt_oss: swiglu_limit={limit} cannot be represented: swigluoai "
                            "fixes the limit at 7.0 (and alpha at 1.702)")
    config = MoEConfig(int(k.need("num_local_experts")),
                       int(k.need("num_experts_per_tok", "experts_per_token")),
                       int(k.need("hidden_size")), int(k.need("intermediate_size")),
                       activation=Activation.SWIGLUOAI, dtype=dtype, has_bias=True)
    return ModelMoE(family, config, n, tuple(range(n)), Routing("softmax", True),
                    notes=("router: top-k logits then softmax over the chosen experts "
                           "(= softmax + renormalize)",))


def _llama4(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    step = int(k.get("interleave_moe_layer_step", 1))
    top_k = int(k.need("num_experts_per_tok"))
    config = MoEConfig(int(k.need("num_local_experts")), top_k, int(k.need("hidden_size")),
                       int(k.need("intermediate_size")), activation=_activation(k), dtype=dtype,
                       apply_router_weight_on_input=top_k == 1)
    return ModelMoE(family, config, n, _every(n, step),
                    Routing("sigmoid", False), SharedExperts(1, int(k.need("intermediate_size"))),
                    ("router: sigmoid of the top-1 logit scales the input (router weight on "
                     "input)", "a shared expert runs beside the routed one (dense)"))


def _olmoe(k: _Keys, family: str, dtype: torch.dtype) -> ModelMoE:
    n = int(k.need("num_hidden_layers"))
    config = MoEConfig(int(k.need("num_experts", "num_local_experts")), int(k.need("num_experts_per_tok")),
                       int(k.need("hidden_size")), int(k.need("intermediate_size")),
                       activation=_activation(k), dtype=dtype)
    return ModelMoE(family, config, n, tuple(range(n)),
                    Routing("softmax", bool(k.get("norm_topk_prob", False))))


_PARSERS = {"mixtral": _mixtral, "qwen2_moe": _qwen, "qwen3_moe": _qwen,
            "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "gpt_oss": _gpt_oss,
            "llama4": _llama4, "olmoe": _olmoe}
