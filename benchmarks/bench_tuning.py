"""What policy="fastest" costs at prepare(): time, and the table it picks.

Usage:
    .venv/bin/python benchmarks/bench_tuning.py [--config C2] [--dtype bfloat16]

Prepares the same layer three times in one process: with policy="priority", with
policy="fastest" and no tuning cache (every candidate prepared and timed; the INFO progress
lines of the `moe_dispatch` logger are shown), and with policy="fastest" reading the cache the
second run wrote (a temporary file). Prints the wall time of each prepare() and the table.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

import moe_dispatch as md
from moe_dispatch.testing import random_weights

from bench_perf import BUILTINS, CONFIGS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="C2", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, format="  [log] %(message)s")
    logging.getLogger("moe_dispatch").setLevel(logging.INFO)
    config = md.MoEConfig(**CONFIGS[args.config], dtype=getattr(torch, args.dtype))
    weights = random_weights(config)
    exclude = [n for n in md.available_backends() if n not in BUILTINS]
    print(f"{config.describe()}; candidates: "
          f"{[c.name for c in md.resolve(config, exclude=exclude).candidates if c.decision.accepted]}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "tuning.json"
        runs = [("policy=priority", dict(policy="priority")),
                ("policy=fastest, no cache", dict(policy="fastest", tuning_cache=False)),
                ("policy=fastest, tuning", dict(policy="fastest", tuning_cache=cache)),
                ("policy=fastest, cache hit", dict(policy="fastest", tuning_cache=cache))]
        for label, kw in runs:
            t0 = time.perf_counter()
            layer = md.MoELayer(config, exclude=exclude, **kw).load_weights(**weights).prepare()
            seconds = time.perf_counter() - t0
            table = layer.tuned_table
            print(f"{label}: prepare() {seconds:.1f} s; "
                  + (", ".join(f"T<={t}: {n}" for t, n in table.items()) if table else f"runs {layer.backend}"))
            del layer
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
