"""vLLM's offline engine on the CPU, its MoE experts run by moe-dispatch.

    .venv-vllm/bin/python examples/vllm_offline.py [MODEL_DIR] [--dtype bfloat16]

With the plugin installed (``pip install "moe-dispatch[vllm]"``, or scripts/setup-vllm.sh)
nothing in this script names moe-dispatch: vLLM loads the plugin by entry point in every
process it starts, and the worker's log shows, once per MoE layer shape, a line such as

    INFO ... moe-dispatch: E=8 top_k=2 H=256 I=128 silu bfloat16 -> native (T=1..4),
    vllm (T>=5) [policy=auto]; not used: zentorch: bfloat16 needs AVX512-BF16, ...

``MOE_DISPATCH_VLLM=0`` runs vLLM's own MoE path instead. Without MODEL_DIR a tiny random
Qwen3-MoE checkpoint is written to a temporary directory (no download); its tokens are
meaningless, the point is the path they take.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="a checkpoint directory or hub id")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    from vllm import LLM, SamplingParams

    model = args.model
    if model is None:
        from moe_dispatch.testing.vllm_engine import make_checkpoint
        model = make_checkpoint("qwen3_moe", tempfile.mkdtemp(prefix="tiny-qwen3-moe-"),
                                dtype=args.dtype)
    llm = LLM(model=model, dtype=args.dtype, max_model_len=512, enforce_eager=True,
              skip_tokenizer_init=args.model is None)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    if args.model is None:
        out = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 100, 7]}], params)
        print("generated token ids:", list(out[0].outputs[0].token_ids))
    else:
        out = llm.generate(["The capital of France is"], params)
        print("generated:", out[0].outputs[0].text)


if __name__ == "__main__":  # vLLM's engine starts processes that import this file
    main()
