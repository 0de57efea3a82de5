"""The performance report: backends, policies, raw kernels, overhead, regret, ceilings.

Usage:
    .venv/bin/python benchmarks/bench_perf.py [--dtype float32] [--reps 11] [--config C2 C1]
        [--markdown out.md]

All timings are medians of rounds in one process: each round calls every candidate once,
in a shuffled order, on the same fresh routing, so the machine's noise hits every candidate
alike; a 128 MiB read before every call leaves the caches cold, as every other layer's
weights leave them in a model (and as the tuner times its candidates: timed warm, a layer
whose active experts fit in the last-level cache ranks kernels by a state no model run
sees). Per grid point it reports:
- every accepting built-in backend through MoELayer (forced);
- the raw zentorch op and the raw vLLM kernel on the forced layers' prepared weights;
- the layer with policy="auto" (the default, tuned fresh at prepare()), policy="priority"
  (the resolver's choice) and policy="fastest" (every bucket measured);
- regret: each policy's time over the fastest candidate's (backends and raw kernels), as
  the median of per-round ratios;
- the overhead at T=1 of every forced layer whose vendor kernel has a raw column: the layer
  over the raw kernel, median of 1000 interleaved pairs (each ratio balanced over a pair
  run in each order, _timing.balanced);
- the noise floor: a second layer forced to the priority choice (same kernel, same weights,
  other buffers) over the first, the same paired way: regrets within it are noise;
- decode bandwidth (active expert bytes / time) and prefill GFLOP/s against this machine's
  ceilings measured in the same run (a large matmul, a large tensor read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import moe_dispatch as md
from moe_dispatch._timing import CacheFlush, balanced, paired_ratio, time_pairs, time_rounds
from moe_dispatch.kernels import large_zeros
from moe_dispatch.testing import random_inputs, random_weights

from bench_backends import raw_kernels

CONFIGS = {
    "C2": dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768),
    "C1": dict(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=1408),
}
TOKENS = (1, 8, 128, 512)
BUILTINS = ("zentorch", "native", "vllm", "amx_grouped", "onednn", "torch")
RAW_OF = {"zentorch": "raw:zentorch op", "vllm": "raw:vllm kernel"}


def ceilings(dtype: torch.dtype) -> dict[str, float]:
    # 2048^3, unless the dtype's GEMM is emulated here (bf16 without AVX512-BF16: one 2048^3
    # product takes about a minute on a Zen 1 / Zen 3), then 512^3.
    a, b = torch.randn(512, 512).to(dtype), torch.randn(512, 512).to(dtype)
    t0 = time.perf_counter()
    a @ b
    n = 2048 if time.perf_counter() - t0 < 0.05 else 512
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        a @ b
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    gflops = 2 * n ** 3 / statistics.median(ts) / 1e9
    return {"matmul_gflops": gflops, "matmul_n": n, "read_gbs": read_gbs()}


def read_gbs() -> float:
    """GB/s of a 1 GiB fp32 ``torch.sum`` (median of 5): the run's DRAM read reference."""
    big = torch.randn(256 * 1024 * 1024 // 4)  # 1 GiB fp32
    big.sum()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(ts) / 1e9


class DramRead:
    """A candidate of the timed rounds that reads 64 MiB of fp32 (``torch.sum``), in huge
    pages where the backends' weights get them (``large_zeros``), ignoring its arguments.

    Why in the rounds: this VM's read speed moves 10-20% between runs and within one (a
    1 GiB read at the start of a run gave 27.7 GB/s while the kernels then streamed 45), so
    a share of "the DRAM read" is only a measurement when the read runs cold in the same
    rounds as the kernel, and each round's kernel is set against that round's read
    (:meth:`shares`). ``torch.sum`` reads as fast as a hand-written loop here: one process,
    64 MiB, cold, 21 rounds on a Zen 4, 34.1 GB/s against 34.2-34.7 for AVX2 loads with and
    without software prefetch, one or two streams per thread."""

    nbytes = 64 << 20

    def __init__(self) -> None:
        self._buffer = large_zeros((self.nbytes // 4,), torch.float32)
        self._buffer.uniform_(-1.0, 1.0)  # never time on zeros

    def __call__(self, *_args: object) -> None:
        self._buffer.sum()

    def one_thread(self, *_args: object) -> None:
        """The same read on one thread. Why: this VM's two vCPUs sometimes read at one
        core's speed together (2 threads ~= 1 thread, 30-34 GB/s on a Zen 4) and sometimes
        at two cores' (55-60 GB/s), and a kernel's share of the read depends on which."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._buffer.sum()
        finally:
            torch.set_num_threads(threads)

    def shares(self, kernel_ms: list[float], read_ms: list[float], kernel_bytes: list[float]) -> float:
        """Median over rounds of the kernel's bytes per second over the read's, in %."""
        return statistics.median(b / k / (self.nbytes / r) * 100
                                 for k, r, b in zip(kernel_ms, read_ms, kernel_bytes))


def overhead(layer: md.MoELayer, raw, config: md.MoEConfig, pairs: int = 1000) -> float:
    """Median over interleaved pairs of (layer time / raw time) at T=1 (_timing.time_pairs),
    each ratio balanced over the two orders of a pair (_timing.balanced)."""
    [(t_layer, t_raw)] = time_pairs([(layer, raw)], random_inputs(config, 1, pool=8, seed=99), pairs)
    return statistics.median(balanced(t_layer, t_raw)[0])


def reps_for(tokens: int, reps: int) -> int:
    """More rounds where calls are cheap: small T is where noise matters most."""
    return reps * 4 if tokens <= 8 else reps * 2 if tokens <= 128 else reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--markdown", help="also write the tables here")
    p.add_argument("--config", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    caps = md.Capabilities.detect()
    ceil = ceilings(dtype)
    lines = [f"machine: {caps.fingerprint()} ({caps.cpu_model}), {torch.get_num_threads()} threads, {args.dtype}",
             f"ceilings measured in this run: {args.dtype} {ceil['matmul_n']}^3 matmul {ceil['matmul_gflops']:.3g} GFLOP/s; "
             f"1 GiB fp32 read {ceil['read_gbs']:.1f} GB/s", ""]
    flush = CacheFlush()
    for cname in args.config:
        config = md.MoEConfig(**CONFIGS[cname], dtype=dtype)
        w = random_weights(config)
        res = md.resolve(config)
        backends = [c.name for c in res.candidates if c.decision.accepted and c.name in BUILTINS]
        t0 = time.perf_counter()
        fns = {b: md.MoELayer(config, backend=b).load_weights(**w).prepare() for b in backends}
        raws = raw_kernels(fns)
        fns.update(raws)
        others = [n for n in md.available_backends() if n not in BUILTINS]
        t1 = time.perf_counter()
        fns["policy=auto"] = md.MoELayer(config, policy="auto", exclude=others,
                                         tuning_cache=False).load_weights(**w).prepare()
        auto_s = time.perf_counter() - t1
        fns["policy=priority"] = md.MoELayer(config, policy="priority").load_weights(**w).prepare()
        fns["policy=fastest"] = md.MoELayer(config, policy="fastest", exclude=others,
                                            tuning_cache=False).load_weights(**w).prepare()
        # The noise floor: a second layer forced to the priority choice. It runs the same
        # kernel on the same weights as that backend's column, in other buffers.
        control = f"{res.backend} (2nd layer)"
        fns[control] = md.MoELayer(config, backend=res.backend).load_weights(**w).prepare()
        print(f"{cname} prepared in {time.perf_counter() - t0:.1f} s (tuning included)", file=sys.stderr)
        lines.append(f"### {cname}: {config.describe()}")
        lines.append("")
        for policy in ("auto", "fastest"):
            table = fns[f"policy={policy}"].tuned_table or {}
            lines.append(f"policy={policy} table: " + ", ".join(f"T<={t}: {n}" for t, n in table.items()))
            lines.append("")
        lines.append(f"priority choice: `{res.backend}`; policy=auto's prepare(): {auto_s:.1f} s "
                     "(tuning from nothing)")
        lines.append("")
        head = (["T"] + list(fns) + ["fastest candidate", "regret auto", "regret priority",
                                    "regret fastest", "noise floor", "decode GB/s", "GFLOP/s"])
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " ---: |" * len(head))
        bytes_per_expert = 3 * config.hidden_size * config.intermediate_size * w["w13"].element_size()
        for tokens in TOKENS:
            samples = time_rounds(dict(fns), random_inputs(config, tokens), reps_for(tokens, args.reps),
                                  seed=tokens, between=flush)
            med = {n: statistics.median(v) for n, v in samples.items()}
            best = min(backends + list(raws), key=lambda b: med[b])
            regrets = [paired_ratio(samples, f"policy={p}", best) for p in ("auto", "priority", "fastest")]
            floor = paired_ratio(samples, control, res.backend)
            _, ids = random_inputs(config, tokens, pool=1)[0][1:]
            active = len(torch.unique(ids))
            auto_ms = med["policy=auto"]
            gbs = active * bytes_per_expert / (auto_ms / 1e3) / 1e9
            gflops = 2 * tokens * config.top_k * 3 * config.hidden_size * config.intermediate_size / (auto_ms / 1e3) / 1e9
            row = ([str(tokens)] + [f"{med[n]:.2f}" for n in fns]
                   + [best] + [f"{r:.3f}" for r in regrets] + [f"{floor:.3f}", f"{gbs:.1f}", f"{gflops:.0f}"])
            lines.append("| " + " | ".join(row) + " |")
            print(f"  {cname} T={tokens} done", file=sys.stderr)
        lines.append("")
        # The same layer's own prepared weights: copies at other addresses differ by a few
        # percent on their own (measured), which is not framework overhead.
        for name, raw in RAW_OF.items():
            if name in fns:
                ov = overhead(fns[name], raws[raw], config)
                lines.append(f"overhead at T=1 (median of 1000 interleaved pairs, balanced over both orders, MoELayer forced to "
                             f"{name} / {raw}): **{ov:.3f}**")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
