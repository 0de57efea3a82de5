"""The testing home: what the conformance kit, the project's tests and a vendor's tests share.

- tolerances against the float64 reference (:data:`TOLERANCE`) and :func:`rel_error`;
- the one random-layer generator (:func:`random_weights`, :func:`random_inputs`,
  :func:`random_routing`): fresh data, never zeros;
- simulated machines (:data:`MACHINES`, :func:`machine`: a preset with every backend's
  declared ops) and :func:`machines_for` (where a backend's kernel can run);
- Hypothesis strategies in :mod:`moe_dispatch.testing.strategies` (needs hypothesis);
- the conformance kit, :mod:`moe_dispatch.testing.conformance` (needs pytest).
"""

from __future__ import annotations

import torch

from .._capabilities import Capabilities
from .._config import Activation, MoEConfig
from .._matrix import MACHINES, machine
from .._random import random_inputs, random_weights
from .._registry import get_registry
from .._resolver import call_check
from ..reference import moe_reference

# Tolerance against the float64 reference (relative Frobenius error), by dtype.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

__all__ = ["MACHINES", "TOLERANCE", "machine", "machines_for", "random_inputs", "random_routing",
           "random_weights", "reference", "rel_error"]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against ``want``, in float64."""
    want = want.to(torch.float64)
    return float((got.to(torch.float64) - want).norm()) / max(float(want.norm()), 1e-30)


def random_routing(config: MoEConfig, tokens: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch: (hidden_states, topk_weights float32, topk_ids int32)."""
    return random_inputs(config, tokens, pool=1, seed=seed + 1)[0]


def reference(config: MoEConfig, weights: dict, x: torch.Tensor, tw: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """The float64 reference on a ``random_weights`` dict."""
    return moe_reference(config, x, weights["w13"], weights["w2"], tw, ids,
                         weights["w13_bias"], weights["w2_bias"])


def machines_for(name: str) -> list[Capabilities]:
    """Where to run a backend's kernel: this machine, if the backend accepts any small
    config here; otherwise the simulated machines that it accepts (its math must still be
    right there; that only works for kernels that run on any CPU, like AMX grouped GEMM's
    ``torch._grouped_mm``)."""
    rec = get_registry().snapshot().by_name(name)

    def accepts_something(caps: Capabilities) -> bool:
        return any(call_check(rec, "supports_config",
                              MoEConfig(8, 2, 64, 32, activation=a, dtype=d), caps).accepted
                   for d in (torch.bfloat16, torch.float32, torch.float16) for a in Activation)

    real = Capabilities.detect()
    if accepts_something(real):
        return [real]
    return [caps for caps in (machine(m) for m in MACHINES) if accepts_something(caps)]
