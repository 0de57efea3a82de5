"""Time every accepting backend, the raw vendor kernels and the default layer side by side.

Usage:
    .venv/bin/python benchmarks/bench_backends.py [--config C2 C1] [--dtype float32]
        [--tokens 1,8,128,512] [--reps 15]

Configs: C1 = E=8, K=2, H=1024, I=1408; C2 = E=64, K=8, H=2048, I=768.

Candidates are called in rounds (each round calls every candidate once, in a shuffled
order) so machine noise hits all of them alike, each call with a routing drawn from a pool;
medians and ratios to the fastest candidate of the row are printed. The candidates:
- "layer:NAME": a MoELayer forced to each accepting backend (* marks the resolver's choice);
- "raw:zentorch op" / "raw:vllm kernel": the vendor's op called directly on the prepared
  weights with inputs already in its form (no checks, no lock): a layer over it is the
  framework's overhead;
- "default": ``MoELayer(config)`` as a user gets it (policy="auto", tuned fresh at prepare();
  its table is printed).
(benchmarks/bench_perf.py is the full report: policies, regret, ceilings.)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import moe_dispatch as md
from moe_dispatch._bench import prepared_layers
from moe_dispatch._timing import time_side_by_side
from moe_dispatch.testing import random_inputs, random_weights

CONFIGS = {
    "C1": dict(num_experts=8, top_k=2, hidden_size=1024, intermediate_size=1408),
    "C2": dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768),
}


def expert_weights(shape: dict, dtype: torch.dtype = torch.float32, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 and w2 of a CONFIGS shape in ``dtype``, fresh random values (never zeros); most
    benchmarks make each weight format from the float32 pair (a bf16 cast, quantize_experts)."""
    w = random_weights(md.MoEConfig(**shape, dtype=dtype), seed)
    return w["w13"], w["w2"]


def raw_zentorch(layer: md.MoELayer):
    """The op itself on the layer's prepared private weights."""
    state = layer.plan.route.state
    op = torch.ops.zentorch.zentorch_fused_moe

    def run(x, tw, ids):
        out = torch.empty_like(x)
        op(out, x, state.w13, state.w2, None, None, tw, ids, False, state.act)
        return out
    return run


def raw_vllm(layer: md.MoELayer):
    """vLLM's kernel itself on the layer's prepacked private weights."""
    state = layer.plan.route.state
    op = torch.ops._C.cpu_fused_moe

    def run(x, tw, ids):
        out = torch.empty_like(x)
        op(out, x, state.w13, state.w2, None, None, tw, ids, False, state.act, state.isa)
        return out
    return run


def raw_kernels(layers: dict[str, md.MoELayer]) -> dict:
    """The raw vendor kernels on the forced layers' prepared weights."""
    fns = {}
    if "zentorch" in layers:
        fns["raw:zentorch op"] = raw_zentorch(layers["zentorch"])
    if "vllm" in layers:
        fns["raw:vllm kernel"] = raw_vllm(layers["vllm"])
    return fns


def direct_apply(layer: md.MoELayer):
    """The chosen backend's apply on the layer's prepared state, without the layer: the
    kernel called directly, for backends that have no single vendor op (torch, oneDNN)."""
    rec, state = layer.plan.route.record, layer.plan.route.state
    apply = rec.spec.backend.apply

    def run(x, tw, ids):
        return apply(state, x, tw, ids)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["C2", "C1"], choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", default="1,8,128,512")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"machine: {md.Capabilities.detect().fingerprint()}, threads {torch.get_num_threads()}")
    for cname in args.config:
        config = md.MoEConfig(**CONFIGS[cname], dtype=dtype)
        chosen = md.resolve(config).backend
        w = random_weights(config)
        t0 = time.perf_counter()
        layers = prepared_layers(config, w, log=sys.stderr)
        fns = {f"layer:{n}" + (" *" if n == chosen else ""): layer for n, layer in layers.items()}
        fns.update(raw_kernels(layers))
        t1 = time.perf_counter()
        default = md.MoELayer(config, tuning_cache=False).load_weights(**w).prepare()
        fns["default"] = default
        print(f"\n{cname}: {config.describe()}  (prepare all forced: {t1 - t0:.1f} s; the default's "
              f"prepare(): {time.perf_counter() - t1:.1f} s; * = the resolver's choice)")
        print("default table: " + ", ".join(f"T<={t}: {n}" for t, n in (default.tuned_table or {}).items()))
        print(f"{'T':>5}  {'candidate':<26} {'median ms':>10} {'x fastest':>10}")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            reps = max(5, args.reps if tokens <= 128 else args.reps // 2)
            med = time_side_by_side(fns, random_inputs(config, tokens), reps)
            best = min(v for k, v in med.items() if k != "default")
            for name, ms in med.items():
                print(f"{tokens:>5}  {name:<26} {ms:>10.2f} {ms / best:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
