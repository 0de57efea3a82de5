"""Real entry-point plugins for tests: a distribution's .dist-info written on sys.path.

importlib.metadata finds distributions by scanning sys.path, so a folder holding
``NAME-VER.dist-info/{METADATA,entry_points.txt}`` plus a module is an installed plugin as
far as discovery is concerned, with no pip run.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest


def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str],
              version: str = "1.0") -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[moe_dispatch.backends]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


GOOD_PLUGIN = '''
import moe_dispatch as md
from moe_dispatch.kernels import expert_loop

class Backend(md.BackendBase):
    def supports_config(self, config, capabilities):
        return md.accept("vendor plugin")
    def process_weights(self, weights, capabilities):
        return weights
    def apply(self, state, x, tw, ids):
        return expert_loop(state, x, tw, ids)

@md.hookimpl
def moe_dispatch_backends():
    return [md.BackendSpec("{name}", {priority}, Backend())]
'''


def plugin_source(name: str, priority: int = 100, preamble: str = "") -> str:
    return preamble + GOOD_PLUGIN.replace("{name}", name).replace("{priority}", str(priority))


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path for fake distributions; modules imported from it are forgotten."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        mod = sys.modules.get(name)
        if getattr(mod, "__file__", "") and str(tmp_path) in str(getattr(mod, "__file__", "")):
            del sys.modules[name]
    importlib.invalidate_caches()
