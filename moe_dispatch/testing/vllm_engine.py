"""Drive vLLM's offline engine on tiny random MoE checkpoints, with or without the plugin.

Runs inside an environment that has vLLM (``.venv-vllm``); the tests and the benchmark call
it as a subprocess, one engine per process (vLLM's engine spawns its own processes and owns
the process-wide state the plugin wraps), and read one JSON line back:

    python -m moe_dispatch.testing.vllm_engine make --family qwen3_moe --out DIR
    python -m moe_dispatch.testing.vllm_engine run --model DIR --dtype float32 \\
        --prompts '[[1, 5, 9]]' --max-tokens 8 [--decode 8,40 --batches 1,8 --prefill 512]

``run`` prints ``MOE_DISPATCH_RESULT {...}`` last: per prompt the greedy tokens and the
first step's top logprobs; with ``--decode A,B`` the decode rate per batch size, tokens per
second from the difference between generating A and B tokens (prefill cancels out); with
``--prefill N`` the prefill rate of one N-token prompt.
``MOE_DISPATCH_VLLM=0`` in the environment runs vLLM's own MoE path.

    python -m moe_dispatch.testing.vllm_engine duel --model DIR --dtype bfloat16 \
        --prompts '[[...], ...]' --decode 8,40 --batches 1,8 --prefill 512 --rounds 8

``duel`` holds two engines at once, vLLM's own path and the plugin (each its own spawned
engine process, the plugin switched by the environment each inherits), and measures them
in alternation, a shuffled order per round: a pair of rates minutes apart on this kind of
machine differs by up to a third, a pair measured back to back does not. It reports each
side's rates and the median over rounds of the plugin's rate over vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT = "MOE_DISPATCH_RESULT "
FAMILIES = ("qwen3_moe", "mixtral")


def call(python: str | Path, *args: str, env: dict[str, str] | None = None,
         cwd: str | Path | None = None, timeout: float | None = None) -> tuple[dict[str, Any], str]:
    """Run this module under ``python`` (the vLLM environment's) as a subprocess: its
    ``MOE_DISPATCH_RESULT`` and the whole log; RuntimeError with the log's tail if it fails."""
    proc = subprocess.run([str(python), "-m", "moe_dispatch.testing.vllm_engine", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine failed (rc {proc.returncode}):\n{log[-6000:]}")
    return json.loads(lines[-1][len(RESULT):]), log


def make_checkpoint(family: str, out: str, *, experts: int = 8, top_k: int = 2,
                    hidden: int = 256, inter: int = 128, layers: int = 2, vocab: int = 1024,
                    seed: int = 0, dtype: str = "bfloat16") -> str:
    """A random checkpoint of ``family`` saved with transformers' ``save_pretrained``."""
    import torch
    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  max_position_embeddings=1024, tie_word_embeddings=False,
                  num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(**common, intermediate_size=2 * inter, head_dim=64,
                                moe_intermediate_size=inter, num_experts=experts,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(config)
    elif family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        config = MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts,
                               head_dim=64)
        model = MixtralForCausalLM(config)
    else:
        raise ValueError(f"family={family!r}; expected one of {', '.join(FAMILIES)}")
    with torch.no_grad():
        # Wider than the init's 0.02, and a sharp lm_head: near-uniform logits would make
        # greedy decoding a coin toss between near-ties, and the comparisons meaningless.
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.06)
        model.lm_head.weight.normal_(0.0, 0.3)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


def _timed(llm: Any, prompts: list[dict[str, Any]], tokens: int) -> float:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _engine(model: str, dtype: str) -> Any:
    from vllm import LLM
    return LLM(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=1024,
               enforce_eager=True, seed=0)


def run_engine(model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
               logprobs: int = 5, decode: tuple[int, int] | None = None,
               batches: tuple[int, ...] = (), prefill: int = 0,
               rounds: int = 3, reload: str | None = None) -> dict[str, Any]:
    """One engine: greedy generation of every prompt; with ``reload=path`` the same again
    after ``reload_weights`` from that checkpoint; with ``decode=(A, B)`` the decode rate
    of the first b prompts for each b in ``batches`` (default: all of them); with
    ``prefill=N`` the prefill rate of one N-token prompt. Rates are medians of ``rounds``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes all RAM
    from vllm import SamplingParams
    start = time.perf_counter()
    llm = _engine(model, dtype)
    up_s = time.perf_counter() - start
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs,
                            ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False)
    result: dict[str, Any] = {
        "up_s": up_s,
        "plugin": os.environ.get("MOE_DISPATCH_VLLM", "1"),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "first_logprobs": [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}
                           for o in outputs],
    }
    if reload:  # vLLM's in-place weight update from another checkpoint, then the same prompts
        llm.collective_rpc("reload_weights", kwargs={"weights_path": reload})
        outputs = llm.generate(batch, params, use_tqdm=False)
        result["tokens_after_reload"] = [list(o.outputs[0].token_ids) for o in outputs]
    result["rss_gib"] = _rss_gib()  # the engine's processes
    if decode is not None:
        short, long = decode
        result["decode_tok_s"] = {}
        for b in batches or (len(batch),):
            rates = []
            for _ in range(rounds):
                t_short = _timed(llm, batch[:b], short)
                t_long = _timed(llm, batch[:b], long)
                rates.append(b * (long - short) / (t_long - t_short))
            result["decode_tok_s"][str(b)] = {"median": statistics.median(rates),
                                              "rounds": rates}
    if prefill:
        ids = [(7 * i + 3) % 1000 + 1 for i in range(prefill)]
        rates = [prefill / _timed(llm, [{"prompt_token_ids": ids}], 1) for _ in range(rounds)]
        result["prefill_tok_s"] = {"median": statistics.median(rates), "rounds": rates}
    return result


def duel(model: str, dtype: str, prompts: list[list[int]], decode: tuple[int, int],
         batches: tuple[int, ...], prefill: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """vLLM's own path and the plugin side by side in one driver (see the module text)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # spawn, not fork: a forked engine process would inherit this driver's plugin state
    # (vLLM loads plugins once per process), not the switch set for its side.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    engines, rss = {}, {}
    for side, switch in (("vllm", "0"), ("plugin", "1")):
        os.environ["MOE_DISPATCH_VLLM"] = switch
        before = _rss_gib()
        engines[side] = _engine(model, dtype)
        rss[side] = _rss_gib() - before  # what this engine's processes hold
    batch = [{"prompt_token_ids": p} for p in prompts]
    short, long = decode
    measures: dict[str, Any] = {
        f"decode b={b}": lambda llm, b=b: b * (long - short) / (
            _timed(llm, batch[:b], long) - _timed(llm, batch[:b], short)) for b in batches}
    if prefill:
        ids = [{"prompt_token_ids": [(7 * i + 3) % 1000 + 1 for i in range(prefill)]}]
        measures[f"prefill {prefill}"] = lambda llm: prefill / _timed(llm, ids, 1)
    rng = random.Random(seed)
    rates: dict[str, dict[str, list[float]]] = {m: {"vllm": [], "plugin": []} for m in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            for side in rng.sample(sorted(engines), 2):
                rates[name][side].append(measure(engines[side]))
    out: dict[str, Any] = {
        name: {**r, "ratio": statistics.median(p / v for p, v in zip(r["plugin"], r["vllm"])),
               "medians": {s: statistics.median(x) for s, x in r.items()}}
        for name, r in rates.items()}
    out["rss_gib"] = rss
    return out


def _rss_gib() -> float:
    """Resident memory of this process and its children (vLLM depends on psutil)."""
    import psutil
    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2 ** 30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_dispatch.testing.vllm_engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    make = sub.add_parser("make", help="write a random checkpoint")
    make.add_argument("--family", choices=FAMILIES, required=True)
    make.add_argument("--out", required=True)
    for name, default in (("experts", 8), ("top-k", 2), ("hidden", 256), ("inter", 128),
                          ("layers", 2), ("vocab", 1024), ("seed", 0)):
        make.add_argument(f"--{name}", type=int, default=default)
    make.add_argument("--dtype", default="bfloat16")
    run = sub.add_parser("run", help="run vLLM's offline engine")
    run.add_argument("--model", required=True)
    run.add_argument("--dtype", default="bfloat16")
    run.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    run.add_argument("--max-tokens", type=int, default=8)
    run.add_argument("--logprobs", type=int, default=5)
    run.add_argument("--decode", help="A,B: decode rate from generating A and B tokens")
    run.add_argument("--batches", default="", help="B1,B2: decode batch sizes (first Bi prompts)")
    run.add_argument("--prefill", type=int, default=0, help="N: prefill rate of an N-token prompt")
    run.add_argument("--rounds", type=int, default=3)
    run.add_argument("--reload", help="a checkpoint to reload the weights from, then generate")
    both = sub.add_parser("duel", help="vLLM's own path and the plugin, two engines alternating")
    for name in ("--model", "--prompts", "--decode"):
        both.add_argument(name, required=True)
    both.add_argument("--dtype", default="bfloat16")
    both.add_argument("--batches", default="1,8")
    both.add_argument("--prefill", type=int, default=0)
    both.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.cmd == "make":
        make_checkpoint(args.family, args.out, experts=args.experts, top_k=args.top_k,
                        hidden=args.hidden, inter=args.inter, layers=args.layers,
                        vocab=args.vocab, seed=args.seed, dtype=args.dtype)
        print(RESULT + json.dumps({"out": args.out}), flush=True)
        return 0
    decode = tuple(int(x) for x in args.decode.split(",")) if args.decode else None
    if args.cmd == "duel":
        print(RESULT + json.dumps(duel(args.model, args.dtype, json.loads(args.prompts), decode,
                                       tuple(int(x) for x in args.batches.split(",")),
                                       args.prefill, args.rounds)), flush=True)
        return 0
    batches = tuple(int(x) for x in args.batches.split(",")) if args.batches else ()
    result = run_engine(args.model, args.dtype, json.loads(args.prompts), args.max_tokens,
                        args.logprobs, decode, batches,  # type: ignore[arg-type]
                        args.prefill, args.rounds, args.reload)
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
