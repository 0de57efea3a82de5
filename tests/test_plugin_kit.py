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
                                              test_parity_with_reference, test_weight_ownership)

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "vendor_plugin"
BUILTINS = ["zentorch", "amx_grouped", "onednn", "torch"]


def _ensure_example_installed() -> None:
    try:
        metadata.distribution("moe-dispatch-example-vendor")
    except metadata.PackageNotFoundError:
        # A real pip install of the separate distribution into this environment.
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        str(EXAMPLE)], check=True, timeout=600)
        md.reload_plugins()


_ensure_example_installed()


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
    assert "6 passed" in out.stdout
