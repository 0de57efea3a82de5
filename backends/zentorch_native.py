"""Build and load the zentorch backend's native decode path (``zentorch_native.cpp``).

The module is compiled with torch's C++ extension builder the first time a process needs
it (about 30 s on 2 cores; ``scripts/setup.sh`` does it at install) into a cache directory
that later processes load from in well under a second. It is an accelerator, never a
requirement: without a compiler, without ninja, with ``MOE_DISPATCH_NATIVE=0`` or after
a failed build, the backend runs its Python path and :func:`status` says why.

Run ``python -m moe_dispatch_backends.zentorch_native`` to build it and print the status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from moe_dispatch._tuning import user_cache_dir

log = logging.getLogger("moe_dispatch")

ENV = "MOE_DISPATCH_NATIVE"
SOURCE = Path(__file__).with_name("zentorch_native.cpp")
MODULE_NAME = "moe_dispatch_zentorch_native"

_lock = threading.Lock()
# (module or None, status line); set once per process by the first load().
_result: tuple[ModuleType | None, str] | None = None
_verbose = False


def build_directory() -> Path:
    """Where the compiled module lives: per torch and Python version, under the user cache
    (``MOE_DISPATCH_NATIVE_DIR`` overrides it)."""
    env = os.environ.get("MOE_DISPATCH_NATIVE_DIR")
    if env:
        return Path(env)
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return user_cache_dir() / "native" / tag


def load() -> ModuleType | None:
    """The compiled module, or None (the reason is in :func:`status`). Decided once per
    process: every op call in a process must go through the same lock."""
    global _result
    if _result is None:
        with _lock:
            if _result is None:
                _result = _build_and_load()
    return _result[0]


def status() -> str:
    """One line: whether the native path is in use in this process, and why not."""
    if _result is None:
        return "not loaded yet (it loads with the first zentorch layer)"
    return _result[1]


def describe() -> str:
    """The status without building anything (for ``moe-dispatch doctor``)."""
    if _result is not None:
        return _result[1]
    if _disabled():
        return f"off ({ENV}={os.environ.get(ENV)}): the Python path runs"
    directory = build_directory()
    if any(directory.glob(f"{MODULE_NAME}*.so")):
        return f"built ({directory}); loads with the first zentorch layer"
    return (f"not built yet: it builds at the first zentorch layer (~30 s), or now with "
            f"`python -m {__name__}`")


def _disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    # torch's builder runs "ninja" from PATH; the ninja wheel puts it next to this
    # interpreter, which is not on PATH when a venv's python is run without activating it.
    if shutil.which("ninja") is not None:
        yield
        return
    import ninja  # the pip package: a dependency on x86_64 Linux

    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _build_and_load() -> tuple[ModuleType | None, str]:
    if _disabled():
        return None, f"off ({ENV}={os.environ.get(ENV)}): the Python path runs"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reason = f"no C++ compiler ({compiler!r} is not on PATH)"
        log.warning("moe-dispatch: zentorch native path unavailable: %s; the Python path "
                    "runs (slower at decode)", reason)
        return None, f"unavailable: {reason}; the Python path runs"
    directory = build_directory()
    t0 = time.perf_counter()
    try:
        import zentorch  # noqa: F401  (registers the op the module looks up)
        from torch.utils.cpp_extension import load as build

        directory.mkdir(parents=True, exist_ok=True)
        log.info("moe-dispatch: loading the zentorch native path from %s (compiled on first "
                 "use: ~30 s)", directory)
        with _ninja_on_path():
            module = build(name=MODULE_NAME, sources=[str(SOURCE)],
                           build_directory=str(directory), extra_cflags=["-O2"],
                           verbose=_verbose)
    except Exception as exc:  # a failed build degrades to the Python path, never breaks it
        # The first line only (a compiler log follows it): `python -m` this module shows all.
        first = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {first}"
        log.warning("moe-dispatch: building the zentorch native path in %s failed (%s); the "
                    "Python path runs (slower at decode); `python -m %s` shows the whole "
                    "error", directory, reason, __name__)
        return None, f"unavailable: build failed ({reason}); the Python path runs"
    took = time.perf_counter() - t0
    log.info("moe-dispatch: zentorch native path ready in %.1f s", took)
    return module, f"in use ({directory})"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    global _verbose
    _verbose = True  # the builder's commands and compiler output, when it builds
    module = load()
    print(f"zentorch native path: {status()}")
    return 0 if module is not None or _disabled() else 1


if __name__ == "__main__":
    raise SystemExit(main())
