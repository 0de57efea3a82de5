"""HF transformers experts blocks: eager vs grouped_mm vs moe_dispatch, side by side.

Usage: .venv/bin/python benchmarks/bench_hf.py [--dtype bfloat16] [--reps 9]

Blocks: Qwen3-MoE-like (E=64, K=8, H=2048, I=768) and Mixtral-like (E=8, K=2, H=1024, I=1408),
each an HF experts module with random weights, called as the model calls it
(``experts(hidden_states, top_k_index, top_k_weights)``) with
``config._experts_implementation`` switched between calls (rounds in a shuffled order on
the same input, medians). A 128 MiB read before every call leaves the caches cold, as the
model's other layers leave them (and as bench_perf and the tuner time); ``--warm`` times
back-to-back calls instead, where a block whose active experts fit in the last-level cache
(Mixtral-like at T=1: 17 MB) is read from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import moe_dispatch as md
import moe_dispatch.hf as mdhf
from moe_dispatch._timing import CacheFlush, time_rounds

BLOCKS = {
    "qwen3_moe E=64 K=8 H=2048 I=768": lambda: transformers.Qwen3MoeConfig(
        hidden_size=2048, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8),
    "mixtral E=8 K=2 H=1024 I=1408": lambda: transformers.MixtralConfig(
        hidden_size=1024, intermediate_size=1408, num_local_experts=8, num_experts_per_tok=2),
}
IMPLS = ("eager", "grouped_mm", "moe_dispatch")


def experts_module(cfg, dtype):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    cls = Qwen3MoeExperts if cfg.model_type == "qwen3_moe" else MixtralExperts
    mod = cls(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--tokens", default="1,8,128,512")
    p.add_argument("--warm", action="store_true", help="no cache flush between calls")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    mdhf.register()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, machine {md.Capabilities.detect().fingerprint()}, "
          + ("warm caches" if args.warm else "cold caches (128 MiB read before every call)"))
    flush = None if args.warm else CacheFlush()
    for name, make in BLOCKS.items():
        cfg = make()
        mod = experts_module(cfg, dtype)
        cfg._experts_implementation = "moe_dispatch"
        t0 = time.perf_counter()
        layer = mdhf.layer_for(mod)
        table = layer.tuned_table or {}
        print(f"\n{name}: moe_dispatch's layer (policy={layer.policy!r}) built in "
              f"{time.perf_counter() - t0:.1f} s; routes: "
              + (", ".join(f"T<={t}: {n}" for t, n in table.items()) or layer.backend))
        print(f"| T | {' | '.join(IMPLS)} | moe_dispatch speedup vs faster HF |")
        print("|" + " ---: |" * (len(IMPLS) + 2))
        def run(impl: str, cfg=cfg, mod=mod):
            def call(*call_args):
                cfg._experts_implementation = impl
                return mod(*call_args)
            return call

        for tokens in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator().manual_seed(tokens)
            pool = []
            for _ in range(3):
                x = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
                w, ids = md.select_experts(torch.randn(tokens, mod.num_experts, generator=g),
                                           cfg.num_experts_per_tok)
                pool.append((x, ids.long(), w.to(dtype)))
            # Rounds in a shuffled order, every implementation on the same input (_bench).
            with torch.no_grad():
                samples = time_rounds({i: run(i) for i in IMPLS}, pool, args.reps, warmup=1,
                                      seed=tokens, between=flush)
            med = {i: statistics.median(v) for i, v in samples.items()}
            best_hf = min(med["eager"], med["grouped_mm"])
            print(f"| {tokens} | " + " | ".join(f"{med[i]:.2f}" for i in IMPLS)
                  + f" | {best_hf / med['moe_dispatch']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
