"""Paced backends for the default policy's tests (test_default_routing.py,
test_default_routing_limits.py, test_memory_limit.py): they run the portable loop (so every
answer is checked against the float64 reference) and take a time that depends on the token
count on the tuner's clock, which the ``default_policy`` fixture makes virtual
(``VirtualClock``): their speed ranking per token count is exact, with margins of 3x and
more, so the routing the tuner must find is known too (ratios within ``DROP_FACTOR``, so no
candidate is dropped unless a test means it to be). No test asserts a real kernel's timing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import moe_dispatch as md
from moe_dispatch import _measure, _timing, _tuning
from moe_dispatch.kernels import expert_loop
from moe_dispatch.testing import TOLERANCE, random_routing, reference, rel_error

CFG = md.MoEConfig(4, 2, 32, 16, dtype=torch.float32)
CAP = 64  # buckets 1, 2, 4, 8, 16, 32, 64; probed first: 1, 8, 64


# Milliseconds per unit of pace.
PACE = 3.0


class VirtualClock:
    """The tuner's clock (``time`` in the modules that time candidates) in these tests: it
    moves only when a paced backend says how long its call took. Why: with real sleeps, the
    loop's own time and the scheduler's late wake-ups on a loaded 2-core CI machine flipped
    rankings at T=1 (3 of these tests failed in one CI run, and under a background matmul
    locally, at 3 and at 6 ms per unit alike)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCKS: list[VirtualClock] = []  # the running test's clock (the fixture sets it)


class Paced(md.BackendBase):
    """The loop, in calls of ``small`` units (``PACE`` ms each, unless ``scale`` says) for
    T <= ``switch`` tokens, else ``large``."""

    def __init__(self, small: float, large: float, switch: int = 16, entry: bool = False,
                 scale: float = PACE) -> None:
        self.small, self.large = small * scale, large * scale
        self.switch, self.entry = switch, entry
        self.prepared = 0
        self.calls: Counter[int] = Counter()  # token count -> calls (tuning and forwards)
        self.entry_calls = 0

    def supports_config(self, config, capabilities):
        return md.accept("paced loop")

    def process_weights(self, weights, capabilities):
        self.prepared += 1
        return weights

    def apply(self, state, x, tw, ids):
        # The call lasts its paced time on the tuner's (virtual) clock, whatever the loop took.
        tokens = x.shape[0]
        self.calls[tokens] += 1
        out = expert_loop(state, x, tw, ids)
        CLOCKS[-1].now += (self.small if tokens <= self.switch else self.large) / 1e3
        return out

    def fast_call(self, state, guard):
        if not self.entry:
            return None

        def entry(x, tw, ids):
            if torch._C._get_tracing_state():
                return None  # the entry contract: declined inside torch.jit.trace
            self.entry_calls += 1
            return self.apply(state, x, tw, ids)
        return entry


def paced_registry(**backends: tuple[int, Paced]) -> md.Registry:
    """A registry of these backends alone: name=(priority, backend)."""
    reg = md.Registry(load_entry_points=False)
    for name, (priority, backend) in backends.items():
        reg.register(md.BackendSpec(name, priority, backend))
    return reg


@pytest.fixture
def default_policy(monkeypatch):
    """The environment a user has: no MOE_DISPATCH_POLICY (conftest sets "priority"); and
    the tuner's clock virtual, for the paced backends (``VirtualClock``)."""
    monkeypatch.delenv("MOE_DISPATCH_POLICY", raising=False)
    clock = VirtualClock()
    for module in (_timing, _measure, _tuning):
        monkeypatch.setattr(module, "time", clock)
    CLOCKS.append(clock)
    yield clock
    CLOCKS.pop()


def check_routed(layer, w, tokens, seed=0):
    """``tokens`` random tokens through ``layer`` (of CFG, weights ``w``) against the reference."""
    x, tw, ids = random_routing(CFG, tokens, seed=seed)
    assert rel_error(layer(x, tw, ids), reference(CFG, w, x, tw, ids)) <= TOLERANCE[torch.float32]
