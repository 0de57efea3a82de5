"""Native code built on first use with torch's extension builder, into the user cache.

An accelerator, never a requirement: without a compiler, without ninja, with the backend's
off switch set, or after a failed build, :meth:`NativeExtension.load` returns None and
:meth:`NativeExtension.status` says why, so the backend's Python path runs.

After a build, a stamp in the build directory records what was built (sources, flags,
compiler, torch and Python versions) and the library's path; a later process whose key is
the same imports that library directly, as the builder would, without importing the builder
or running ninja. Any other case goes through the builder, which rebuilds what changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch

log = logging.getLogger("moe_dispatch")

# Written into a build directory after torch's builder made (or found) a module there: the
# key of what was built, and the library's path.
STAMP = "moe_dispatch_build.json"

_OFF = ("0", "false", "no", "off")


def switched_off(variable: str) -> bool:
    """Whether an on-by-default switch variable says off (``0``/``false``/``no``/``off``)."""
    return os.environ.get(variable, "1").strip().lower() in _OFF

# The toolkit's C++ header for native entries (moe_dispatch_fast_call.h), on every module's
# include path.
INCLUDE_DIR = Path(__file__).with_name("include")


def cache_dir() -> Path:
    """moe-dispatch's directory under the user cache ($XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moe-dispatch"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    # torch's builder runs "ninja" from PATH; the ninja wheel puts it next to this
    # interpreter, which is not on PATH when a venv's python is run without activating it.
    if shutil.which("ninja") is not None:
        yield
        return
    import ninja  # the pip package

    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


class NativeExtension:
    """One C++ module: built once per (torch, Python) version, loaded once per process.

    ``switch``: an env variable that turns it off (``0``/``false``/``no``/``off``);
    ``dir_env``: one that overrides the build directory; ``before_build``: imports the
    module's C++ needs registered first (e.g. the vendor library that registers an op).
    """

    def __init__(self, name: str, sources: Sequence[Path], *, switch: str, dir_env: str,
                 what: str, extra_cflags: Sequence[str] = ("-O2",),
                 extra_ldflags: Sequence[str] = (), headers: Sequence[Path] = (),
                 before_build: Callable[[], None] | None = None,
                 build_command: str | None = None) -> None:
        self.name, self.sources, self.what = name, [str(s) for s in sources], what
        self.build_command = build_command  # how a user builds it now, for describe()
        self.switch, self.dir_env = switch, dir_env
        # The headers' hash as a define: torch's builder rebuilds when its arguments change,
        # and it hashes only the sources, not the headers they include (the toolkit's, and
        # ``headers``, the module's own).
        digest = hashlib.sha256(b"".join(Path(h).read_bytes() for h in
                                         (INCLUDE_DIR / "moe_dispatch_fast_call.h", *headers))).hexdigest()
        # Hidden symbols: two builds of one source (the native kernel's avx2 and avx512) define
        # the same inline functions with different code, and loaded with RTLD_GLOBAL the
        # second bound its calls to the first's (heap corruption, measured). Only the module's
        # init function (PYBIND11_MODULE marks it) needs to be visible.
        self.extra_cflags = (list(extra_cflags) + ["-fvisibility=hidden", "-fvisibility-inlines-hidden"]
                             + [f"-DMOE_DISPATCH_TOOLKIT_H={digest[:16]}"])
        self.extra_ldflags = list(extra_ldflags)
        self.before_build = before_build
        self.verbose = False
        self._lock = threading.Lock()
        self._result: tuple[ModuleType | None, str] | None = None

    def build_directory(self) -> Path:
        """One directory per module: torch's builder keeps its build file and objects
        there, and two modules in one directory would rebuild each other."""
        env = os.environ.get(self.dir_env)
        if env:
            return Path(env) / self.name
        tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
        return cache_dir() / "native" / tag / self.name

    def disabled(self) -> bool:
        return switched_off(self.switch)

    def load(self) -> ModuleType | None:
        """The compiled module, or None. Decided once per process."""
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._build_and_load()
        return self._result[0]

    def status(self) -> str:
        """Whether it is in use in this process, and why not."""
        if self._result is None:
            return "not loaded yet (it loads on first use)"
        return self._result[1]

    def describe(self) -> str:
        """The status without building anything (for ``moe-dispatch doctor``)."""
        if self._result is not None:
            return self._result[1]
        if self.disabled():
            return f"off ({self.switch}={os.environ.get(self.switch)}): the Python path runs"
        directory = self.build_directory()
        if any(directory.glob(f"{self.name}*.so")):
            return f"built ({directory}); loads on first use"
        hint = f", or now with `{self.build_command}`" if self.build_command else ""
        return f"not built yet: it builds on first use (~30 s){hint}"

    def op_caller(self, op: Callable[..., Any], lock: Any) -> Callable[..., None]:
        """The serialised kernel call, decided by :meth:`load` once per process: the
        compiled module's ``run_op`` (its own mutex, the GIL released) when it loads, else
        ``op`` under ``lock``. A kernel that is not thread-safe is then guarded by one lock,
        whichever path calls it."""
        module = self.load()
        if module is not None:
            return module.run_op

        def call(*args: Any) -> None:
            with lock:
                op(*args)
        return call

    def main(self, library: Callable[[], tuple[bool, str]] | None = None) -> int:
        """The body of ``python -m <the backend's native module>``: build (showing the
        compiler's commands and output), print the status. ``library()``: (present, text)
        of what the module needs; absent, nothing is built. Exit status 0 unless a build
        was possible and failed."""
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        if library is not None:
            present, text = library()
            if not present:
                print(f"{self.what}: not built ({text})")
                return 0
        self.verbose = True
        module = self.load()
        print(f"{self.what}: {self.status()}")
        return 0 if module is not None or self.disabled() else 1

    def _build_and_load(self) -> tuple[ModuleType | None, str]:
        if self.disabled():
            return None, f"off ({self.switch}={os.environ.get(self.switch)}): the Python path runs"
        compiler = os.environ.get("CXX", "c++")
        compiler_path = shutil.which(compiler)
        if compiler_path is None:
            reason = f"no C++ compiler ({compiler!r} is not on PATH)"
            log.warning("moe-dispatch: %s unavailable: %s; the Python path runs", self.what, reason)
            return None, f"unavailable: {reason}; the Python path runs"
        directory = self.build_directory()
        t0 = time.perf_counter()
        try:
            if self.before_build is not None:
                self.before_build()
            key = self._key(compiler_path)
            module = self._load_built(directory, key)
            if module is not None:
                return module, f"in use ({directory})"
            from torch.utils.cpp_extension import load as build

            directory.mkdir(parents=True, exist_ok=True)
            # No stamp while the builder may replace the library: a stamp names only a
            # library built for its key (a rebuild that dies half way leaves none).
            (directory / STAMP).unlink(missing_ok=True)
            log.info("moe-dispatch: loading the %s from %s (compiled on first use: ~30 s)",
                     self.what, directory)
            with _ninja_on_path():
                module = build(name=self.name, sources=self.sources, build_directory=str(directory),
                               extra_cflags=self.extra_cflags,
                               extra_ldflags=self.extra_ldflags, verbose=self.verbose,
                               extra_include_paths=[str(INCLUDE_DIR)])
        except Exception as exc:  # a failed build degrades to the Python path, never breaks it
            # The first line only (a compiler log follows it); a verbose build shows all.
            first = (str(exc).strip().splitlines() or [""])[0]
            reason = f"{type(exc).__name__}: {first}"
            log.warning("moe-dispatch: building the %s in %s failed (%s); the Python path runs",
                        self.what, directory, reason)
            return None, f"unavailable: build failed ({reason}); the Python path runs"
        log.info("moe-dispatch: %s ready in %.1f s", self.what, time.perf_counter() - t0)
        self._write_stamp(directory, key, module)
        return module, f"in use ({directory})"

    def _key(self, compiler_path: str) -> str:
        """What torch's builder would rebuild for: the sources' bytes (the headers are in the
        flags), the flags, the compiler's path, torch's version and commit, Python's version. Not
        torch's path: two environments with the same torch share one build (the builder would
        relink for the other's include path, to the same binary)."""
        h = hashlib.sha256()
        parts = [*self.sources, "|", *self.extra_cflags, "|", *self.extra_ldflags, "|",
                 str(INCLUDE_DIR), compiler_path, torch.__version__,
                 str(torch.version.git_version), sys.version]
        for part in parts:
            h.update(part.encode() + b"\0")
        for source in self.sources:
            h.update(Path(source).read_bytes())
        return h.hexdigest()

    def _load_built(self, directory: Path, key: str) -> ModuleType | None:
        """The module already built for ``key``, imported as torch's builder imports it, but
        without importing the builder (and setuptools with it) or running ninja again:
        measured on a Zen 4, 4.3 MiB less resident memory and 1 ms instead of 40-50 ms per
        module and process. None when the stamp is missing, another key's, its library is
        not the file it names (replaced since: another build relinked it), or does not
        import: the builder decides (under its lock)."""
        try:
            stamp = json.loads((directory / STAMP).read_text())
            library = Path(stamp["library"])
            if stamp["key"] != key or library.parent != directory.resolve():
                return None
            if stamp["file"] != _file_id(library):  # missing, or rebuilt in place
                return None
            spec = importlib.util.spec_from_file_location(library.stem, library)
            if spec is None or spec.loader is None:
                return None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception:  # unreadable stamp, a library that fails to import: rebuild / reload
            return None
        return module

    def _write_stamp(self, directory: Path, key: str, module: ModuleType) -> None:
        library = getattr(module, "__file__", None)
        if not library:
            return
        tmp = directory / f"{STAMP}.{os.getpid()}.tmp"
        try:  # written whole, then renamed: a reader never sees half a stamp
            path = Path(library).resolve()
            tmp.write_text(json.dumps({"key": key, "library": str(path), "file": _file_id(path)}))
            os.replace(tmp, directory / STAMP)
        except OSError as exc:  # a read-only cache still works, through the builder
            log.debug("moe-dispatch: no build stamp for the %s (%s)", self.what, exc)


def _file_id(path: Path) -> list[int] | None:
    """The library file's size and modification time (ns), or None if it is missing."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]
