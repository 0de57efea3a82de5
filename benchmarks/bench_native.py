"""The native decode kernel beside every other candidate, at decode token counts.

Usage:
    .venv/bin/python benchmarks/bench_native.py [--config C2 C1] [--tokens 1,2,4,8] [--reps 15]

Per config, in one process and one round-robin per token count (shuffled rounds, medians,
a fresh routing from a pool of 8 per round, a 128 MiB read between calls so that every call
starts on cold caches as decode does in a real model):
- bf16: every accepting backend forced, the raw vLLM kernel and the raw zentorch op (where
  they run), and the default (``policy="auto"``, tuned fresh);
- int8 (per channel), int4 g128 and int4 g32 (GGUF Q4_0's blocks), quantized from the same
  float weights: the native kernel forced, every other accepting quantized backend forced,
  and the default.
Printed per row: ms per call; the DRAM read (a cold 64 MiB ``torch.sum`` timed in the same
rounds, ``bench_perf.DramRead``) in GB/s, on all threads and on one (on this VM the two
can be equal: the vCPUs then share one core's bandwidth); the native kernel's effective
bandwidth on the active weight bytes (bytes of one expert x distinct experts of the round's
call / time) as a share of the same round's read, median over rounds; and its speed-up over
the fastest other bf16 candidate (for bf16: over the fastest other candidate).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush, time_rounds
from moe_dispatch.testing import random_inputs

from bench_backends import CONFIGS, expert_weights, raw_kernels
from bench_perf import DramRead

SCHEMES = {"int8": md.QuantScheme("int8"), "int4g128": md.QuantScheme("int4", group_size=128),
           "int4g32": md.QuantScheme("int4", group_size=32)}  # g32: GGUF Q4_0's blocks


def _accepting(config: md.MoEConfig) -> list[str]:
    # Every backend that runs the config, those over a layer's default memory limit too
    # (zentorch's quantized op): forced, they run; the default column keeps to the limit.
    return [c.name for c in md.resolve(config, max_weight_copies=math.inf).candidates
            if c.decision.accepted]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C2", "C1"], choices=sorted(CONFIGS))
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    print(f"machine: {md.Capabilities.detect().fingerprint()}, {torch.get_num_threads()} threads\n")
    flush, read = CacheFlush(), DramRead()
    for cname in args.config:
        shape = CONFIGS[cname]
        cfg = md.MoEConfig(**shape, dtype=torch.bfloat16)
        w13, w2 = expert_weights(shape)
        b13, b2 = w13.bfloat16(), w2.bfloat16()
        forced = {n: md.MoELayer(cfg, backend=n).load_weights(b13, b2).prepare() for n in _accepting(cfg)}
        fns: dict = {f"bf16 {n}": layer for n, layer in forced.items()}
        fns.update({f"bf16 {k}": f for k, f in raw_kernels(forced).items()})
        fns["bf16 default"] = md.MoELayer(cfg, tuning_cache=False).load_weights(b13, b2).prepare()
        per_expert = {"bf16": 3 * cfg.hidden_size * cfg.intermediate_size * 2}
        for sname, scheme in SCHEMES.items():
            qcfg = md.MoEConfig(**shape, dtype=torch.bfloat16, weight_scheme=scheme)
            qe = md.quantize_experts(w13, w2, scheme)
            per_expert[sname] = qe.nbytes / cfg.num_experts
            for n in _accepting(qcfg):
                fns[f"{sname} {n}"] = md.MoELayer(qcfg, backend=n).load_weights(qe).prepare()
            fns[f"{sname} default"] = md.MoELayer(qcfg, tuning_cache=False).load_weights(qe).prepare()
        names = list(fns)
        print(f"### {cname}: {cfg.describe()}\n")
        formats = " / ".join(["bf16", *SCHEMES])
        print("| T | " + " | ".join(names) + " | DRAM read GB/s (all threads / one) | "
              f"native {formats}: % of DRAM read | "
              "native bf16 over the fastest other candidate | "
              f"native {' / '.join(SCHEMES)} over the fastest bf16 |")
        print("|" + " ---: |" * (len(names) + 5))
        for tokens in [int(t) for t in args.tokens.split(",")]:
            inputs = random_inputs(cfg, tokens, pool=8, seed=tokens)
            samples = time_rounds({**fns, "read": read, "read1": read.one_thread}, inputs, args.reps,
                                  warmup=2, seed=tokens, between=flush)
            med = {n: statistics.median(v) for n, v in samples.items()}
            # Round r ran inputs[r % pool] (time_rounds): its distinct experts are its bytes.
            active = [len(torch.unique(inputs[r % len(inputs)][2])) for r in range(args.reps)]
            share = {f: read.shares(samples[f"{f} native"], samples["read"],
                                    [a * per_expert[f] for a in active])
                     for f in per_expert if f"{f} native" in med}
            bf16_other = min(v for n, v in med.items() if n.startswith("bf16 ") and n != "bf16 native"
                             and n != "bf16 default")
            bf16_best = min(v for n, v in med.items() if n.startswith("bf16 ") and n != "bf16 default")
            ratio = bf16_other / med["bf16 native"] if "bf16 native" in med else float("nan")
            q = " / ".join(f"{bf16_best / med[f'{s} native']:.2f}x" for s in SCHEMES if f"{s} native" in med)
            print(f"| {tokens} | " + " | ".join(f"{med[n]:.2f}" for n in names)
                  + f" | {read.nbytes / med['read'] / 1e6:.1f} / {read.nbytes / med['read1'] / 1e6:.1f} | "
                  + " / ".join(f"{share[f]:.0f}%" for f in share) + f" | {ratio:.2f}x | {q} |", flush=True)
        print()
        del fns, forced
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
