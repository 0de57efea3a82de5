"""Where the framework's time goes at decode: MoELayer versus the raw kernel, step by step.

Usage:
    .venv/bin/python benchmarks/bench_overhead.py [--config C2] [--dtype bfloat16] [--pairs 1000]

At T=1 each candidate is timed in pairs with a baseline on the same prepared weights (the
raw zentorch op, or the backend's apply; the order inside a pair alternates; rows are
interleaved so the machine's drift hits all alike). Reported: the median of (candidate -
baseline) in microseconds and of candidate / baseline, each from two consecutive pairs run
in opposite orders (_timing.balanced). Rows, each adding one layer of the
real call path:

- raw (control): the op called again, as a user would (`torch.ops.zentorch.zentorch_fused_moe`);
- op + lock: the op through the backend's serialised call (the native module's mutex when it
  is loaded, else a Python lock);
- backend.apply (Python): the zentorch backend's Python call (its dtype, contiguity and
  duplicate-id checks, then the op);
- MoELayer: the layer as an engine calls it: on a plain call, its hooks check and then the
  backend's C++ entry (backends/zentorch/native.cpp), which does every check and the op call;
- MoELayer without the native entry: the path that runs where the C++ module cannot be
  built (except that here the op call still goes through the module's run_op; without the
  module it takes a Python lock instead);
- MoELayer's Python path (without __call__ and the native entry), over the raw op and over
  backend.apply (the framework alone);
- the layer called through torch's stock nn.Module.__call__, paired with the Python path
  (what MoELayer.__call__'s hook shortcut saves);
- and a layer that also checks the id range on the Python path (what a backend without
  BackendSpec.validates_ids gets), paired with the Python path, which skips it.

Then it times a fixed probe (ten tensor attribute reads and one empty_like) warm, right after
the op, and after a short sleep: the cold-cache cost every one of those paths pays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import moe_dispatch as md
from moe_dispatch._timing import balanced, time_pairs
from moe_dispatch.testing import random_inputs, random_weights

from bench_backends import raw_zentorch
from bench_perf import CONFIGS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="C2", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--pairs", type=int, default=1000, help="pairs per candidate")
    args = p.parse_args(argv)
    if args.pairs < 2:  # each ratio is balanced over two pairs (_timing.balanced)
        p.error(f"--pairs: at least 2, got {args.pairs}")
    config = md.MoEConfig(**CONFIGS[args.config], dtype=getattr(torch, args.dtype))
    # Forced to zentorch: under the default policy T=1 may route to another backend (the
    # native kernel on an AVX-512 Zen), and every row here is zentorch's call path.
    layer = md.MoELayer(config, backend="zentorch").load_weights(**random_weights(config)).prepare()
    if layer.backend != "zentorch":
        print(f"the layer runs {layer.backend!r}; this breakdown is for zentorch", file=sys.stderr)
        return 1
    import attrs
    from moe_dispatch_backends.zentorch import native as zentorch_native

    print(f"zentorch native path: {zentorch_native.status()}")
    rec, state = layer.plan.route.record, layer.plan.route.state
    raw = raw_zentorch(layer)

    def op_and_lock(x, tw, ids):
        out = torch.empty_like(x)
        state.call(out, x, state.w13, state.w2, None, None, tw, ids, False, state.act)
        return out

    apply = lambda x, tw, ids: rec.spec.backend.apply(state, x, tw, ids)  # noqa: E731
    # What MoELayer.__call__ saves: the same layer called through torch's own __call__.
    module_call = lambda x, tw, ids: torch.nn.Module.__call__(layer, x, tw, ids)  # noqa: E731
    # What BackendSpec.validates_ids saves: a second layer running the same plan with the
    # id range check on (never prepared itself, which is fine for valid inputs).
    checking = md.MoELayer(config)
    checking._plan = attrs.evolve(layer.plan, check_ids=True, natives=None)
    # The layer as it runs where the C++ module cannot be built: the same plan without
    # the native entry.
    no_entry = md.MoELayer(config)
    no_entry._plan = attrs.evolve(layer.plan, natives=None)
    # (label, candidate, baseline): each candidate is timed in pairs with its baseline.
    # The layer without its native entry: what runs where the C++ module cannot be built.
    python_path = layer._run_python  # what run(..., native=False) calls
    rows = [("raw op (control)", raw, raw), ("op + lock", op_and_lock, raw),
            ("backend.apply (Python)", apply, raw), ("MoELayer", layer, raw),
            ("MoELayer without the native entry", no_entry, raw),
            ("MoELayer's Python path (no __call__, no entry)", python_path, raw),
            ("MoELayer's Python path over backend.apply (the framework alone)", python_path, apply),
            ("stock nn.Module.__call__ over the Python path", module_call, python_path),
            ("the layer's id range check (validates_ids=False)", checking, python_path)]
    inputs = random_inputs(config, 1, pool=8, seed=99)
    timed = time_pairs([(fn, base) for _, fn, base in rows], inputs, args.pairs)
    # Each ratio and difference balanced over the two orders of a pair (_timing.balanced).
    per_row = [balanced(t_fn, t_base) for t_fn, t_base in timed]
    ratios = [r for r, _ in per_row]
    diffs = [[d * 1e6 for d in ds] for _, ds in per_row]
    base_ms = [b * 1e3 for b in timed[0][1]]
    print(f"{config.describe()}, T=1, {args.pairs} pairs per row; raw op median "
          f"{statistics.median(base_ms):.3f} ms")
    print()
    print("| path | baseline | extra us per call (median) | ratio (median) |")
    print("| --- | --- | ---: | ---: |")
    base_names = {id(raw): "raw op", id(apply): "backend.apply (Python)",
                  id(python_path): "Python path"}
    for (label, _, base), d, r in zip(rows, diffs, ratios):
        print(f"| {label} | {base_names[id(base)]} | "
              f"{statistics.median(d):.0f} | {statistics.median(r):.3f} |")
    cold_probe(raw, inputs)
    return 0


def cold_probe(raw, inputs: list, reps: int = 200) -> None:
    """Why a few lines of Python cost tens of microseconds here: the same ten tensor
    attribute reads and one empty_like, timed warm, right after the op, and after a sleep."""
    def probe(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> float:
        t0 = time.perf_counter_ns()
        x.shape, x.dtype, x.is_cpu, tw.shape, ids.shape, tw.dtype, ids.dtype, x._version
        ids.numel(), x.is_contiguous(), torch.empty_like(x)
        return (time.perf_counter_ns() - t0) / 1e3

    before = {"warm (right after the same probe)": probe,
              "right after the op": raw,
              "after a 3 ms sleep": lambda *a: time.sleep(0.003)}
    print()
    print("| ten attribute reads + one empty_like | us (median) |")
    print("| --- | ---: |")
    for label, fn in before.items():
        times = []
        for i in range(reps):
            args = inputs[i % len(inputs)]
            fn(*args)
            times.append(probe(*args))
        print(f"| {label} | {statistics.median(times):.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
