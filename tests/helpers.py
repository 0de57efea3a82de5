"""Test helpers: random layers, error metrics, hardware probes."""

from __future__ import annotations

import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference

# Relative (Frobenius) tolerance against the float64 reference, by dtype.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.to(torch.float64)
    denom = float(want.norm())
    return float((got.to(torch.float64) - want).norm()) / max(denom, 1e-30)


def random_weights(config: md.MoEConfig, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Fresh random weights scaled so activations stay O(1); never zeros."""
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    w13 = torch.randn(*config.w13_shape, generator=g) / h ** 0.5 * 2
    w2 = torch.randn(*config.w2_shape, generator=g) / i ** 0.5
    out: dict[str, torch.Tensor | None] = {"w13": w13.to(config.dtype), "w2": w2.to(config.dtype),
                                           "w13_bias": None, "w2_bias": None}
    if config.has_bias:
        out["w13_bias"] = (torch.randn(*config.w13_bias_shape, generator=g) * 0.5).to(config.dtype)
        out["w2_bias"] = (torch.randn(*config.w2_bias_shape, generator=g) * 0.5).to(config.dtype)
    return out


def random_routing(config: md.MoEConfig, tokens: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
    logits = torch.randn(tokens, config.num_experts, generator=g)
    tw, ids = md.select_experts(logits, config.top_k)
    return x, tw, ids


def reference(config: md.MoEConfig, weights: dict, x: torch.Tensor, tw: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    return moe_reference(config, x, weights["w13"], weights["w2"], tw, ids,
                         weights["w13_bias"], weights["w2_bias"])


def snapshot(weights: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items() if v is not None}


def assert_unchanged(weights: dict, before: dict[str, torch.Tensor]) -> None:
    """Byte-identical: compares raw bytes, not values (exact, and NaN-safe)."""
    for name, saved in before.items():
        now = weights[name]
        assert torch.equal(now.contiguous().view(torch.uint8),
                           saved.contiguous().view(torch.uint8)), f"{name} was modified"


def zentorch_ready() -> tuple[bool, str]:
    """Whether the real zentorch backend accepts a plain silu config (bf16 or fp32) here."""
    caps = md.Capabilities.detect()
    if "zentorch" not in md.available_backends():
        return False, "the zentorch backend is not registered"
    reasons = []
    for dtype in (torch.bfloat16, torch.float32):
        res = md.resolve(md.MoEConfig(8, 2, 64, 32, dtype=dtype), capabilities=caps)
        cand = next(c for c in res.candidates if c.name == "zentorch")
        if cand.decision.accepted:
            return True, cand.decision.reason
        reasons.append(cand.decision.reason)
    return False, "; ".join(reasons)


ZENTORCH_OK, ZENTORCH_WHY = zentorch_ready()


def torch_and(*specs: md.BackendSpec) -> md.Registry:
    """A registry without entry points: the torch loop (the fallback) plus ``specs``."""
    from moe_dispatch_backends import torch_loop

    reg = md.Registry(load_entry_points=False)
    reg.register(torch_loop, name="torch")
    for spec in specs:
        reg.register(spec)
    return reg

