"""The address ledger and the op lock.

The op's weight cache is keyed by memory address and can never be evicted, so an address
once handed to the op is never handed over again: a freed-then-reused address would give
silently stale results.

The op is not thread-safe: measured here, 8 threads calling it concurrently on shared
layers got 2054 of 2400 outputs wrong (relative error up to 3e36). Calls are serialised
process-wide (the op already uses every core through OpenMP, so little is lost): by the
native module's mutex when it is loaded, else by a Python lock. Which one is decided once
per process, before the first op call (:func:`op_caller`), so two locks never coexist.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from . import native

LEDGER_LOCK = threading.Lock()
_BURNED: set[int] = set()
_OP_LOCK = threading.Lock()


def op_caller() -> Callable[..., None]:
    """The serialised op call: ``call(out, x, w13, w2, w13_bias, w2_bias, topk_weights,
    topk_ids, skip_weighted, act, w13_scales, w2_scales, threads)``, the op run with
    ``threads`` threads (0: as many as torch has now). Why: the op reorders a layer's bf16
    weights in place for the thread count of its first call and keys them by it; called
    with another count it misses its cache, finds the raw weights gone and fails closed (a
    torch.set_num_threads after prepare(), or a thread whose count was never set)."""
    return native.EXTENSION.op_caller(_ThreadsPinned(torch.ops.zentorch.zentorch_fused_moe.default),
                                      _OP_LOCK)


class _ThreadsPinned:
    """The op with the thread count as its last argument, for the Python path (without the
    native module, whose ``run_op`` pins the calling thread's OpenMP count itself). Python
    has only torch.set_num_threads, process-wide: it is set and restored under the op lock."""

    def __init__(self, op: Callable[..., None]) -> None:
        self._op = op

    def __call__(self, *args: object) -> None:
        *op_args, threads = args
        before = torch.get_num_threads()
        if not threads or threads == before:
            self._op(*op_args)
            return
        torch.set_num_threads(int(threads))  # type: ignore[call-overload]
        try:
            self._op(*op_args)
        finally:
            torch.set_num_threads(before)


def _addresses(t: torch.Tensor) -> set[int]:
    """The tensor's address and each expert's (each slice along dim 0)."""
    base = t.data_ptr()
    if t.dim() == 0:
        return {base}
    step = t.stride(0) * t.element_size()
    return {base + i * step for i in range(t.shape[0])} | {base}


# A private copy starts at one of SHIFTS multiples of ALIGN bytes into a buffer that much
# longer, so that one allocation offers SHIFTS + 1 starting addresses. Why: the allocator
# hands a freed buffer's address back to the next one of its size, so each layer of a shape
# prepared and freed burns the addresses the next would get: with one start per allocation
# (and up to 64 allocations held), the 86th same-shaped copy in a process found none unseen.
ALIGN = 64  # bytes: torch's CPU allocations are 64-byte aligned, and so are the shifted starts
SHIFTS = 256
ATTEMPTS = 64


def private_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy whose addresses the op has never seen (hold LEDGER_LOCK)."""
    nbytes = t.numel() * t.element_size()
    held = []  # clashing allocations stay alive so the allocator cannot return them again
    for _ in range(ATTEMPTS):
        buffer = torch.empty(nbytes + SHIFTS * ALIGN, dtype=torch.uint8)
        for shift in range(0, SHIFTS * ALIGN + 1, ALIGN):
            copy = buffer[shift:shift + nbytes].view(t.dtype).view(t.shape)
            if not (_addresses(copy) & _BURNED):
                return copy.copy_(t)
        held.append(buffer)
    raise RuntimeError("could not allocate a weight buffer at an address the zentorch "
                       "weight cache has not seen")


def shared_or_copy(t: torch.Tensor) -> torch.Tensor:
    """The caller's tensor itself where that is safe, else a private copy (hold LEDGER_LOCK).

    Safe means: float32 (the op never writes fp32 weights: its cache keeps a packed copy
    instead; the tests check the caller's bytes after prepare and forwards), contiguous, and
    at addresses the op has never seen. An in-place change by the caller is then caught by
    the layer's version check. This saves one copy of the weights (measured: 2.02x -> 1.0x
    of the weight bytes kept for fp32). bf16 is always copied: the default cache mode
    reorders bf16 weights in place.
    """
    return adopt(t) if t.dtype == torch.float32 else private_copy(t)


def adopt(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is contiguous at addresses the op has never seen, else a
    private copy (hold LEDGER_LOCK). For a tensor nobody else may write: the caller's fp32
    weights (above), or one the backend has just made for the op (quantized values and
    scales in the op's layout), which then needs no second copy."""
    if t.is_contiguous() and not (_addresses(t) & _BURNED):
        return t
    return private_copy(t)


def burn(*tensors: torch.Tensor | None) -> None:
    """Remember every address of ``tensors``: the op has seen them (hold LEDGER_LOCK)."""
    for t in tensors:
        if t is not None:
            _BURNED.update(_addresses(t))
