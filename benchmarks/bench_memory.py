"""Peak memory of MoELayer.prepare() per backend, each in a fresh process.

Usage: .venv/bin/python benchmarks/bench_memory.py [--config C2] [--dtype float32]
       [--scheme int8|int4g128]   (quantized experts; multiples of the bf16 weight bytes)

Rows: "default", the layer as a user gets it (``policy="auto"``, tuned at ``prepare()``
from nothing, only its routes' states kept), then each accepting backend forced.

Reports, in MiB and as a multiple of the layer's weight bytes, measured from
/proc/self/status (Linux only):
- kept: resident memory added by prepare() while the caller keeps its weights (the layer
  keeps references to them for the fallback, keep_canonical=True);
- peak: the high-water mark during prepare() (transient copies included);
- owned: the layer built with keep_canonical=False and the caller's tensors deleted: the
  memory the layer holds above the baseline taken before the weights existed;
- warm owned: the same, with the baseline taken after a small layer of the same scheme and
  backend (E=4 H=256 I=128, tuned and called once, then dropped) ran in the process, so that
  what a process pays once (a kernel's code, the libraries' state set up by the first calls
  of the tuning's candidates) is not counted as the layer's.
Before each reading the child calls glibc's ``malloc_trim(0)``, so that memory freed by the
layer's transient buffers counts as freed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

CHILD = r"""
import gc, json, sys, torch
import moe_dispatch as md
sys.path.insert(0, {bench_dir!r})
from bench_backends import CONFIGS, expert_weights

try:  # give freed heap memory back to the OS, so RSS counts what is held, not what the
    import ctypes  # allocator keeps cached (glibc keeps freed chunks below its mmap threshold)
    _trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _trim = lambda _pad: 0

def status(key):
    gc.collect()
    _trim(0)
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
SCHEMES = dict(int8=md.QuantScheme("int8"), int4g128=md.QuantScheme("int4", group_size=128))
scheme = SCHEMES.get({scheme!r})
config = md.MoEConfig(**CONFIGS[{config!r}], dtype=getattr(torch, {dtype!r}), weight_scheme=scheme)
md.resolve(config)  # import the plugins before any baseline
if {mode!r} == "warm":  # a small layer of the same kind first: the process's one-time costs
    import attrs
    small = attrs.evolve(config, num_experts=4, hidden_size=256, intermediate_size=128,
                         top_k=min(2, config.top_k))
    s13, s2 = torch.randn(small.w13_shape) * 0.05, torch.randn(small.w2_shape) * 0.05
    sargs = (s13.to(small.dtype), s2.to(small.dtype)) if scheme is None else (md.quantize_experts(s13, s2, scheme),)
    tiny = md.MoELayer(small, backend={backend!r}, keep_canonical=False, tuning_cache=False)
    tiny.load_weights(*sargs).prepare()
    tiny(*md.testing.random_routing(small, 4, seed=0))
    del tiny, sargs, s13, s2
gc.collect()
empty = status("VmRSS")
if scheme is None:
    w13, w2 = expert_weights(CONFIGS[{config!r}], config.dtype)
    nbytes = w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
    args = (w13, w2)
else:  # quantized from float32 weights; the float ones are dropped before the baseline
    f13, f2 = expert_weights(CONFIGS[{config!r}])
    nbytes = (f13.numel() + f2.numel()) * 2  # the bf16 weights' bytes: the targets' unit
    w13, w2 = md.quantize_experts(f13, f2, scheme), None
    del f13, f2
    args = (w13,)
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:  # reset the peak (VmHWM) to the current RSS
    fh.write("5")
if {mode!r} == "kept":
    layer = md.MoELayer(config, backend={backend!r}, tuning_cache=False).load_weights(*args).prepare()
    gc.collect()
    print(json.dumps(dict(weight_bytes=nbytes, kept=status("VmRSS") - base, peak=status("VmHWM") - base)))
else:  # owned / warm: a fresh process, so no other layer's zentorch cache entries are counted
    layer = md.MoELayer(config, backend={backend!r}, keep_canonical=False,
                        tuning_cache=False).load_weights(*args).prepare()
    del w13, w2, args
    gc.collect()
    print(json.dumps({{{mode!r}: status("VmRSS") - empty}}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="C2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backends", default=None, help="comma list, \"default\" for the default layer (default: it and every accepting backend)")
    p.add_argument("--scheme", default=None, choices=["int8", "int4g128"],
                   help="quantized experts (bf16 activations); figures are multiples of the bf16 weight bytes")
    args = p.parse_args(argv)
    import torch
    import moe_dispatch as md
    from bench_backends import CONFIGS
    scheme = {"int8": md.QuantScheme("int8"), "int4g128": md.QuantScheme("int4", group_size=128)}.get(args.scheme)
    config = md.MoEConfig(**CONFIGS[args.config], dtype=getattr(torch, args.dtype), weight_scheme=scheme)
    names = args.backends.split(",") if args.backends else ["default"] + [
        c.name for c in md.resolve(config, max_weight_copies=math.inf).candidates if c.decision.accepted]
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    print(f"{args.config} {config.describe()}")
    print(f"{'backend':<10} {'weights MiB':>12} {'kept MiB':>10} {'kept/w':>7} {'peak MiB':>10} "
          f"{'peak/w':>7} {'owned MiB':>10} {'owned/w':>8} {'warm MiB':>9} {'warm/w':>7}")
    for name in names:
        r: dict = {}
        for mode in ("kept", "owned", "warm"):
            code = CHILD.format(bench_dir=bench_dir, config=args.config, dtype=args.dtype,
                                backend=None if name == "default" else name, mode=mode,
                                scheme=args.scheme)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
            if line is None:
                print(f"{name:<10} {mode} failed: {out.stderr.strip().splitlines()[-1:]}")
                break
            r.update(json.loads(line))
        else:
            mib = 1 << 20
            w = r["weight_bytes"]
            print(f"{name:<10} {w / mib:>12.0f} {r['kept'] / mib:>10.0f} {r['kept'] / w:>7.2f} "
                  f"{r['peak'] / mib:>10.0f} {r['peak'] / w:>7.2f} {r['owned'] / mib:>10.0f} "
                  f"{r['owned'] / w:>8.2f} {r['warm'] / mib:>9.0f} {r['warm'] / w:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
