"""vLLM's real offline engine with and without the plugin, on tiny random checkpoints.

The engines run in ``.venv-vllm`` (vLLM's transformers pin is below the hf extra's), one
per subprocess, through :mod:`moe_dispatch.testing.vllm_engine`; ``scripts/setup-vllm.sh``
makes that environment and the README's test command runs it first. Elsewhere (no such
environment, or not x86_64 Linux) these tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moe_dispatch.testing.vllm_engine import call

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("MOE_DISPATCH_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# bf16 first-step logprobs: vLLM computes the logits in bf16 (steps of 1/64 near 1); the
# largest difference measured on these checkpoints (native kernel forced) was 0.053. Not
# compared in bf16: the torch loop forced, 0.77 off on one Mixtral prompt where HF's float64
# forward agrees with the fused kernels (its bf16 products are rounded to bf16 between the
# GEMMs, and two layers amplify that); its fp32 tokens are identical, so its data path is.
BF16_LOGPROB_ATOL = 0.1

if not PYTHON.exists():
    reason = ("vLLM's engine runs only on x86_64 Linux here" if
              (sys.platform, platform.machine()) != ("linux", "x86_64") else
              f"no vLLM environment at {PYTHON}: scripts/setup-vllm.sh makes it")
    pytestmark = pytest.mark.skip(reason=reason)

_rng = random.Random(1)
# Two short prompts (decode and a small prefill through the decode routes) and one of 300
# tokens (the prefill routes, which may differ from the decode ones).
PROMPTS = [[1, 5, 9, 33, 100, 7], [3, 3, 3, 900, 12, 4, 77, 8, 1, 2, 3, 4],
           [_rng.randrange(1024) for _ in range(300)]]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without conftest's MOE_DISPATCH_POLICY/BACKEND, plus extra."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOE_DISPATCH_POLICY", "MOE_DISPATCH_BACKEND")}
    return {**env, **extra}


def engine(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    return call(PYTHON, *args, env=environment(**(env or {})), cwd=ROOT, timeout=900)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp(request.param)
    engine("make", "--family", request.param, "--out", str(out))
    return str(out)


def run(model: str, dtype: str, prompts: list[list[int]] = PROMPTS,
        **env: str) -> tuple[dict[str, Any], str]:
    return engine("run", "--model", model, "--dtype", dtype, "--prompts", json.dumps(prompts),
                  "--max-tokens", "8", env=env)


def plugin_lines(log: str) -> list[str]:
    return [l for l in log.splitlines() if "moe-dispatch: E=" in l]


@pytest.fixture(scope="module")
def fp32(checkpoint: str) -> dict[str, tuple[dict[str, Any], str]]:
    return {"vllm": run(checkpoint, "float32", MOE_DISPATCH_VLLM="0"),
            "plugin": run(checkpoint, "float32"),
            "plugin, torch loop": run(checkpoint, "float32", MOE_DISPATCH_BACKEND="torch")}


def test_fp32_greedy_tokens_are_identical_with_the_plugin(fp32: dict) -> None:
    want = fp32["vllm"][0]["tokens"]
    for name in ("plugin", "plugin, torch loop"):
        assert fp32[name][0]["tokens"] == want, name


def test_the_plugin_logs_its_choice_once_per_shape_at_info(fp32: dict) -> None:
    lines = plugin_lines(fp32["plugin"][1])
    assert len(lines) == 1 and " INFO " in lines[0], lines  # two layers, one shape
    assert " -> " in lines[0] and "not used: " in lines[0]
    assert "[forced: torch]" in plugin_lines(fp32["plugin, torch loop"][1])[0]


def test_with_the_plugin_off_vllms_own_path_runs(fp32: dict) -> None:
    log = fp32["vllm"][1]
    assert not plugin_lines(log)
    assert "moe-dispatch: plugin off (MOE_DISPATCH_VLLM=0)" in log
    assert "Using CPUUnquantizedExperts MoE backend" in log


def close_logprobs(want: dict[str, Any], got: dict[str, Any]) -> None:
    for ref, new in zip(want["first_logprobs"], got["first_logprobs"], strict=True):
        shared = set(ref) & set(new)
        assert len(shared) >= 3, (ref, new)
        assert max(abs(ref[t] - new[t]) for t in shared) <= BF16_LOGPROB_ATOL, (ref, new)
        assert abs(max(ref.values()) - max(new.values())) <= BF16_LOGPROB_ATOL, (ref, new)


def test_bf16_first_step_logprobs_agree_with_vllms_own_path(checkpoint: str) -> None:
    # The first step is one prefill of all prompts together: with the default routes it
    # takes the prefill backend; a lone 3-token prompt takes the decode one (T=3), and the
    # forced native kernel runs every T.
    short = [[1, 5, 9]]
    want, _ = run(checkpoint, "bfloat16", MOE_DISPATCH_VLLM="0")
    want_short, _ = run(checkpoint, "bfloat16", prompts=short, MOE_DISPATCH_VLLM="0")
    got_short, log = run(checkpoint, "bfloat16", prompts=short)
    assert len(plugin_lines(log)) == 1
    close_logprobs(want_short, got_short)
    if "-> native" in plugin_lines(log)[0]:
        got, log = run(checkpoint, "bfloat16", MOE_DISPATCH_BACKEND="native")
        assert "[forced: native]" in plugin_lines(log)[0]
        close_logprobs(want, got)


def test_a_weight_update_reaches_the_plugins_layers(tmp_path: Path) -> None:
    # reload_weights writes the new values into the loaded parameters through .data (no
    # version counter moves) and does not run the experts' hook again: the plugin rebuilds
    # its layers from them. (vLLM 0.32's own CPU path, measured on a Zen 4 in fp32, went on
    # with the old experts: its tokens after the reload are a checkpoint's with B's other
    # weights and A's experts; docs/vllm.md.)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    engine("make", "--family", "qwen3_moe", "--out", a)
    engine("make", "--family", "qwen3_moe", "--out", b, "--seed", "1")
    want, _ = run(b, "float32", PROMPTS[:2], MOE_DISPATCH_VLLM="0")
    got, log = engine("run", "--model", a, "--dtype", "float32", "--prompts",
                      json.dumps(PROMPTS[:2]), "--max-tokens", "8", "--reload", b)
    assert len(plugin_lines(log)) == 1
    assert got["tokens"] != want["tokens"]  # the two checkpoints disagree
    assert got["tokens_after_reload"] == want["tokens"]


def test_the_example_runs_as_is() -> None:
    proc = subprocess.run([str(PYTHON), "examples/vllm_offline.py", "--tokens", "4"], cwd=ROOT,
                          env=environment(), capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "generated token ids: [" in proc.stdout
    assert len(plugin_lines(log)) == 1


def test_the_benchmarks_duel_holds_one_engine_of_each_side(tmp_path: Path) -> None:
    # bench_vllm's method: both engines alive in one driver, measured in alternation.
    engine("make", "--family", "qwen3_moe", "--out", str(tmp_path))
    res, log = engine("duel", "--model", str(tmp_path), "--dtype", "float32", "--prompts",
                      json.dumps(PROMPTS[:2]), "--decode", "2,6", "--batches", "1,2",
                      "--rounds", "2")
    assert len(plugin_lines(log)) == 1  # the plugin's engine, and only it, serves the layers
    assert "moe-dispatch: plugin off (MOE_DISPATCH_VLLM=0)" in log
    for measure in ("decode b=1", "decode b=2"):
        r = res[measure]
        assert len(r["vllm"]) == len(r["plugin"]) == 2 and min(r["vllm"] + r["plugin"]) > 0
        assert r["ratio"] > 0
    assert res["rss_gib"]["vllm"] > 0 and res["rss_gib"]["plugin"] > 0
