"""The testing home: what the conformance kit, the project's tests and a vendor's tests share.

- tolerances against the float64 reference (:data:`TOLERANCE`) and :func:`rel_error`;
- the one random-layer generator (:func:`random_weights`, :func:`random_inputs`,
  :func:`random_routing`): fresh data, never zeros;
- simulated machines (:data:`MACHINES`, :func:`machine`: a preset with every backend's
  declared ops) and :func:`machines_for` (where a backend's kernel can run);
- :func:`thread_disagreements` (8 threads against the serial result);
- Hypothesis strategies in :mod:`moe_dispatch.testing.strategies` (needs hypothesis);
- the conformance kit, :mod:`moe_dispatch.testing.conformance` (needs pytest).
"""

from __future__ import annotations

import threading
from typing import Any

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
           "random_weights", "reference", "rel_error", "thread_disagreements"]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against ``want``, in float64."""
    want = want.detach().to(torch.float64)
    return float((got.detach().to(torch.float64) - want).norm()) / max(float(want.norm()), 1e-30)


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


def thread_disagreements(layer: Any, inputs: list, threads: int = 8, rounds: int = 30) -> list[int]:
    """The indices of ``inputs`` on which calls from ``threads`` concurrent threads did not
    equal the serial result (an empty list when the layer is thread-safe). Even threads take
    ``layer.run(...)`` (a native entry where there is one), odd ones the Python path, so one
    lock must guard both."""
    serial = [layer(*inp) for inp in inputs]
    wrong: list[int] = []

    def work(tid: int) -> None:
        for i in range(rounds):
            j = (i + tid) % len(inputs)
            if not torch.equal(layer.run(*inputs[j], native=tid % 2 == 0), serial[j]):
                wrong.append(j)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    return wrong
