"""Test helpers: the testing home's tolerances and random layers, plus hardware probes."""

from __future__ import annotations

import torch

import moe_dispatch as md
from moe_dispatch.testing import (TOLERANCE, random_routing, random_weights, reference,  # noqa: F401
                                  rel_error)


def snapshot(weights: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items() if v is not None}


def assert_unchanged(weights: dict, before: dict[str, torch.Tensor]) -> None:
    """Byte-identical: compares raw bytes, not values (exact, and NaN-safe)."""
    for name, saved in before.items():
        now = weights[name]
        assert torch.equal(now.contiguous().view(torch.uint8),
                           saved.contiguous().view(torch.uint8)), f"{name} was modified"


def accepting(config: md.MoEConfig) -> list[str]:
    """The registered backends that accept ``config`` here, in priority order."""
    return [c.name for c in md.resolve(config).candidates if c.decision.accepted]


def copying_backends(config: md.MoEConfig) -> list[str]:
    """The accepting backends that compute on copies of their own (not differentiable): the
    ones a change to the caller's weights after prepare() must not reach silently."""
    snapshot = md.get_registry().snapshot()
    return [n for n in accepting(config) if not snapshot.by_name(n).spec.differentiable]


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
