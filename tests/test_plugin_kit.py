"""The plugin author kit: the example distribution is discovered through its entry point,
ordered by priority, excluded and forced; the conformance kit runs on every built-in
backend and on the example."""

from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.testing.conformance import (backend_kinds, backend_machines, native_entries,  # noqa: F401
                                              test_gate_consistency, test_native_entry_agrees_with_the_python_path,
                                              test_in_place_update, test_parity_with_reference,
                                              test_weight_ownership)

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "vendor_plugin"
BUILTINS = ["zentorch", "native", "vllm", "amx_grouped", "onednn", "torch"]


def _example_installed() -> bool:
    try:
        metadata.distribution("moe-dispatch-example-vendor")
    except metadata.PackageNotFoundError:
        return False
    return True


# scripts/setup.sh test installs the example distribution (a real pip install); a test
# environment without it is a broken setup, not a reason to skip.
EXAMPLE_MISSING = ("the example distribution is not installed: run scripts/setup.sh test "
                   "(it pip-installs examples/vendor_plugin)")


@pytest.fixture(autouse=True)
def _example_present():
    if not _example_installed():
        pytest.fail(EXAMPLE_MISSING)


VENDOR_OP_PLUGIN = '''
import torch
import moe_dispatch as md
from moe_dispatch.kernels import expert_loop, schema_problem

def register_op():
    torch.library.custom_op("{ns}::scaled_copy", mutates_args=())(_scaled_copy)

def _scaled_copy(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale

{register_now}
ARGS = (("x", "Tensor"), ("scale", "float"))

class Backend(md.BackendBase):
    def supports_config(self, config, capabilities):
        problem = schema_problem(capabilities.op_schema("{ns}::scaled_copy"), ARGS)
        return md.reject(problem) if problem else md.accept("vendor op {ns}::scaled_copy found")
    def process_weights(self, weights, capabilities):
        return weights
    def apply(self, state, x, tw, ids):
        return torch.ops.{ns}.scaled_copy(expert_loop(state, x, tw, ids), 1.0)

@md.hookimpl
def moe_dispatch_backends():
    return [md.BackendSpec("{name}", 500, Backend())]
'''


def _vendor_op_plugin(ns: str, name: str, *, register_now: bool) -> str:
    """The plugin's source; its op is registered at import, or later by register_op()."""
    return (VENDOR_OP_PLUGIN.replace("{ns}", ns).replace("{name}", name)
            .replace("{register_now}", "register_op()" if register_now else ""))


def test_vendor_gates_on_its_own_op_registered_with_torch_library(plugin_path):
    """A vendor's op in its own namespace, registered at import with torch.library, is found
    by Capabilities.op_schema on the detected machine, and the backend is accepted on it."""
    from fakedist import make_dist
    make_dist(plugin_path, "vendor-op-dist", {"vendor_op": "vendor_op_mod"},
              {"vendor_op_mod": _vendor_op_plugin("vendor_op_ns", "vendor_op", register_now=True)})
    md.reload_plugins()
    try:
        assert "vendor_op" in md.available_backends(), md.plugin_failures()  # imports the plugin
        caps = md.Capabilities.detect()  # detected before the op existed; asked now
        assert "vendor_op_ns::scaled_copy(Tensor x, float scale)" in (caps.op_schema("vendor_op_ns::scaled_copy") or "")
        cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
        res = md.resolve(cfg)
        assert res.backend == "vendor_op" and "vendor op vendor_op_ns::scaled_copy found" in res.explain()
        # A simulated machine without the op: the same backend rejects, naming why.
        sim = md.resolve(cfg, capabilities=caps.evolve(live_ops=False))
        cand = next(c for c in sim.candidates if c.name == "vendor_op")
        assert not cand.decision.accepted and "not registered" in cand.reason
    finally:
        md.reload_plugins()


@pytest.fixture(scope="module", params=BUILTINS + ["example_bmm"])
def moe_backend(request):
    return request.param


def test_example_discovered_through_its_entry_point():
    dist = metadata.distribution("moe-dispatch-example-vendor")
    eps = [ep for ep in dist.entry_points if ep.group == md.ENTRY_POINT_GROUP]
    assert [ep.name for ep in eps] == ["example_bmm"]
    names = md.available_backends()
    assert names.index("example_bmm") == len(names) - 1  # priority -10: after torch (0)
    rec = md.get_registry().snapshot().by_name("example_bmm")
    assert "moe-dispatch-example-vendor" in rec.source and rec.priority == -10


def test_example_can_be_forced_and_excluded():
    cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
    assert md.resolve(cfg, backend="example_bmm").backend == "example_bmm"
    res = md.resolve(cfg, exclude=["example_bmm"])
    assert next(c for c in res.candidates if c.name == "example_bmm").status == "excluded"
    with pytest.raises(md.BackendRejectedError, match="biases are not supported"):
        md.resolve(md.MoEConfig(8, 2, 64, 32, has_bias=True), backend="example_bmm")


def test_kit_runs_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                          "moe_dispatch.testing.conformance", "--moe-backend=example_bmm",
                          "--moe-backend=torch"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "8 passed" in out.stdout  # 5 tests x 2 backends, 2 without a native entry


def test_an_op_registered_after_a_first_resolution_is_seen(plugin_path):
    """The resolution cache keeps a gate's answer only while the ops it looked up answer the
    same: a vendor's op registered later turns a cached rejection into an acceptance."""
    src = _vendor_op_plugin("late_ns", "late_op", register_now=False)
    from fakedist import make_dist
    make_dist(plugin_path, "late-op-dist", {"late_op": "late_op_mod"}, {"late_op_mod": src})
    md.reload_plugins()
    try:
        assert "late_op" in md.available_backends(), md.plugin_failures()
        cfg = md.MoEConfig(8, 2, 64, 32, dtype=torch.float32)
        assert md.resolve(cfg).backend != "late_op"
        import late_op_mod
        late_op_mod.register_op()
        assert md.resolve(cfg).backend == "late_op"
    finally:
        md.reload_plugins()
