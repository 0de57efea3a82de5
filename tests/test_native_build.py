"""The toolkit's native-module loader: a module already built loads from its stamp, without
torch's extension builder; anything else (no stamp, another key, a missing library, an
unreadable stamp) goes through the builder, which rewrites the stamp. And what the build's
arguments hash: a module's own headers as well as the toolkit's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_dispatch as md

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="no C++ compiler on PATH: nothing can be built")


_STAMPED = textwrap.dedent("""
    import json, sys
    from moe_dispatch_backends.native import kernel
    ext = kernel.EXTENSIONS["avx2"]
    module = ext.load()
    print(json.dumps(dict(loaded=module is not None, status=ext.status(),
                          builder="torch.utils.cpp_extension" in sys.modules,
                          file=getattr(module, "__file__", None))))
""")


@needs_compiler
def test_a_built_module_loads_in_a_new_process_without_the_builder():
    """The stamp written after a build names its library; a later process with the same
    sources, flags, compiler and versions imports it directly (no setuptools, no ninja)."""
    from moe_dispatch_backends.native import kernel

    if not kernel.runs("avx2", md.Capabilities.detect()):
        pytest.skip("this CPU cannot run the native kernel's avx2 build")
    ext = kernel.EXTENSIONS["avx2"]
    assert ext.load() is not None, ext.status()  # built (and stamped) here if not yet
    run = subprocess.run([sys.executable, "-c", _STAMPED], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["loaded"] and out["status"].startswith("in use"), out
    assert not out["builder"], "torch's extension builder was imported for a built module"
    assert Path(out["file"]).parent == ext.build_directory().resolve()


class _Built:
    """What the fake builder returns, as torch's builder returns the imported module."""

    def __init__(self, file: Path, build: int) -> None:
        self.__file__, self.BUILD = str(file), build


def _fake_builder(monkeypatch, calls: list):
    """torch's builder replaced by one that writes an importable "library" (a Python file:
    the stamp's loader imports it like a built module), so every stamp case runs anywhere."""
    import torch.utils.cpp_extension as cpp

    def build(name, sources, build_directory, **_kw):
        calls.append(name)
        library = Path(build_directory) / f"{name}.py"
        library.write_text(f"BUILD = {len(calls)}\n")
        return _Built(library, len(calls))
    monkeypatch.setattr(cpp, "load", build)


@pytest.mark.parametrize("stamp", ["valid", "none", "other key", "library gone", "library replaced",
                                   "not json"])
def test_only_a_valid_stamp_skips_the_builder(tmp_path, monkeypatch, stamp):
    from moe_dispatch.kernels import NativeExtension
    from moe_dispatch.kernels._native import STAMP

    monkeypatch.setenv("CXX", "sh")  # a compiler check that passes everywhere
    monkeypatch.setenv("STAMP_TEST_DIR", str(tmp_path))
    source = tmp_path / "m.cpp"
    source.write_text("// a module\n")
    calls: list = []
    _fake_builder(monkeypatch, calls)

    def extension():
        return NativeExtension("m", [source], switch="STAMP_TEST_OFF", dir_env="STAMP_TEST_DIR", what="m")

    first = extension().load()
    assert first is not None and calls == ["m"]
    directory = extension().build_directory()
    library = directory / "m.py"
    written = json.loads((directory / STAMP).read_text())
    assert Path(written["library"]) == library.resolve()
    if stamp == "none":
        (directory / STAMP).unlink()
    elif stamp == "other key":
        (directory / STAMP).write_text(json.dumps({**written, "key": "0" * 64}))
    elif stamp == "library gone":
        library.unlink()
    elif stamp == "library replaced":  # relinked in place by a build of another key
        library.write_text("BUILD = 'another key'\n# longer\n")
    elif stamp == "not json":
        (directory / STAMP).write_text("{half a stamp")
    second = extension().load()
    if stamp == "valid":  # imported from the stamp: the builder's library, the builder not run
        assert calls == ["m"] and second.BUILD == 1 and second is not first
        return
    assert calls == ["m", "m"] and second.BUILD == 2
    rewritten = json.loads((directory / STAMP).read_text())
    assert rewritten["key"] == written["key"] and rewritten["library"] == written["library"]


def test_a_failed_build_leaves_no_stamp(tmp_path, monkeypatch):
    """The stamp is removed before the builder runs: a build that fails (or dies) after
    replacing the library never leaves the old stamp naming it."""
    import torch.utils.cpp_extension as cpp
    from moe_dispatch.kernels import NativeExtension
    from moe_dispatch.kernels._native import STAMP

    monkeypatch.setenv("CXX", "sh")
    monkeypatch.setenv("STAMP_TEST_DIR", str(tmp_path))
    source = tmp_path / "m.cpp"
    source.write_text("// a module\n")
    calls: list = []
    _fake_builder(monkeypatch, calls)
    ext = NativeExtension("m", [source], switch="STAMP_TEST_OFF", dir_env="STAMP_TEST_DIR", what="m")
    assert ext.load() is not None
    directory = ext.build_directory()
    source.write_text("// edited\n")  # another key: the builder runs, and fails

    def broken(**_kw):
        raise RuntimeError("compiler error")
    monkeypatch.setattr(cpp, "load", broken)
    again = NativeExtension("m", [source], switch="STAMP_TEST_OFF", dir_env="STAMP_TEST_DIR", what="m")
    assert again.load() is None and again.status().startswith("unavailable: build failed")
    assert not (directory / STAMP).exists()


def test_an_edited_source_changes_the_build_key(tmp_path, monkeypatch):
    """The key covers the sources' bytes (and the flags, which carry the headers' hash):
    an edit never loads the library built from the old text."""
    from moe_dispatch.kernels import NativeExtension

    source = tmp_path / "m.cpp"
    source.write_text("// one\n")
    ext = NativeExtension("m", [source], switch="X", dir_env="Y", what="m")
    before = ext._key("/bin/sh")
    source.write_text("// two\n")
    assert ext._key("/bin/sh") != before
    assert NativeExtension("m", [source], switch="X", dir_env="Y", what="m",
                           extra_cflags=("-O3",))._key("/bin/sh") != ext._key("/bin/sh")


_GLOBAL = textwrap.dedent("""
    import os, sys
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)  # as some MPI and launcher setups do
    import torch, moe_dispatch as md
    from moe_dispatch.testing import random_weights, random_routing, reference, rel_error
    cfg = md.MoEConfig(4, 2, 256, 128, dtype=torch.bfloat16)
    w = random_weights(cfg, seed=1)
    x, tw, ids = random_routing(cfg, 4, seed=2)
    want = reference(cfg, w, x, tw, ids)
    for isa in sys.argv[1:]:
        os.environ["MOE_DISPATCH_NATIVE_ISA"] = isa
        layer = md.MoELayer(cfg, backend="native").load_weights(w["w13"], w["w2"]).prepare()
        print(isa, rel_error(layer(x, tw, ids), want), flush=True)
""")


@needs_compiler
def test_both_builds_in_one_process_under_rtld_global():
    """Each build keeps its own code: with default-visibility symbols, the build loaded second
    under RTLD_GLOBAL bound its calls to the first's same-named functions, whose layouts
    differ (the avx2 build wrote floats into the avx512 build's uint16 buffer: SIGSEGV)."""
    from moe_dispatch_backends.native import kernel

    if not all(kernel.runs(isa, md.Capabilities.detect()) for isa in ("avx512", "avx2")):
        pytest.skip("this CPU runs only one build of the native kernel")
    for isa in ("avx512", "avx2"):
        assert kernel.EXTENSIONS[isa].load() is not None, kernel.status(isa)
    env = {**os.environ, "MOE_DISPATCH_DISABLE": "zentorch,vllm"}
    run = subprocess.run([sys.executable, "-c", _GLOBAL, "avx512", "avx2"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    errors = {line.split()[0]: float(line.split()[1]) for line in run.stdout.splitlines()}
    assert set(errors) == {"avx512", "avx2"} and max(errors.values()) < 1e-2, errors


def test_a_modules_own_header_is_part_of_its_build_arguments(tmp_path):
    """torch's builder hashes sources only: an edit to a header named in ``headers`` must
    change the build's arguments (and so rebuild); without headers the toolkit's alone."""
    from moe_dispatch.kernels import NativeExtension

    header = tmp_path / "mine.h"
    header.write_text("// one\n")

    def flags(**kw):
        return NativeExtension("m", [tmp_path / "m.cpp"], switch="X", dir_env="Y", what="m", **kw).extra_cflags

    before = flags(headers=[header])
    header.write_text("// two\n")
    assert flags(headers=[header]) != before
    assert flags() == flags(headers=())
    assert flags() != before
