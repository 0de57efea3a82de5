"""The demo: detect this CPU, explain the choice for a Qwen3-MoE-like layer, run it.

Run with ``python -m moe_dispatch.demo`` (the README's first command does).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import moe_dispatch as md
from moe_dispatch._doctor import backend_diagnostics
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import random_weights

# Qwen3-30B-A3B's MoE block: 128 experts, top-8, H=2048, I=768, SiLU, bf16.
QWEN3_MOE = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_dispatch.demo", description=__doc__)
    parser.add_argument("--tokens", type=_positive, default=16, help="tokens in the batch (default 16)")
    parser.add_argument("--small", action="store_true", help="a small layer (E=16, H=256, I=128)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    caps = md.Capabilities.detect()
    print("== this machine")
    print(f"cpu: {caps.cpu_vendor} {caps.cpu_model} (family {caps.cpu_family}, model "
          f"{caps.cpu_model_id}, Zen {caps.zen_generation or '-'}) arch {caps.arch}")
    flags = [f for f in ("avx2", "avx512", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_fp16")
             if getattr(caps, f)]
    print(f"isa: {', '.join(flags) or 'none of avx2/avx512/amx'}; threads {caps.threads}")
    print(f"torch {caps.torch_version}")
    print("backends (priority order):")
    for rec in md.get_registry().snapshot().records:
        print(f"  {rec.name} {rec.spec.version or ''}".rstrip())
        for label, text in backend_diagnostics(rec).items():
            print(f"    {label}: {text}")
    for failure in md.plugin_failures():
        print(f"plugin failed: {failure.plugin}: {failure.error}")

    shape = dict(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128) if args.small else QWEN3_MOE
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        worst = max(worst, _run(md.MoEConfig(**shape, dtype=dtype), args.tokens))
    return 0 if worst < 1.0 else 1


def _run(config: md.MoEConfig, tokens: int) -> float:
    """Explain, prepare and run one layer; returns its error over the tolerance (< 1 is OK)."""
    print(f"\n== explain (config stage): {config.describe()}")
    print(md.explain(config))
    weights = random_weights(config, seed=0)
    w13, w2 = weights["w13"], weights["w2"]
    g = torch.Generator().manual_seed(0)
    h = config.hidden_size
    t0 = time.perf_counter()
    layer = md.MoELayer(config).load_weights(w13, w2).prepare()
    print(f"\nprepared in {time.perf_counter() - t0:.2f} s (packing, self-checks and, under the "
          f"default policy={layer.policy!r}, the routing per token count measured or read from "
          "the tuning cache)")
    print(f"\n== explain (layer stage): {config.describe()}")
    print(layer.explain())
    worst = 0.0
    for t in sorted({1, tokens}):
        worst = max(worst, _forward(layer, config, weights, t, g))
    return worst


def _forward(layer: md.MoELayer, config: md.MoEConfig, weights: dict, tokens: int,
             g: torch.Generator) -> float:
    x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
    topk_weights, topk_ids = md.select_experts(torch.randn(tokens, config.num_experts, generator=g),
                                               config.top_k)
    layer(x, topk_weights, topk_ids)  # first call
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = layer(x, topk_weights, topk_ids)
        times.append(time.perf_counter() - t0)
    ref = moe_reference(config, x, weights["w13"], weights["w2"], topk_weights, topk_ids)
    err = float((out.double() - ref).norm() / ref.norm())
    tol = 1e-2 if config.dtype == torch.bfloat16 else 1e-5
    times.sort()
    plan = layer.plan
    route = plan.route_for(tokens).name if plan is not None else layer.backend
    print(f"\nforward of {tokens} token(s) on {route!r}: output {tuple(out.shape)} {out.dtype}, "
          f"median {times[2] * 1e3:.2f} ms over 5 calls")
    print(f"relative error against the float64 reference: {err:.2e} "
          f"({'OK' if err < tol else 'TOO LARGE'}; tolerance {tol:g})")
    print(f"first row, first 6 values: {[round(v, 4) for v in out[0, :6].float().tolist()]}")
    return err / tol


if __name__ == "__main__":
    raise SystemExit(main())
