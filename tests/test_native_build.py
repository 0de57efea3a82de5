"""The toolkit's native-module loader: a module already built loads from its stamp, without
torch's extension builder; anything else (no stamp, another key, a missing library, an
unreadable stamp) goes through the builder, which rewrites the stamp."""

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
    def __init__(self, file: Path) -> None:
        self.__file__ = str(file)


def _fake_builder(monkeypatch, calls: list):
    import torch.utils.cpp_extension as cpp

    def build(name, sources, build_directory, **_kw):
        calls.append(name)
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"not a library")
        return _Built(library)
    monkeypatch.setattr(cpp, "load", build)


@pytest.mark.parametrize("stamp", ["none", "other key", "library gone", "not json"])
def test_a_missing_stale_or_broken_stamp_goes_through_the_builder(tmp_path, monkeypatch, stamp):
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

    first = extension()
    assert first.load() is not None and calls == ["m"]
    directory = first.build_directory()
    written = json.loads((directory / STAMP).read_text())
    assert Path(written["library"]) == (directory / "m.so").resolve()
    if stamp == "none":
        (directory / STAMP).unlink()
    elif stamp == "other key":
        (directory / STAMP).write_text(json.dumps({**written, "key": "0" * 64}))
    elif stamp == "library gone":
        (directory / "m.so").unlink()
    else:
        (directory / STAMP).write_text("{half a stamp")
    assert extension().load() is not None and calls == ["m", "m"]
    assert json.loads((directory / STAMP).read_text()) == written  # rewritten whole


def test_an_edited_source_changes_the_build_key(tmp_path, monkeypatch):
    """The key covers the sources' bytes (and the flags, which carry the headers' hash):
    an edit never loads the library built from the old text."""
    from moe_dispatch.kernels import NativeExtension

    source = tmp_path / "m.cpp"
    source.write_text("// one\n")
    ext = NativeExtension("m", [source], switch="X", dir_env="Y", what="m")
    before = ext._key("sh")
    source.write_text("// two\n")
    assert ext._key("sh") != before
    assert NativeExtension("m", [source], switch="X", dir_env="Y", what="m",
                           extra_cflags=("-O3",))._key("sh") != ext._key("sh")
