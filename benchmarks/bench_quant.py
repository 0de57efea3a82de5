"""Quantized experts beside the fastest bf16 path, side by side in one process.

Usage:
    .venv/bin/python benchmarks/bench_quant.py [--config C2 C1] [--tokens 1,8,128,512]
        [--schemes int8,int4g128] [--reps 9]

Per config and scheme, in one round-robin (rounds in a shuffled order, medians):
- "bf16 default": ``MoELayer(config)`` on the float weights (policy="auto", tuned fresh);
- "raw:zentorch bf16 op": the op on that config's prepared zentorch weights, when it runs here;
- "<scheme> default": ``MoELayer(quantized config)`` (policy="auto" among the backends that
  declare the format, within the default ``max_weight_copies``: one copy of the quantized
  weights); "<scheme> default, no copy limit": the same with ``max_weight_copies=inf``;
  and each accepting quantized backend forced.
Printed: ms per call, the ratio of each to the bf16 default, the quantized default's table,
and the bytes the quantized default reads (``QuantizedExperts`` bytes per expert x distinct
experts of the first routing of the pool / time) as a fraction of a 1 GiB ``torch.sum`` read
in the same run (which does not reach DRAM peak: above 100% is possible). Weights are fresh
random (scale 0.05), never zeros.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

import moe_dispatch as md
from moe_dispatch._timing import time_rounds
from moe_dispatch.testing import random_inputs

from bench_backends import CONFIGS, expert_weights, raw_zentorch
from bench_perf import read_gbs

SCHEMES = {"int8": md.QuantScheme("int8"), "int8g32": md.QuantScheme("int8", group_size=32),
           "int4g32": md.QuantScheme("int4", group_size=32),
           "int4g128": md.QuantScheme("int4", group_size=128)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C2", "C1"], choices=sorted(CONFIGS))
    p.add_argument("--tokens", default="1,8,128,512")
    p.add_argument("--schemes", default="int8,int4g128")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    dram = read_gbs()
    print(f"machine: {md.Capabilities.detect().fingerprint()}, {torch.get_num_threads()} threads; "
          f"1 GiB fp32 read {dram:.1f} GB/s")
    for cname in args.config:
        shape = CONFIGS[cname]
        fcfg = md.MoEConfig(**shape, dtype=torch.bfloat16)
        w13, w2 = expert_weights(shape)
        fns = {"bf16 default": md.MoELayer(fcfg, tuning_cache=False).load_weights(
            w13.bfloat16(), w2.bfloat16()).prepare()}
        zen = None
        if fns["bf16 default"].resolution.backend == "zentorch":
            zen = md.MoELayer(fcfg, backend="zentorch").load_weights(w13.bfloat16(), w2.bfloat16()).prepare()
            fns["raw:zentorch bf16 op"] = raw_zentorch(zen)
        qbytes = {}
        for sname in args.schemes.split(","):
            scheme = SCHEMES[sname]
            qcfg = md.MoEConfig(**shape, dtype=torch.bfloat16, weight_scheme=scheme)
            qe = md.quantize_experts(w13, w2, scheme)
            qbytes[sname] = qe.nbytes / fcfg.num_experts
            t0 = time.perf_counter()
            default = md.MoELayer(qcfg, tuning_cache=False).load_weights(qe).prepare()
            print(f"\n{cname} {sname}: {qe.nbytes / 2**20:.0f} MiB ({qe.nbytes / (2 * (w13.numel() + w2.numel())):.3f}x "
                  f"of bf16); default prepared in {time.perf_counter() - t0:.1f} s; routes: "
                  + ", ".join(f"T<={t}: {n}" for t, n in (default.tuned_table or {}).items()),
                  file=sys.stderr)
            fns[f"{sname} default"] = default
            free = md.MoELayer(qcfg, tuning_cache=False, max_weight_copies=math.inf).load_weights(qe).prepare()
            print(f"{cname} {sname}, no copy limit: routes: "
                  + ", ".join(f"T<={t}: {n}" for t, n in (free.tuned_table or {}).items()), file=sys.stderr)
            fns[f"{sname} default, no copy limit"] = free
            for cand in md.resolve(qcfg, max_weight_copies=math.inf).candidates:
                if cand.decision.accepted:
                    fns[f"{sname} {cand.name}"] = md.MoELayer(qcfg, backend=cand.name).load_weights(qe).prepare()
        print(f"\n### {cname}: {fcfg.describe()}, quantized from the same float weights\n")
        names = list(fns)
        print("| T | " + " | ".join(names) + " | " + " | ".join(
            f"{s} default / bf16 default" for s in args.schemes.split(",")) + " | "
              + " | ".join(f"{s} default, % of the 1 GiB sum read" for s in args.schemes.split(",")) + " |")
        print("|" + " ---: |" * (1 + len(names) + 2 * len(qbytes)))
        for tokens in [int(t) for t in args.tokens.split(",")]:
            inputs = random_inputs(fcfg, tokens)
            reps = args.reps if tokens <= 128 else max(3, args.reps // 2)
            samples = time_rounds(fns, inputs, reps, warmup=1, seed=tokens)
            med = {n: statistics.median(v) for n, v in samples.items()}
            active = len(torch.unique(inputs[0][2]))
            ratios = [med[f"{s} default"] / med["bf16 default"] for s in qbytes]
            bw = [active * qbytes[s] / (med[f"{s} default"] / 1e3) / 1e9 / dram * 100 for s in qbytes]
            print(f"| {tokens} | " + " | ".join(f"{med[n]:.2f}" for n in names) + " | "
                  + " | ".join(f"{r:.2f}" for r in ratios) + " | " + " | ".join(f"{b:.0f}%" for b in bw)
                  + " |", flush=True)
        del zen
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
