"""The native kernel's builds side by side: the avx512 build and the avx2 build, with
zentorch's op and vLLM's kernel as references. On bf16 weights (the default) the avx512
build's vdpbf16ps against the avx2 build's widening and FMA; with ``--scheme int8``,
``int4g128`` or ``int4g32`` both builds' blocks of 16 rows (blocks_quant.h: vpdpbusd per 16
rows against maddubs per 8), and zentorch's quantized op forced past the copy limit.

Usage:
    .venv/bin/python benchmarks/bench_native_builds.py [--config C1 C2] [--tokens 1,2,4,8,16]
        [--scheme int8] [--reps 9]

Needs a CPU that runs both builds (AVX-512 F/BW/VL/VNNI/BF16). One process: each build is
chosen per layer with MOE_DISPATCH_NATIVE_ISA, so both are loaded at once; shuffled rounds
on fresh routing from a pool of 8, a 128 MiB read between calls (cold caches), medians.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import attrs
import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush, time_rounds
from moe_dispatch.testing import random_inputs

from bench_backends import CONFIGS, expert_weights, raw_kernels
from bench_native import _accepting
from bench_quant import SCHEMES

BUILDS = ("avx512", "avx2")
ISA_ENV = "MOE_DISPATCH_NATIVE_ISA"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C1", "C2"], choices=sorted(CONFIGS))
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--scheme", choices=sorted(SCHEMES), default=None,
                   help="quantize the experts (default: bf16 weights)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    print(f"machine: {md.Capabilities.detect().fingerprint()}, {torch.get_num_threads()} threads\n")
    flush = CacheFlush()
    for cname in args.config:
        cfg = md.MoEConfig(**CONFIGS[cname], dtype=torch.bfloat16)
        w13, w2 = (w.bfloat16() for w in expert_weights(CONFIGS[cname]))
        weights: tuple = (w13, w2)
        if args.scheme is not None:
            cfg = attrs.evolve(cfg, weight_scheme=SCHEMES[args.scheme])
            weights = (md.quantize_experts(w13.float(), w2.float(), cfg.weight_scheme),)
        fns: dict = {}
        for isa in BUILDS:  # the build is chosen when the layer is prepared
            os.environ[ISA_ENV] = isa
            fns[f"native {isa}"] = md.MoELayer(cfg, backend="native").load_weights(*weights).prepare()
        del os.environ[ISA_ENV]
        forced = {n: md.MoELayer(cfg, backend=n, max_weight_copies=math.inf)
                  .load_weights(*weights).prepare()
                  for n in ("zentorch", "vllm") if n in _accepting(cfg)}
        # The raw ops take float weights only: quantized, the forced layers are the columns.
        fns.update(raw_kernels(forced) if args.scheme is None else forced)
        names = list(fns)
        print(f"### {cname}: {cfg.describe()}\n")
        print("| T | " + " | ".join(names) + " | avx512 / avx2 | fastest other / avx512 |")
        print("|" + " ---: |" * (len(names) + 3))
        for tokens in [int(t) for t in args.tokens.split(",")]:
            inputs = random_inputs(cfg, tokens, pool=8, seed=tokens)
            samples = time_rounds(fns, inputs, args.reps, warmup=2, seed=tokens, between=flush)
            med = {n: statistics.median(v) for n, v in samples.items()}
            other = min((v for n, v in med.items() if not n.startswith("native")), default=float("nan"))
            print(f"| {tokens} | " + " | ".join(f"{med[n]:.2f}" for n in names)
                  + f" | {med['native avx512'] / med['native avx2']:.2f} | {other / med['native avx512']:.2f}x |",
                  flush=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
