"""vLLM's offline engine end to end: decode (and prefill) throughput with the moe-dispatch
plugin against vLLM's own CPU MoE path, on the same random checkpoints.

Usage: .venv/bin/python benchmarks/bench_vllm.py [--models tiny,c2] [--dtypes bfloat16,float32]
       [--rounds 8] [--decode 8,72] [--json out.json]

Needs .venv-vllm (scripts/setup-vllm.sh). For each model and dtype, one driver process holds
both engines at once (``python -m moe_dispatch.testing.vllm_engine duel``: vLLM's own path
and the plugin, each its own engine process) and measures them in alternation, a shuffled
order per round, ``--rounds`` rounds: two engines measured minutes apart differ by up to a
third on this kind of machine, two measured back to back do not. The ratio is the median
over rounds of the plugin's rate over vLLM's in the same round. Decode rate: batch b of
8-token prompts, tokens/s from the difference between generating 8 and 72 tokens
(``--decode``; prefill cancels out). Prefill rate: one 512-token prompt, 1 token generated.
RSS: what each engine's processes added to the driver's resident memory.

Models (random weights, vocab 1024, 2 layers, made with transformers' save_pretrained):
tiny = Qwen3-MoE E=8 K=2 H=256 I=128; c2 = Qwen3-MoE E=64 K=8 H=2048 I=768.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from moe_dispatch.testing.vllm_engine import call

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("MOE_DISPATCH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODELS = {
    "tiny": ["--experts", "8", "--top-k", "2", "--hidden", "256", "--inter", "128"],
    "c2": ["--experts", "64", "--top-k", "8", "--hidden", "2048", "--inter", "768"],
}
BATCHES = (1, 8)
PREFILL = 512


def engine(args: list[str], env: dict[str, str]) -> tuple[dict, str]:
    try:
        return call(PYTHON, *args, env={**os.environ, **env}, cwd=ROOT)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,c2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--decode", default="8,72", help="A,B: decode rate from generating A and B tokens")
    p.add_argument("--json", help="also write every round's rates here")
    args = p.parse_args(argv)
    if not PYTHON.exists():
        raise SystemExit(f"no vLLM environment at {PYTHON}: run scripts/setup-vllm.sh")
    prompts = json.dumps([[(13 * b + 5 * i) % 1000 + 1 for i in range(8)] for b in range(8)])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                ckpt = str(Path(tmp) / f"{model}-{dtype}")
                engine(["make", "--family", "qwen3_moe", "--out", ckpt, "--dtype", dtype,
                        *MODELS[model]], {})
                res, log = engine(["duel", "--model", ckpt, "--dtype", dtype, "--prompts", prompts,
                                   "--decode", args.decode, "--batches", ",".join(map(str, BATCHES)),
                                   "--prefill", str(PREFILL), "--rounds", str(args.rounds)], {})
                routes = sorted({l.split("moe-dispatch: ", 1)[1].split("; not used")[0]
                                 for l in log.splitlines() if "moe-dispatch: E=" in l})
                rows.append((model, dtype, res, routes))
                print(f"  {model} {dtype} done", flush=True)
    print(f"\n{'model':5} {'dtype':9} {'measure':12} {'vLLM own':>10} {'plugin':>10} "
          f"{'plugin/vLLM':>11}")
    for model, dtype, res, routes in rows:
        for label, r in res.items():
            if label == "rss_gib":
                continue
            print(f"{model:5} {dtype:9} {label:12} {r['medians']['vllm']:10.1f} "
                  f"{r['medians']['plugin']:10.1f} {r['ratio']:11.3f}")
        rss = res["rss_gib"]
        print(f"{model:5} {dtype:9} {'RSS GiB':12} {rss['vllm']:10.2f} {rss['plugin']:10.2f} "
              f"{rss['plugin'] / rss['vllm']:11.3f}")
        print(f"      plugin's routes: {routes}")
    print("(tokens/s: medians over rounds; plugin/vLLM: median over rounds of the paired ratio)")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(model=m, dtype=d, result=r, routes=rt)
                                               for m, d, r, rt in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
