"""vLLM's offline engine end to end: decode (and prefill) throughput with the moe-dispatch
plugin against vLLM's own CPU MoE path, on the same random checkpoints.

Usage: .venv/bin/python benchmarks/bench_vllm.py [--models tiny,c2] [--dtypes bfloat16,float32]
       [--rounds 4] [--engines 2] [--decode 8,72]

Needs .venv-vllm (scripts/setup-vllm.sh). Each engine is its own process (vLLM's engine
owns process-wide state): for each model and dtype the two sides start alternately,
vllm, plugin, plugin, vllm, ... (``--engines`` of each), each measuring every rate
``--rounds`` times; a side's figure is the median over all its rounds. Decode rate: batch b
of 8-token prompts, tokens/s from the difference between generating 8 and 72 tokens (``--decode``)
(prefill cancels out). Prefill rate: one 512-token prompt, 1 token generated.

Models (random weights, vocab 1024, 2 layers, made with transformers' save_pretrained):
tiny = Qwen3-MoE E=8 K=2 H=256 I=128; c2 = Qwen3-MoE E=64 K=8 H=2048 I=768.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--engines", type=int, default=2, help="engine processes per side")
    p.add_argument("--decode", default="8,72", help="A,B: decode rate from generating A and B tokens")
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
                runs: dict[str, list[dict]] = {"vllm": [], "plugin": []}
                order = ["vllm", "plugin", "plugin", "vllm"] * args.engines
                for side in order[:2 * args.engines]:
                    res, log = engine(
                        ["run", "--model", ckpt, "--dtype", dtype, "--prompts", prompts,
                         "--max-tokens", "2", "--decode", args.decode,
                         "--batches", ",".join(map(str, BATCHES)), "--prefill", str(PREFILL),
                         "--rounds", str(args.rounds)],
                        {"MOE_DISPATCH_VLLM": "0" if side == "vllm" else "1"})
                    if side == "plugin":
                        res["choice"] = [l.split("moe-dispatch: ", 1)[1].split("; not used")[0]
                                         for l in log.splitlines() if "moe-dispatch: E=" in l]
                    runs[side].append(res)
                    print(f"  {model} {dtype} {side}: up {res['up_s']:.0f} s", flush=True)
                rows.append((model, dtype, runs))
    print(f"\n{'model':5} {'dtype':9} {'measure':10} {'vLLM own':>10} {'plugin':>10} "
          f"{'plugin/vLLM':>11}")
    for model, dtype, runs in rows:
        measures = [(f"decode b={b}", lambda r, b=b: r["decode_tok_s"][str(b)]["rounds"])
                    for b in BATCHES] + [(f"prefill {PREFILL}", lambda r: r["prefill_tok_s"]["rounds"])]
        for label, get in measures:
            med = {side: statistics.median([x for r in runs[side] for x in get(r)])
                   for side in runs}
            print(f"{model:5} {dtype:9} {label:12} {med['vllm']:8.1f} {med['plugin']:10.1f} "
                  f"{med['plugin'] / med['vllm']:11.3f}")
        rss = {side: statistics.median(r.get("rss_gib", float("nan")) for r in runs[side])
               for side in runs}
        print(f"{model:5} {dtype:9} {'RSS GiB':12} {rss['vllm']:8.2f} {rss['plugin']:10.2f} "
              f"{rss['plugin'] / rss['vllm']:11.3f}")
        print(f"      plugin's routes: {runs['plugin'][0].get('choice')}")
    print("(tokens/s, medians over every round of every engine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
