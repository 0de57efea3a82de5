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
_installed: list[tuple[type, object]] = []  # (the class, its __call__ then)
_failed: list[str] = []


def install(cls: type) -> bool:
    """Make the slot ``cls``'s (once per process, one class); whether it is in use. Never
    raises: a slot that cannot be installed leaves the Python ``__call__`` (and says why)."""
    with _lock:
        if not _installed and not _failed:
            module = EXTENSION.load()
            if module is None:
                return False
            try:
                module.install(cls, cls.__call__, GLOBAL_HOOKS, COMPILER, torch.Tensor)
            except Exception as exc:  # e.g. this module reloaded: the C module's slot stays
                _failed.append(f"{type(exc).__name__}: {exc}")
                log.warning("moe-dispatch: the layer call slot was not installed (%s); the "
                            "Python __call__ runs", _failed[0])
                return False
            _installed.append((cls, cls.__call__))
    return bool(_installed) and _installed[0][0] is cls and active()


def installed() -> bool:
    """Whether :func:`install` made the slot a class's in this process."""
    return bool(_installed)


def active() -> bool:
    """Whether the installed class's calls go through the slot now."""
    module = EXTENSION.load() if _installed else None
    return module is not None and bool(module.active())


def set_active(on: bool) -> None:
    """The slot (True) or CPython's, which calls the Python ``__call__`` (False). True is a
    RuntimeError where ``__call__`` was assigned on the class since: the slot would skip it."""
    if not _installed:
        raise RuntimeError(f"the call slot is not installed: {describe()}")
    module = EXTENSION.load()
    assert module is not None  # installed from it
    module.set_active(on)


def taken() -> int:
    """Calls the slot ran to the end in this process (its entry returned the output)."""
    module = EXTENSION.load() if _installed else None
    return int(module.taken()) if module is not None else 0


def describe() -> str:
    """The slot's state, for ``moe-dispatch doctor``."""
    if _installed:
        cls, call = _installed[0]
        if active():
            return f"in use on {cls.__name__} ({EXTENSION.status()})"
        if cls.__call__ is not call:
            return f"not in use: {cls.__name__}.__call__ was assigned since; the Python __call__ runs"
        # CPython resets tp_call when __call__ is assigned on the class, and putting the same
        # function back does not restore the slot: set_active(True) does.
        return ("installed, switched off (set_active(False), or __call__ assigned on the class "
                "and put back since); the Python __call__ runs")
    if _failed:
        return f"not installed ({_failed[0]}); the Python __call__ runs"
    return EXTENSION.describe()


def build() -> None:
    """Build (showing the compiler's output) and print the status: ``BUILD``, which the
    README's setup runs. Exits 1 where a build was possible and failed."""
    code = EXTENSION.main()
    if code:
        raise SystemExit(code)
