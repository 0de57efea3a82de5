"""The conformance kit for backend authors.

Run it against any registered backend::

    pytest --pyargs moe_dispatch.testing.conformance --moe-backend=NAME

(the ``--moe-backend`` option comes from this package's pytest plugin, registered through
the ``pytest11`` entry point). It checks parity with the float64 reference over
Hypothesis-drawn layers, weight ownership, and gate consistency. Backends whose gate
rejects this machine are exercised on the first simulated machine they accept
(``Capabilities.preset``), since their math must still be right.

Needs pytest and hypothesis (``pip install 'moe-dispatch[test]'``).
"""

from __future__ import annotations

import torch

from .._capabilities import Capabilities
from .._config import Activation, MoEConfig
from .._matrix import MACHINES, machine
from .._registry import get_registry
from .._resolver import call_check

# Tolerance against the float64 reference (relative Frobenius error), by dtype.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

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


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.to(torch.float64)
    return float((got.to(torch.float64) - want).norm()) / max(float(want.norm()), 1e-30)
