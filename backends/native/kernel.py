"""Build and load the native kernel (``kernel.cpp``), one build per ISA.

Each build is compiled with torch's C++ extension builder the first time a process needs it
(about 40 s on 2 cores; ``scripts/setup.sh`` builds this machine's at install) into the user
cache. The build to run is chosen from :class:`~moe_dispatch.Capabilities`, never from the
compiler's view of the build machine (``-march=native`` would put instructions in a cache
shared between machines that one of them lacks): ``avx512`` needs AVX-512 F/BW/VL, VNNI
and BF16; ``avx2`` needs AVX2, FMA and F16C. ``MOE_DISPATCH_NATIVE_ISA=avx2`` forces the
narrower build on an AVX-512 machine (the tests run both builds wherever both can run).

Run ``python -m moe_dispatch_backends.native`` to build this machine's builds and
print their status.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import moe_dispatch as md
from moe_dispatch.kernels import NativeExtension

SWITCH = "MOE_DISPATCH_NATIVE_KERNEL"  # 0/false/no/off: the native backend is off
ISA_ENV = "MOE_DISPATCH_NATIVE_ISA"  # "avx2" or "avx512": that build (if the CPU has it)
DIR_ENV = "MOE_DISPATCH_NATIVE_DIR"
SOURCE = Path(__file__).with_name("kernel.cpp")
# Included by kernel.cpp (dots.h, which includes the others); an edit of any rebuilds.
HEADERS = tuple(Path(__file__).with_name(n)
                for n in ("activations.h", "blocks_avx2.h", "blocks_avx512.h", "blocks_quant.h",
                          "dots.h", "dots_bf16.h", "forward_blocks.h", "layout.h",
                          "read.h", "routing.h", "stream.h", "team.h", "warm.h"))
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers; without it the loops run
# on one thread. The process's libgomp (torch's own, same soname) is the one linked.
_COMMON = ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c")
FLAGS = {"avx2": _COMMON,
         "avx512": _COMMON + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                              "-mavx512bf16")}
ISAS = ("avx512", "avx2")  # widest first

EXTENSIONS = {isa: NativeExtension(f"moe_dispatch_native_kernel_{isa}", [SOURCE], switch=SWITCH,
                                   dir_env=DIR_ENV, what=f"native kernel ({isa} build)",
                                   extra_cflags=flags, extra_ldflags=("-fopenmp",),
                                   headers=list(HEADERS),
                                   build_command="python -m moe_dispatch_backends.native")
              for isa, flags in FLAGS.items()}


def disabled() -> bool:
    """Whether MOE_DISPATCH_NATIVE_KERNEL turns the backend off (one switch for every build)."""
    return EXTENSIONS["avx2"].disabled()


def runs(isa: str, caps: md.Capabilities) -> bool:
    """Whether this CPU executes every instruction of the ``isa`` build."""
    if caps.arch != "x86_64" or not (caps.avx2 and caps.fma_f16c):
        return False
    return isa == "avx2" or (caps.avx512 and caps.avx512_bw_vl and caps.avx512_vnni
                             and caps.avx512_bf16)


def isa_for(caps: md.Capabilities) -> tuple[str | None, str]:
    """The build this machine runs, or None; and why."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in FLAGS:
            return None, f"{ISA_ENV}={forced!r}: expected one of {', '.join(FLAGS)}"
        if not runs(forced, caps):
            return None, f"{ISA_ENV}={forced}: this CPU lacks the {forced} build's instructions"
        return forced, f"the {forced} build ({ISA_ENV})"
    for isa in ISAS:
        if runs(isa, caps):
            return isa, f"the {isa} build"
    return None, ("the kernel needs x86_64 with AVX2, FMA and F16C; this CPU has "
                  f"arch={caps.arch}, avx2={caps.avx2}, fma_f16c={caps.fma_f16c}")


def load(isa: str) -> ModuleType | None:
    """The compiled build (built on first use), or None: :func:`status` says why. Never
    loaded where the real CPU lacks its instructions, whatever capabilities a caller
    simulates: loading the avx512 build on an AVX2 CPU kills the process (SIGILL, measured:
    its static initialisers already use AVX-512)."""
    if not runs(isa, md.Capabilities.detect()):
        return None
    return EXTENSIONS[isa].load()


def status(isa: str) -> str:
    if not runs(isa, md.Capabilities.detect()):
        return (f"not loaded: this machine's CPU cannot run the {isa} build (the capabilities "
                "asked for are simulated)")
    return EXTENSIONS[isa].status()


def describe() -> str:
    """Every build's state, without building anything (for ``moe-dispatch doctor``)."""
    return "; ".join(f"{isa}: {ext.describe()}" for isa, ext in EXTENSIONS.items())


def main() -> int:
    caps = md.Capabilities.detect()
    code = 0
    for isa in ISAS:
        if runs(isa, caps):
            code |= EXTENSIONS[isa].main()
        else:
            print(f"native kernel ({isa} build): not built (this CPU cannot run it)")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
