"""The built wheel installs the built-in backends as moe_dispatch_backends (no bare
"backends" package) and registers them through entry points."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent

PROBE = """
import json, moe_dispatch, moe_dispatch_backends, importlib.util
print(json.dumps(dict(md=moe_dispatch.__file__, be=moe_dispatch_backends.__file__,
                      backends=moe_dispatch.available_backends(),
                      failures=[f.error for f in moe_dispatch.plugin_failures()],
                      bare=importlib.util.find_spec("backends") is not None)))
"""


def test_wheel_contents_and_import(tmp_path):
    # Built from a copy: setuptools writes moe_dispatch.egg-info next to the sources, and one
    # left in the checkout shadows the installed metadata (entry points) for any process
    # started there.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "*.egg-info", "build", "dist", "__pycache__", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=600)
    wheel = next((tmp_path / "dist").glob("moe_dispatch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "moe_dispatch_backends/vllm_cpu/native.cpp" in names
    assert "moe_dispatch/kernels/include/moe_dispatch_fast_call.h" in names
    assert "moe_dispatch/_call_slot.cpp" in names  # MoELayer's call slot, built on first use
    assert "moe_dispatch_backends/zentorch/__init__.py" in names
    assert "moe_dispatch_backends/vllm_cpu/__init__.py" in names
    # the C++ source of the zentorch backend's decode entry, compiled on the user's machine
    assert "moe_dispatch_backends/zentorch/native.cpp" in names
    assert not any(n.startswith("backends/") for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, timeout=600)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         check=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["md"].startswith(str(target)) and data["be"].startswith(str(target))
    assert {"zentorch", "vllm", "amx_grouped", "onednn", "torch"} <= set(data["backends"])
    assert data["failures"] == [] and data["bare"] is False
