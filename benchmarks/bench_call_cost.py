"""The native kernel's fixed cost per call, and the rate at which it streams weights.

Usage:
    .venv/bin/python benchmarks/bench_call_cost.py [--sizes 384,768,1408,2816] [--reps 41]

Decode time is a fixed cost per call plus the active weight bytes over the streaming rate,
and on a small layer the fixed cost decides how much int8 / int4 gain over bf16 (E=8 top-2
H=1024 I=1408 at T=1 reads 17 MB of bf16 weights: 0.5 ms at 34 GB/s, against a fixed cost
of about 0.05 ms). In one process, on cold caches (a 128 MiB read before every call, as
benchmarks/bench_native.py does), shuffled rounds, medians:

1. the forced native layer at T=1, E=8 top-2 H=1024, for each intermediate size and weight
   format (bf16, int8 per channel, int4 g128); a straight line through (active bytes, ms)
   per format: its intercept is the fixed cost, its slope the streaming rate;
2. on a layer too small to stream (E=8 top-2 H=I=128, int8), the call path step by step: the
   layer as an engine calls it (int32 ids and float32 weights, through MoELayer's C call
   slot and through the Python ``__call__``; int64 ids and bf16 weights, which the native
   entry converts; the same converted by ``.to()`` in the caller first),
   ``layer.run``, the native entry alone; two controls (a
   Python function that returns None, and ``torch.empty_like``); and three checks alone,
   each in a Python function like the no-op: torch's is_compiling(), the cheaper form
   MoELayer.__call__ reads, and the tracing check the layer leaves to its entries.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush, time_rounds
from moe_dispatch.testing import random_inputs

from bench_backends import expert_weights

FORMATS = {"bf16": None, "int8": md.QuantScheme("int8"), "int4 g128": md.QuantScheme("int4", group_size=128)}


class _PythonCall(md.MoELayer):
    """MoELayer as it is, called through the Python __call__: the C call slot
    (moe_dispatch/_call_slot.cpp) is MoELayer's own, and a subclass's calls take __call__."""


def _layer(hidden: int, inter: int, scheme: md.QuantScheme | None,
           cls: type[md.MoELayer] = md.MoELayer) -> tuple[md.MoELayer, float]:
    """A forced native layer (E=8, top-2) and the bytes of one expert's weights."""
    cfg = md.MoEConfig(8, 2, hidden, inter, dtype=torch.bfloat16, weight_scheme=scheme)
    w13, w2 = expert_weights(dict(num_experts=8, top_k=2, hidden_size=hidden, intermediate_size=inter))
    layer = cls(cfg, backend="native")
    if scheme is None:
        return layer.load_weights(w13.bfloat16(), w2.bfloat16()).prepare(), 3 * hidden * inter * 2
    qe = md.quantize_experts(w13, w2, scheme)
    return layer.load_weights(qe).prepare(), qe.nbytes / cfg.num_experts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="384,768,1408,2816", help="intermediate sizes (multiples of 128)")
    p.add_argument("--reps", type=int, default=41)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"machine: {md.Capabilities.detect().fingerprint()}, {torch.get_num_threads()} threads\n")
    flush = CacheFlush()
    fns, active = {}, {}
    for fname, scheme in FORMATS.items():
        for inter in sizes:
            layer, per_expert = _layer(1024, inter, scheme)
            fns[f"{fname} I={inter}"], active[f"{fname} I={inter}"] = layer, per_expert
    inputs = random_inputs(next(iter(fns.values())).config, 1, pool=8, seed=1)
    experts = statistics.fmean(len(torch.unique(ids)) for _, _, ids in inputs)
    med = {n: statistics.median(v) for n, v in time_rounds(fns, inputs, args.reps, between=flush).items()}
    print("| format | " + " | ".join(f"I={i} ms" for i in sizes) + " | fixed us | GB/s |")
    print("| --- |" + " ---: |" * (len(sizes) + 2))
    for fname in FORMATS:
        names = [f"{fname} I={i}" for i in sizes]
        slope, fixed = statistics.linear_regression([experts * active[n] / 1e6 for n in names],
                                                    [med[n] for n in names])
        print(f"| {fname} | " + " | ".join(f"{med[n]:.3f}" for n in names)
              + f" | {fixed * 1e3:.0f} | {1 / slope:.1f} |")

    layer, _ = _layer(128, 128, FORMATS["int8"])
    python_call, _ = _layer(128, 128, FORMATS["int8"], _PythonCall)
    entry = layer.plan.native
    flag = torch.compiler.is_dynamo_compiling
    tiny = random_inputs(layer.config, 1, pool=8, seed=2)
    # The routing as torch.topk and HF give it (int64 ids, bf16 weights), looked up by the
    # round's ids in both rows that use it: passed as it is (the entry converts it), and
    # converted first in Python, as moe_dispatch.hf did before the entry took it.
    given = {id(ids): (tw.bfloat16(), ids.long()) for _, tw, ids in tiny}
    f32, i32 = torch.float32, torch.int32
    steps = {"layer(x, tw, ids)": layer,
             "layer(x, tw, ids), the Python __call__ (no call slot)": python_call,
             "layer, int64 ids and bf16 weights as given": lambda x, tw, ids: layer(x, *given[id(ids)]),
             "layer, int64 ids and bf16 weights, .to() each first":
                 lambda x, tw, ids: layer(x, given[id(ids)][0].to(f32), given[id(ids)][1].to(i32)),
             "layer.run": layer.run, "native entry": entry,
             "control: Python no-op": lambda x, tw, ids: None,
             "control: torch.empty_like": lambda x, tw, ids: torch.empty_like(x),
             "check: torch.compiler.is_compiling()": lambda x, tw, ids: torch.compiler.is_compiling(),
             "check: is_dynamo_compiling() or the flag (MoELayer.__call__)":
                 lambda x, tw, ids: flag() or torch.compiler._is_compiling_flag,
             "check: torch._C._get_tracing_state() (left to the entries)":
                 lambda x, tw, ids: torch._C._get_tracing_state()}
    med = {n: statistics.median(v) for n, v in
           time_rounds(steps, tiny, 5 * args.reps, between=flush).items()}
    print(f"\nE=8 top-2 H=I=128 int8, T=1, cold: the call path\n\n| path | us (median) |\n| --- | ---: |")
    for name, ms in med.items():
        print(f"| {name} | {ms * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
