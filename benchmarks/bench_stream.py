"""The native kernel's block loop against a plain read of the same bytes, per core.

Usage:
    .venv/bin/python benchmarks/bench_stream.py [--config C2] [--formats int8,int4g128,int4g32]
                                                [--threads 1,2] [--inputs 1] [--experts 4] [--reps 25]
    (MOE_DISPATCH_NATIVE_ISA=avx2 for the avx2 build on an AVX-512 machine)

A decode call is bound by its weights' bytes only if its loops keep as many cache lines in
flight as the memory needs. Two cores on this project's VMs sometimes saturate the memory
(then any loop that keeps up reads at the memory's speed) and sometimes do not (then each
core's own streaming is the bound, and a loop that holds fewer lines in flight than a plain
read loses to it). This script isolates that: the forced native layer's ``stream_w13`` runs
step 2's block loop alone (the pair dot products of ``--inputs`` inputs, an expert's tokens:
one at T=1, over every pair of
w13 of ``--experts x threads`` consecutive experts, one contiguous share per thread, no
routing, buffers or barriers: ``stream.h``), against ``read_steps`` (plain 64-byte loads by
the same team) over exactly those bytes. One process, shuffled rounds, a 128 MiB read before
each call (cold), a random window of experts per round; GB/s of w13's bytes, medians, and
the median over rounds of the read's time over the loop's ("loop / read" < 1: the loop is
slower). On one thread the ratio is a core's own: the number that a change to the loop's
prefetch or instruction count moves, whatever phase the memory is in.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush
from moe_dispatch_backends.native import kernel

from bench_backends import CONFIGS, expert_weights
from bench_native import SCHEMES

BLOCK_FORMATS = tuple(SCHEMES)  # int8, int4g128, int4g32


def _experts(shape: dict, fmt: str) -> tuple[object, md.MoEConfig]:
    """The forced native layer's kernel object, on random weights of this format."""
    cfg = md.MoEConfig(**shape, dtype=torch.bfloat16, weight_scheme=SCHEMES[fmt])
    layer = md.MoELayer(cfg, backend="native")
    layer.load_weights(md.quantize_experts(*expert_weights(shape), SCHEMES[fmt]))
    return layer.prepare().plan.route.state.experts, cfg


def _counts(p: argparse.ArgumentParser, flag: str, text: str, lo: int, hi: int) -> list[int]:
    """A comma-separated list of integers in [lo, hi], or the parser's error naming the flag."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"{flag}: comma-separated integers, got {text!r}")
    if any(not lo <= v <= hi for v in values):
        p.error(f"{flag}: integers in [{lo}, {hi}], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="C2", choices=sorted(CONFIGS))
    p.add_argument("--formats", default=",".join(BLOCK_FORMATS),
                   help=f"comma-separated, of {', '.join(BLOCK_FORMATS)}")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--inputs", default="1", help="comma-separated input counts per pair (1-6)")
    p.add_argument("--experts", type=int, default=4, help="experts per thread in a call")
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args(argv)
    formats = list(dict.fromkeys(args.formats.split(",")))
    for f in formats:
        if f not in BLOCK_FORMATS:
            p.error(f"--formats: {f!r} is not one of {', '.join(BLOCK_FORMATS)}")
    threads = _counts(p, "--threads", args.threads, 1, 1024)
    inputs = _counts(p, "--inputs", args.inputs, 1, 6)
    if args.reps < 1 or args.experts < 1:
        p.error(f"--reps and --experts: at least 1, got {args.reps} and {args.experts}")
    shape = CONFIGS[args.config]
    if args.experts * max(threads) > shape["num_experts"]:
        p.error(f"--experts {args.experts} x {max(threads)} threads exceeds {args.config}'s "
                f"{shape['num_experts']} experts")
    caps = md.Capabilities.detect()
    isa, why = kernel.isa_for(caps)
    if isa is None or kernel.load(isa) is None:
        p.error(f"the native kernel does not run here: {why if isa is None else kernel.status(isa)}")
    module = kernel.load(isa)
    experts = {f: _experts(shape, f) for f in formats}
    print(f"machine: {caps.fingerprint()}, the {isa} build ({why}); {args.config}: {shape}; "
          f"{args.experts} experts' w13 per thread\n")
    print("| format | threads | inputs | loop GB/s | read GB/s | loop / read |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    flush, rng = CacheFlush(), random.Random(0)
    before = torch.get_num_threads()
    try:
        for f in formats:
            kern, cfg = experts[f]
            stream = kern.w13_stream()
            per_expert = stream[0].numel()
            flat = stream.view(-1)
            for t in threads:
                torch.set_num_threads(t)
                count = args.experts * t
                for n in inputs:
                    loop: list[float] = []
                    read: list[float] = []
                    for _ in range(args.reps):
                        first = rng.randrange(0, cfg.num_experts - count + 1)
                        window = flat[first * per_expert:(first + count) * per_expert]
                        order = ["loop", "read"]
                        rng.shuffle(order)
                        for which in order:
                            flush()
                            if which == "loop":
                                loop.append(kern.stream_w13(first, count, n)[0])
                            else:
                                read.append(module.read_steps(window, [window.numel()])[0])
                    nbytes = count * per_expert
                    ratio = statistics.median(r / s for r, s in zip(read, loop))
                    print(f"| {f} | {t} | {n} | {nbytes / statistics.median(loop) / 1e9:.1f} | "
                          f"{nbytes / statistics.median(read) / 1e9:.1f} | {ratio:.3f} |", flush=True)
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(argv=None))
