"""The native decode kernel against a plain read of its own bytes: what memory allows a call.

Usage:
    .venv/bin/python benchmarks/bench_ceiling.py [--config C1 C2] [--tokens 1,2,4,8]
                                                 [--formats bf16,int8,int4g128,int4g32] [--reps 21]

``bench_native.py`` sets the kernel against a 64 MiB read. A decode call reads far less: C1
(E=8 top-2 H=1024 I=1408) at T=1 reads 4.5 MB of int4 g128 weights, 3.0 MB of them in step 2
(w13) and 1.5 MB in step 4 (w2), about 1.5 and 0.7 MB per thread on two threads. This script
measures what such a call could take with no arithmetic and no fixed cost: the same number of bytes read with plain 64-byte loads by the kernel's own team
(``read_steps`` in read.h: one contiguous range per thread, a barrier between the w13
and the w2 bytes, timed inside the call), cold. In one process, shuffled rounds, a 128 MiB
read before every call, medians; per round the bytes are the round's distinct experts
times one expert's bytes of each projection (scales and zero points included), as in
``bench_native.py``. Printed per format and T:
- the forced native layer's ms per call (as an engine calls it: through MoELayer);
- the plain read of its bytes as steps 2 and 4 split them, and in one piece, ms;
- the layer over the split read (its cost above the memory's, per call);
- the 64 MiB read (``bench_perf.DramRead``) in GB/s, and the layer's and the split read's
  bandwidth on the active bytes as a share of it, median of each round's share.
The split read's share is about the most a kernel of these steps reaches at that point on
this machine (bf16 came within the runs' noise of it, 0.93-1.09x of its time at most points);
what a kernel loses beyond it is its own, not the memory's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush
from moe_dispatch.kernels import large_zeros
from moe_dispatch.testing import random_inputs
from moe_dispatch_backends.native import kernel

from bench_backends import CONFIGS, expert_weights
from bench_native import SCHEMES
from bench_perf import DramRead

FORMATS = ("bf16", *SCHEMES)


def _projection_bytes(shape: dict, fmt: str, w13: torch.Tensor, w2: torch.Tensor
                      ) -> tuple[md.MoELayer, float, float]:
    """The forced native layer (bf16 activations) and one expert's bytes of w13 and of w2."""
    if fmt == "bf16":
        cfg = md.MoEConfig(**shape, dtype=torch.bfloat16)
        layer = md.MoELayer(cfg, backend="native").load_weights(w13.bfloat16(), w2.bfloat16())
        per = cfg.hidden_size * cfg.intermediate_size * 2
        return layer.prepare(), 2 * per, per
    qcfg = md.MoEConfig(**shape, dtype=torch.bfloat16, weight_scheme=SCHEMES[fmt])
    qe = md.quantize_experts(w13, w2, SCHEMES[fmt])
    layer = md.MoELayer(qcfg, backend="native").load_weights(qe).prepare()
    return layer, qe.w13.nbytes / qcfg.num_experts, qe.w2.nbytes / qcfg.num_experts


def _lines(nbytes: float) -> int:
    return int(nbytes) // 64 * 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C1", "C2"], choices=sorted(CONFIGS))
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",")]
    for f in formats:
        if f not in FORMATS:
            p.error(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    caps = md.Capabilities.detect()
    isa, why = kernel.isa_for(caps)
    module = kernel.load(isa) if isa is not None else None
    if module is None:
        print(f"the native kernel does not run here: {why if isa is None else kernel.status(isa)}")
        return 1
    print(f"machine: {caps.fingerprint()}, {torch.get_num_threads()} threads, {why}\n")
    flush, dram = CacheFlush(), DramRead()
    rng = random.Random(0)
    print("| config | format | T | native ms | read as steps 2 and 4 ms | read in one piece ms | "
          "native over the split read | DRAM read GB/s | native: % of DRAM read | "
          "split read: % of DRAM read |")
    print("| --- | --- |" + " ---: |" * 8)
    for cname in args.config:
        cfg = md.MoEConfig(**CONFIGS[cname], dtype=torch.bfloat16)
        w13, w2 = expert_weights(CONFIGS[cname])
        layers = {f: _projection_bytes(CONFIGS[cname], f, w13, w2) for f in formats}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            inputs = random_inputs(cfg, tokens, pool=8, seed=tokens)
            active = [len(torch.unique(ids)) for _, _, ids in inputs]
            most = max(_lines(max(active) * (a + b)) for _, a, b in layers.values())
            buffer = large_zeros((most + 64,), torch.uint8)
            buffer.random_(0, 256)  # never time on zeros
            samples: dict[str, list[float]] = {}
            runs = [(f, kind) for f in formats for kind in ("native", "split", "whole")] + [("", "dram")]
            for f, (layer, _, _) in layers.items():  # warm up: the entry, the team
                layer(*inputs[0])
            for rep in range(args.reps):
                x, tw, ids = inputs[rep % len(inputs)]
                n = active[rep % len(inputs)]
                rng.shuffle(runs)
                for f, kind in runs:
                    flush()
                    if kind == "dram":
                        t0 = time.perf_counter()
                        dram()
                        ms = (time.perf_counter() - t0) * 1e3
                    elif kind == "native":
                        t0 = time.perf_counter()
                        layers[f][0](x, tw, ids)
                        ms = (time.perf_counter() - t0) * 1e3
                    else:
                        _, a, b = layers[f]
                        sizes = [_lines(n * a), _lines(n * b)] if kind == "split" else [_lines(n * (a + b))]
                        ms = module.read_steps(buffer, sizes)[0] * 1e3
                    samples.setdefault(f"{f} {kind}", []).append(ms)
            for f, (_, a, b) in layers.items():
                med = {k: statistics.median(samples[f"{f} {k}"]) for k in ("native", "split", "whole")}
                nbytes = [active[r % len(inputs)] * (a + b) for r in range(args.reps)]
                share = {k: dram.shares(samples[f"{f} {k}"], samples[" dram"], nbytes)
                         for k in ("native", "split")}
                ratio = statistics.median(n / s for n, s in zip(samples[f"{f} native"], samples[f"{f} split"]))
                gbs = dram.nbytes / statistics.median(samples[" dram"]) / 1e6
                print(f"| {cname} | {f} | {tokens} | {med['native']:.3f} | {med['split']:.3f} | "
                      f"{med['whole']:.3f} | {ratio:.2f}x | {gbs:.1f} | {share['native']:.0f}% | "
                      f"{share['split']:.0f}% |", flush=True)
            del buffer
        del layers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
