"""Prepacked weights in 4 KiB pages against transparent huge pages, side by side.

Usage:
    .venv/bin/python benchmarks/bench_pages.py [--config C2 C1] [--tokens 1,8] [--reps 40]

Per config and dtype, in one process: every backend that keeps its prepacked weights in
the toolkit's ``large_zeros`` (the native kernel for bf16 and int8; vLLM's kernel for bf16
and fp32) is prepared twice with ``MOE_DISPATCH_HUGE_PAGES=0`` (torch's own memory, 4 KiB
pages under the usual ``madvise`` mode) and twice with huge pages, from the same weights.
Shuffled rounds, a fresh routing per round from a pool of 8, a 128 MiB read between calls
(cold caches, as in a model); medians. "2M over 4K" is the median over rounds of the
4 KiB copy's time over the huge-page copy's (> 1: huge pages faster); "4K copies" and
"2M copies" are the same ratio between the two copies of one kind: the noise floor.
Also: a 150 MiB fp32 ``sum`` in each kind of memory (GB/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush, paired_ratio, time_rounds
from moe_dispatch.kernels import huge_pages_used, large_copy, thp_mode
from moe_dispatch.testing import random_inputs

from bench_backends import CONFIGS, expert_weights

SWITCH_HUGE_PAGES = "MOE_DISPATCH_HUGE_PAGES"
CASES = (("bfloat16", None, "native"), ("bfloat16", None, "vllm"), ("float32", None, "vllm"),
         ("bfloat16", md.QuantScheme("int8"), "native"))


def _layer(cfg: md.MoEConfig, backend: str, weights: dict, huge: bool) -> md.MoELayer:
    os.environ[SWITCH_HUGE_PAGES] = "1" if huge else "0"
    try:
        layer = md.MoELayer(cfg, backend=backend)
        return (layer.load_weights(weights["q"]) if "q" in weights else layer.load_weights(**weights)).prepare()
    finally:
        del os.environ[SWITCH_HUGE_PAGES]


def read_speeds(mib: int = 150, reps: int = 40) -> dict[str, float]:
    small = torch.randn(mib * 2 ** 20 // 4)
    huge = large_copy(small)
    ts: dict[str, list[float]] = {"4K": [], "2M": []}
    for _ in range(reps):
        for name, t in (("4K", small), ("2M", huge)) if time.perf_counter_ns() % 2 else (("2M", huge), ("4K", small)):
            t0 = time.perf_counter()
            t.sum()
            ts[name].append(time.perf_counter() - t0)
    return {n: small.numel() * 4 / statistics.median(v) / 1e9 for n, v in ts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C2", "C1"], choices=sorted(CONFIGS))
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    if not huge_pages_used():
        print(f"transparent huge pages: {thp_mode()}; nothing to compare")
        return 0
    reads = read_speeds()
    print(f"machine: {md.Capabilities.detect().fingerprint()}, {torch.get_num_threads()} threads; "
          f"transparent huge pages: {thp_mode()}; 150 MiB fp32 sum: {reads['4K']:.1f} GB/s in 4 KiB "
          f"pages, {reads['2M']:.1f} GB/s in huge pages\n")
    print("| config | weights | backend | T | 4K ms | 2M ms | 2M over 4K | 4K copies | 2M copies |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    flush = CacheFlush()
    for cname in args.config:
        for dtype_name, scheme, backend in CASES:
            cfg = md.MoEConfig(**CONFIGS[cname], dtype=getattr(torch, dtype_name), weight_scheme=scheme)
            res = md.resolve(cfg)
            if not any(c.name == backend and c.decision.accepted for c in res.candidates):
                continue
            w13, w2 = expert_weights(CONFIGS[cname], cfg.dtype)
            w = ({"w13": w13, "w2": w2} if scheme is None
                 else {"q": md.quantize_experts(w13.float(), w2.float(), scheme)})
            fns = {f"{kind}#{i}": _layer(cfg, backend, w, kind == "2M") for i in range(2) for kind in ("4K", "2M")}
            for tokens in [int(t) for t in args.tokens.split(",")]:
                inputs = random_inputs(cfg, tokens, pool=8, seed=tokens)
                s = time_rounds(fns, inputs, args.reps, seed=tokens, between=flush)
                # pool each kind's two copies round by round (their mean): one figure per kind
                s["4K"] = [(a + b) / 2 for a, b in zip(s["4K#0"], s["4K#1"])]
                s["2M"] = [(a + b) / 2 for a, b in zip(s["2M#0"], s["2M#1"])]
                weights = dtype_name if scheme is None else f"{scheme.describe()}"
                print(f"| {cname} | {weights} | {backend} | {tokens} | {statistics.median(s['4K']):.3f} | "
                      f"{statistics.median(s['2M']):.3f} | {paired_ratio(s, '4K', '2M'):.3f} | "
                      f"{paired_ratio(s, '4K#1', '4K#0'):.3f} | {paired_ratio(s, '2M#1', '2M#0'):.3f} |",
                      flush=True)
            del fns
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
