"""Time every accepting backend, and the raw kernels, side by side in one process.

Usage:
    .venv/bin/python benchmarks/bench_backends.py [--config C2 C1] [--dtype float32]
        [--tokens 1,8,128,512] [--reps 15] [--json out.json]

Configs: C1 = E=8, K=2, H=1024, I=1408; C2 = E=64, K=8, H=2048, I=768.

For each config and token count, every candidate is called in round-robin order (A, B, C,
A, B, C, ...) so that machine noise hits all of them alike; each call gets a fresh routing
drawn from a pool, and the medians are reported with ratios to the fastest. The "raw"
rows call the vendor op directly on the prepared weights with inputs already in the op's
form: the difference between "layer:X" and "raw:X" is the framework's overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

import moe_dispatch as md

CONFIGS = {
    "C1": dict(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=1408),
    "C2": dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768),
}


def _weights(config: md.MoEConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    w13 = (torch.randn(*config.w13_shape, generator=g) * (2 / h ** 0.5)).to(config.dtype)
    w2 = (torch.randn(*config.w2_shape, generator=g) / i ** 0.5).to(config.dtype)
    return w13, w2


def _inputs(config: md.MoEConfig, tokens: int, pool: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(pool):
        x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
        tw, ids = md.select_experts(torch.randn(tokens, config.num_experts, generator=g), config.top_k)
        out.append((x, tw, ids))
    return out


def candidates(config: md.MoEConfig, w13: torch.Tensor, w2: torch.Tensor
               ) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """name -> callable(x, tw, ids): each accepting backend through MoELayer, plus raw ops."""
    res = md.resolve(config)
    fns: dict[str, Callable] = {}
    for cand in res.candidates:
        if not cand.decision.accepted:
            continue
        try:
            layer = md.MoELayer(config, backend=cand.name).load_weights(w13, w2).prepare()
        except md.MoEDispatchError as exc:
            print(f"  {cand.name}: not benchmarked ({exc})", file=sys.stderr)
            continue
        label = f"layer:{cand.name}" + (" *" if cand.name == res.backend else "")
        fns[label] = layer
        if cand.name == "zentorch":
            state = layer._active[1]  # the prepared private weights

            def raw(x, tw, ids, _s=state):
                out = torch.empty_like(x)
                torch.ops.zentorch.zentorch_fused_moe(out, x, _s.w13, _s.w2, None, None, tw, ids,
                                                      False, _s.act)
                return out
            fns["raw:zentorch_fused_moe"] = raw
    return fns


def bench(fns: dict[str, Callable], inputs: list, reps: int, warmup: int = 2) -> dict[str, float]:
    names = list(fns)
    for name in names:
        for i in range(warmup):
            fns[name](*inputs[i % len(inputs)])
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        args = inputs[rep % len(inputs)]
        for name in names:  # round-robin: the same noise for everyone
            t0 = time.perf_counter()
            fns[name](*args)
            samples[name].append(time.perf_counter() - t0)
    return {n: statistics.median(v) * 1e3 for n, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C2", "C1"], choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", default="1,8,128,512")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    caps = md.Capabilities.detect()
    print(f"machine: {caps.fingerprint()} ({caps.cpu_model}), threads {torch.get_num_threads()}")
    results = []
    for cname in args.config:
        config = md.MoEConfig(**CONFIGS[cname], dtype=dtype)
        w13, w2 = _weights(config)
        t0 = time.perf_counter()
        fns = candidates(config, w13, w2)
        print(f"\n{cname}: {config.describe()}  (prepare all: {time.perf_counter() - t0:.1f} s; "
              "* = the resolver's choice)")
        print(f"{'T':>5}  {'candidate':<26} {'median ms':>10} {'x fastest':>10}")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            inputs = _inputs(config, tokens, pool=4)
            reps = max(5, args.reps if tokens <= 128 else args.reps // 2)
            med = bench(fns, inputs, reps)
            best = min(v for k, v in med.items() if k.startswith("layer:"))
            for name, ms in med.items():
                print(f"{tokens:>5}  {name:<26} {ms:>10.2f} {ms / best:>10.2f}")
                results.append(dict(config=cname, dtype=args.dtype, tokens=tokens, candidate=name,
                                    median_ms=ms, ratio_to_fastest=ms / best))
            layer_z = med.get("layer:zentorch *") or med.get("layer:zentorch")
            if layer_z and "raw:zentorch_fused_moe" in med:
                print(f"{'':>5}  overhead layer/raw zentorch: {layer_z / med['raw:zentorch_fused_moe']:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(machine=caps.fingerprint(), results=results), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
