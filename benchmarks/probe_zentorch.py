"""Probe the raw zentorch fused MoE op against the float64 reference, one shape per process.

Usage: .venv/bin/python benchmarks/probe_zentorch.py [--dtype bfloat16 float32]

This is how the zentorch backend's gates were measured: each (dtype, shape) runs in a fresh
subprocess (a segfault is reported, not fatal), calls the op directly on contiguous weights
(no moe-dispatch in the way), and prints the relative error against moe_reference, "CRASH"
with the signal, or the op's error. Re-run it when zentorch, torch or the CPU changes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SHAPES = [(8, 2, 128, 64), (8, 2, 512, 256), (8, 2, 256, 768), (8, 2, 1024, 256),
          (8, 2, 1024, 1408), (64, 8, 2048, 768)]

CHILD = r"""
import torch, zentorch, moe_dispatch as md
from moe_dispatch.reference import moe_reference
E, K, H, I = {shape}
dtype = getattr(torch, {dtype!r})
cfg = md.MoEConfig(E, K, H, I, dtype=dtype)
g = torch.Generator().manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, generator=g) * (2 / H ** 0.5)).to(dtype)
w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
x = torch.randn(16, H, generator=g).to(dtype)
tw, ids = md.select_experts(torch.randn(16, E, generator=g), K)
ref = moe_reference(cfg, x, w13.clone(), w2.clone(), tw, ids)
out = torch.empty_like(x)
torch.ops.zentorch.zentorch_fused_moe(out, x, w13, w2, None, None, tw, ids, False, "silu")
print("relerr %.3g" % float((out.double() - ref).norm() / ref.norm()))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args(argv)
    import moe_dispatch as md
    print(f"machine: {md.Capabilities.detect().fingerprint()}")
    for dtype in args.dtype:
        for shape in SHAPES:
            proc = subprocess.run([sys.executable, "-c", CHILD.format(shape=shape, dtype=dtype)],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode < 0:
                result = f"CRASH (signal {-proc.returncode})"
            elif proc.returncode:
                result = "error: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
            else:
                result = proc.stdout.strip().splitlines()[-1]
            print(f"{dtype:<9} E={shape[0]:<3} K={shape[1]} H={shape[2]:<5} I={shape[3]:<5} {result}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
