"""Two versions of the native kernel's source, side by side in one process.

Usage:
    git archive <commit> backends/native | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_native_ab.py --base /tmp/base/backends/native \
        [--new backends/native] [--isa avx512] [--cases C1:g32:1,C2:int8:2] [--rounds 40]

Each directory is built as its own extension (its kernel.cpp and headers) and packs the
weights with its own ``_pack.py``, so a change of layout compares too. Each version runs on
its own forced native layer (its own copy of the same weights); per round, the two are called
in a random order, each after a 128 MiB read (cold). Printed per case: the base's median ms,
the median of new / base over the rounds (paired) with its quartiles, and whether the two
give the same output on every input. Each round also times a cold 64 MiB read (bench_perf's
DramRead): this VM's memory moves between a slow phase, where two threads saturate it, and
a fast one, where each core's own streaming is the bound, and a variant can gain in one and
lose in the other; so the median ratio is also given over the rounds whose read was at or
above the case's median read speed ("fast half") and over the others. How the ratios quoted
in docs/backends/native.md for kernel variants were measured (an A/A pair of one source gave
0.97-1.01x on a Zen 5).
Cases: config (bench_backends.CONFIGS) : format (bf16, int8, g128, g32, g128z: int4 with
zero points) : tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

import moe_dispatch as md
import moe_dispatch.kernels as kernels
import moe_dispatch_backends.native as native
from moe_dispatch._timing import CacheFlush
from moe_dispatch.testing import random_inputs
from moe_dispatch_backends.native import kernel

from bench_backends import CONFIGS, expert_weights
from bench_perf import DramRead

SCHEMES = {"bf16": None, "int8": md.QuantScheme("int8"),
           "g128": md.QuantScheme("int4", group_size=128), "g32": md.QuantScheme("int4", group_size=32),
           "g128z": md.QuantScheme("int4", group_size=128, symmetric=False)}


def _version(src: Path, name: str, isa: str):
    """(the built module, the directory's experts_args)."""
    include = Path(kernels.__file__).parent / "include"
    module = cpp_extension.load(name, [str(src / "kernel.cpp")], extra_cflags=list(kernel.FLAGS[isa]),
                                extra_ldflags=["-fopenmp"], extra_include_paths=[str(include), str(src)])
    spec = importlib.util.spec_from_file_location(f"{name}_pack", src / "_pack.py")
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)
    return module, pack.experts_args


def _layer(cname: str, fmt: str, version) -> md.MoELayer:
    module, experts_args = version
    # The backend loads the kernel and packs through these two names: this version's.
    kernel_load, native_args = kernel.load, native.experts_args
    kernel.load, native.experts_args = (lambda isa: module), experts_args
    try:
        cfg = md.MoEConfig(**CONFIGS[cname], dtype=torch.bfloat16, weight_scheme=SCHEMES[fmt])
        w13, w2 = expert_weights(CONFIGS[cname])
        layer = md.MoELayer(cfg, backend="native")
        if SCHEMES[fmt] is None:
            return layer.load_weights(w13.bfloat16(), w2.bfloat16()).prepare()
        return layer.load_weights(md.quantize_experts(w13, w2, SCHEMES[fmt])).prepare()
    finally:
        kernel.load, native.experts_args = kernel_load, native_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--new", type=Path, default=Path(native.__file__).parent)
    p.add_argument("--isa", default="avx512", choices=sorted(kernel.FLAGS))
    p.add_argument("--cases", default="C1:g32:1,C1:int8:1,C2:g32:1")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--tag", default="ab", help="suffix of the two extensions' names (a new tag rebuilds)")
    args = p.parse_args(argv)
    caps = md.Capabilities.detect()
    if not kernel.runs(args.isa, caps):
        p.error(f"--isa {args.isa}: this CPU cannot run that build")
    versions = {"base": _version(args.base, f"ab_base_{args.isa}_{args.tag}", args.isa),
                "new": _version(args.new, f"ab_new_{args.isa}_{args.tag}", args.isa)}
    print(f"machine: {caps.fingerprint()}, {torch.get_num_threads()} threads, the {args.isa} build\n")
    print("| case | base ms | new / base (median) | q1 | q3 | read GB/s | fast half | slow half "
          "| same output |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    flush, rng, dram = CacheFlush(), random.Random(0), DramRead()
    for case in args.cases.split(","):
        cname, fmt, tokens = case.split(":")
        layers = {k: _layer(cname, fmt, v) for k, v in versions.items()}
        inputs = random_inputs(layers["base"].config, int(tokens), pool=8, seed=1)
        same = all(torch.equal(layers["base"](*a), layers["new"](*a)) for a in inputs)
        times: dict[str, list[float]] = {"base": [], "new": []}
        reads: list[float] = []
        for i in range(args.rounds):
            x, tw, ids = inputs[i % len(inputs)]
            flush()
            t0 = time.perf_counter()
            dram()
            reads.append(DramRead.nbytes / (time.perf_counter() - t0) / 1e9)
            for k in rng.sample(list(layers), 2):
                flush()
                t0 = time.perf_counter()
                layers[k](x, tw, ids)
                times[k].append(time.perf_counter() - t0)
        ratios = [n / b for n, b in zip(times["new"], times["base"])]
        r, mid = sorted(ratios), statistics.median(reads)
        fast = [q for q, g in zip(ratios, reads) if g >= mid]
        slow = [q for q, g in zip(ratios, reads) if g < mid]
        halves = " | ".join(f"{statistics.median(h):.3f}" if h else "-" for h in (fast, slow))
        print(f"| {case} | {statistics.median(times['base']) * 1e3:.3f} | {statistics.median(r):.3f} | "
              f"{r[len(r) // 4]:.3f} | {r[3 * len(r) // 4]:.3f} | {min(reads):.0f}-{max(reads):.0f} | "
              f"{halves} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(argv=None))
