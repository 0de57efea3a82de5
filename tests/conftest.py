"""Shared pytest setup: Hypothesis profiles and hardware markers."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# The test modules' shared helpers assert too: rewritten as test modules are, so that their
# failures show the values compared (pytest rewrites only test_*.py and conftest.py itself).
pytest.register_assert_rewrite("helpers", "native_layers", "paced", "vllm_standins")

from fakedist import plugin_path  # noqa: E402, F401  (a fixture shared by the plugin tests)

# CI profile: derandomized (reproducible in CI logs), bounded, no deadline (the shared
# machines are noisy). "dev" explores more; select with HYPOTHESIS_PROFILE.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", max_examples=10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.manual_seed(0)
# See _clean_env: module- and session-scoped fixtures build layers before it runs.
os.environ["MOE_DISPATCH_POLICY"] = "priority"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without the library's override variables, whatever the shell has."""
    for var in ("MOE_DISPATCH_BACKEND", "MOE_DISPATCH_DISABLE", "MOE_DISPATCH_PLUGINS",
                "MOE_DISPATCH_STRICT", "MOE_DISPATCH_NATIVE", "MOE_DISPATCH_NATIVE_DIR"):
        monkeypatch.delenv(var, raising=False)
    # The suite checks each backend's contract on the resolver's exact choice, so layers run
    # policy="priority" unless a test asks for another. The default policy ("auto", which
    # times the candidates at prepare()) has its own tests (tests/test_default_routing*.py),
    # which delete this variable; timing every Hypothesis-drawn layer would only add noise.
    monkeypatch.setenv("MOE_DISPATCH_POLICY", "priority")


@pytest.fixture(scope="session", autouse=True)
def _call_slot_installed() -> None:
    """MoELayer's C call slot from the first test on (where it builds), so that every layer
    test runs the same path whatever ran before it (the slot is otherwise installed at the
    first prepare() with a native entry)."""
    import moe_dispatch as md
    from moe_dispatch import _call_slot

    _call_slot.install(md.MoELayer)


@pytest.fixture(autouse=True)
def _call_slot_kept():
    """The call slot as the test found it. Why: a test that assigns ``MoELayer.__call__``
    (monkeypatch.setattr, tests/test_vllm_plugin.py) makes CPython reset the class's tp_call,
    and putting the function back does not bring the slot back: every later test ran the
    Python ``__call__``. Torn down after the test's own fixtures (monkeypatch's undo)."""
    from moe_dispatch import _call_slot

    was = _call_slot.active()
    yield
    if was and not _call_slot.active():
        _call_slot.set_active(True)  # raises where the test left __call__ replaced


@pytest.fixture(params=["slot", "python"])
def call_path(request: pytest.FixtureRequest):
    """MoELayer's two call paths, one per run of the test: the C call slot
    (moe_dispatch/_call_slot.cpp; skipped where it is not in use) and the Python
    ``__call__`` that runs without it (_call_slot_kept puts the slot back after the test)."""
    from moe_dispatch import _call_slot

    was = _call_slot.active()
    if request.param == "slot" and not was:
        pytest.skip(f"the call slot is not in use here: {_call_slot.describe()}")
    if was:
        _call_slot.set_active(request.param == "slot")
    return request.param
