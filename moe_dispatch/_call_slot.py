"""MoELayer's call slot: the fast branch of ``LayerCalls.__call__`` in C (``_call_slot.cpp``).

Why: a decode call's Python runs cold (the kernel has just streamed its weights through every
cache), and the interpreter's own cost of entering ``__call__`` and reading a dozen names was
a tenth of a small int4 layer's call. The slot is CPython's ``tp_call`` of the class: the
``__call__`` in the class's dict stays what dynamo traces, what a subclass inherits and what
``type(layer).__call__`` shows, and the slot hands every call it does not run to it.

An accelerator, never a requirement: built on first use like the backends' C++ entries
(seconds: it includes no torch header), installed at the first ``prepare()`` of a process,
and off with ``MOE_DISPATCH_CALL_SLOT=0``, without a compiler, or after a failed build; the
Python ``__call__`` then runs every call, as it runs every call of a subclass.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ._fastpath import COMPILER, GLOBAL_HOOKS
from .kernels import NativeExtension

log = logging.getLogger("moe_dispatch")

SWITCH = "MOE_DISPATCH_CALL_SLOT"
BUILD = 'python -c "import moe_dispatch._call_slot as s; s.build()"'

EXTENSION = NativeExtension("moe_dispatch_call_slot", [Path(__file__).with_name("_call_slot.cpp")],
                            switch=SWITCH, dir_env="MOE_DISPATCH_NATIVE_DIR",
                            what="layer call slot", extra_cflags=("-O2",),
                            build_command=BUILD)

_lock = threading.Lock()
_installed: list[type] = []


def install(cls: type) -> bool:
    """Make the slot ``cls``'s (once per process, one class); whether it is in use."""
    if _installed:
        return _installed[0] is cls and active()
    with _lock:
        if not _installed:
            module = EXTENSION.load()
            if module is None:
                return False
            module.install(cls, cls.__call__, GLOBAL_HOOKS, COMPILER, torch.Tensor)
            _installed.append(cls)
    return _installed[0] is cls and active()


def installed() -> bool:
    """Whether :func:`install` made the slot a class's in this process."""
    return bool(_installed)


def active() -> bool:
    """Whether the installed class's calls go through the slot now."""
    module = EXTENSION.load() if _installed else None
    return module is not None and bool(module.active())


def set_active(on: bool) -> None:
    """The slot (True) or CPython's, which calls the Python ``__call__`` (False)."""
    module = EXTENSION.load()
    if module is None or not _installed:
        raise RuntimeError(f"the call slot is not installed: {describe()}")
    module.set_active(on)


def taken() -> int:
    """Calls the slot ran to the end in this process (its entry returned the output)."""
    module = EXTENSION.load() if _installed else None
    return int(module.taken()) if module is not None else 0


def describe() -> str:
    """The slot's state, for ``moe-dispatch doctor``."""
    if _installed:
        return (f"in use on {_installed[0].__name__} ({EXTENSION.status()})" if active()
                else "installed, not in use (the class's __call__ was reassigned)")
    return EXTENSION.describe()


def build() -> None:
    """Build (showing the compiler's output) and print the status: ``BUILD``, which the
    README's setup runs. Exits 1 where a build was possible and failed."""
    code = EXTENSION.main()
    if code:
        raise SystemExit(code)
