"""The moe-dispatch CLI and Hugging Face config ingestion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_dispatch as md
from moe_dispatch import hf_config
from moe_dispatch.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("name,family,shape", [
    ("mixtral", "mixtral", (8, 2, 4096, 14336)),
    ("qwen2_moe", "qwen2_moe", (60, 4, 2048, 1408)),
    ("qwen3_moe", "qwen3_moe", (128, 8, 2048, 768)),
    ("deepseek_v2", "deepseek_v2", (64, 6, 2048, 1408)),
    ("deepseek_v3", "deepseek_v3", (256, 8, 7168, 2048)),
    ("gpt_oss", "gpt_oss", (32, 4, 2880, 2880)),
    ("llama4", "llama4", (16, 1, 5120, 8192)),
    ("olmoe", "olmoe", (64, 8, 2048, 1024)),
])
def test_families_parse(name, family, shape):
    model = hf_config.load(FIXTURES / f"{name}.json")
    c = model.config
    assert model.family == family
    assert (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size) == shape
    assert c.dtype == torch.bfloat16 and model.moe_layers


def test_family_specifics():
    v3 = hf_config.load(FIXTURES / "deepseek_v3.json")
    assert v3.routing == hf_config.Routing("sigmoid", True, 8, 4, 2.5, True)
    assert v3.moe_layers[0] == 3 and len(v3.moe_layers) == 58 and v3.shared_experts.count == 1
    v2 = hf_config.load(FIXTURES / "deepseek_v2.json")
    assert v2.routing.scoring == "softmax" and v2.routing.num_expert_group is None
    oss = hf_config.load(FIXTURES / "gpt_oss.json")
    assert oss.config.activation is md.Activation.SWIGLUOAI and oss.config.has_bias
    l4 = hf_config.load(FIXTURES / "llama4.json")
    assert l4.config.apply_router_weight_on_input and l4.routing.scoring == "sigmoid"
    assert not l4.routing.renormalize
    q2 = hf_config.load(FIXTURES / "qwen2_moe.json")
    assert q2.shared_experts is not None and not q2.routing.renormalize
    assert hf_config.load(FIXTURES / "qwen3_moe.json").routing.renormalize
    assert not hf_config.load(FIXTURES / "olmoe.json").routing.renormalize
    # The routing parameters drive select_experts directly.
    w, ids = md.select_experts(torch.randn(3, 256), 8, **v3.routing.select_kwargs())
    assert ids.shape == (3, 8)


def test_errors_name_the_key_or_family(tmp_path):
    with pytest.raises(hf_config.HFConfigError, match="'num_local_experts'"):
        hf_config.load(FIXTURES / "mixtral_missing_key.json")
    with pytest.raises(hf_config.HFConfigError, match="model_type 'llama' is not supported"):
        hf_config.load(FIXTURES / "unsupported_llama.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(hf_config.HFConfigError, match="not valid JSON"):
        hf_config.load(bad)
    with pytest.raises(hf_config.HFConfigError, match="cannot read"):
        hf_config.load(tmp_path / "absent.json")
    with pytest.raises(hf_config.HFConfigError, match="swiglu_limit=5.0"):
        hf_config.load({**json.loads((FIXTURES / "gpt_oss.json").read_text()), "swiglu_limit": 5.0})
    with pytest.raises(hf_config.HFConfigError, match="hidden_act 'relu'"):
        hf_config.load({**json.loads((FIXTURES / "olmoe.json").read_text()), "hidden_act": "relu"})


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "CPU" in out and "torch" in out and "backends (priority order)" in out
    assert "MOE_DISPATCH_DISABLE" in out and "MOE_DISPATCH_HUGE_PAGES" in out
    assert f"transparent huge pages: {md.kernels.thp_mode()}" in out
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["huge_pages"] == {"mode": md.kernels.thp_mode(), "used": md.kernels.huge_pages_used()}
    names = [b["name"] for b in data["backends"]]
    assert names == md.available_backends() and "torch" in names
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["onednn"]["ops"]["mkldnn::_linear_pointwise"] == "ok"
    for b in data["backends"]:  # every backend's own lines, whoever wrote it
        for label, text in b["diagnostics"].items():
            assert f"{label}: {text}" in out
        for var in b["env_vars"]:
            assert var in data["env_vars"] and var in out
    zen = by_name.get("zentorch", {}).get("diagnostics", {})
    if "C++ decode entry" in zen:  # built / not built yet / off / in use / unavailable: never a build
        assert zen["C++ decode entry"].split()[0] in ("built", "not", "off", "in", "unavailable:")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                                  "gpt_oss", "llama4", "olmoe"])
def test_explain_hf_config_matches_resolve(name, capsys):
    assert main(["explain", "--hf-config", str(FIXTURES / f"{name}.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = hf_config.load(FIXTURES / f"{name}.json")
    assert len(data) == 1 and data[0]["family"] == model.family
    assert data[0]["backend"] == md.resolve(model.config).backend
    assert main(["explain", "--hf-config", str(FIXTURES / f"{name}.json")]) == 0
    assert "=> " in capsys.readouterr().out


def test_explain_flags_text(capsys):
    rc = main(["explain", "--experts", "64", "--top-k", "8", "--hidden", "2048", "--intermediate",
               "768", "--dtype", "float32", "--activation", "gelu_tanh"])
    out = capsys.readouterr().out
    assert rc == 0 and "gelu_tanh" in out and "=> " in out and "rejected" in out


@pytest.mark.parametrize("argv", [
    ["explain", "--experts", "8"],
    ["explain", "--experts", "0", "--top-k", "1", "--hidden", "8", "--intermediate", "8"],
    ["explain", "--experts", "4", "--top-k", "5", "--hidden", "8", "--intermediate", "8"],
    ["explain", "--activation", "relu"],
    ["bench", "--experts", "4", "--top-k", "1", "--hidden", "8", "--intermediate", "8", "--tokens", "1,x"],
    ["frobnicate"],
    [],
])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


def test_unreadable_or_unsupported_file_exits_1(tmp_path, capsys):
    assert main(["explain", "--hf-config", str(tmp_path / "nope.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["explain", "--hf-config", str(FIXTURES / "unsupported_llama.json")]) == 1
    assert "not supported" in capsys.readouterr().err
    assert main(["explain", "--hf-config", str(FIXTURES / "mixtral_missing_key.json")]) == 1
    assert "num_local_experts" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_exits_1(tmp_path, capsys):
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(hf_config.HFConfigError, match="is not UTF-8 text"):
        hf_config.load(binary)
    assert main(["explain", "--hf-config", str(binary)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-dispatch: ") and str(binary) in err and "UTF-8" in err


@pytest.mark.parametrize("tokens", ["0", "-2", "x"])
def test_demo_tokens_must_be_positive(tokens, capsys):
    from moe_dispatch.demo import main as demo
    with pytest.raises(SystemExit) as err:
        demo(["--small", "--tokens", tokens])
    assert err.value.code == 2
    assert f"argument --tokens: expected a positive int, got '{tokens}'" in capsys.readouterr().err


def test_forced_rejected_backend_exits_1(capsys):
    rc = main(["explain", "--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "32",
               "--backend", "amx_grouped"] + (["--dtype", "float32"]))
    assert rc == 1 and "amx_grouped" in capsys.readouterr().err


def test_bench_json_and_plot(tmp_path, capsys):
    png = tmp_path / "bench.png"
    rc = main(["bench", "--experts", "4", "--top-k", "2", "--hidden", "32", "--intermediate", "16",
               "--dtype", "float32", "--tokens", "1,4", "--reps", "2", "--json", "--plot", str(png)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = data[0]["rows"]
    assert {r["tokens"] for r in rows} == {1, 4}
    assert sum(r["chosen"] for r in rows) == 2  # one chosen backend per token count
    assert min(r["ratio"] for r in rows) == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_bench_exclude_and_backend(capsys):
    """--exclude is applied before timing (names normalised), and the chosen mark is the
    config-stage choice of a layer with the same --backend/--exclude."""
    flags = ["bench", "--experts", "4", "--top-k", "2", "--hidden", "32", "--intermediate", "16",
             "--dtype", "float32", "--tokens", "1", "--reps", "1", "--json"]
    assert main(flags + ["--exclude", "OneDNN"]) == 0
    rows = json.loads(capsys.readouterr().out)[0]["rows"]
    assert "onednn" not in {r["backend"] for r in rows}
    chosen = md.resolve(md.MoEConfig(4, 2, 32, 16, dtype="float32"), exclude=["onednn"]).backend
    assert [r["backend"] for r in rows if r["chosen"]] == [chosen]
    assert main(flags + ["--backend", "torch"]) == 0
    rows = json.loads(capsys.readouterr().out)[0]["rows"]
    assert [(r["backend"], r["chosen"]) for r in rows] == [("torch", True)]


def test_bench_says_what_its_mark_is(capsys):
    """The * is the config-stage (priority) choice, which a default policy="auto" layer may
    not run at a given T: the legend says so rather than "what a layer runs"."""
    assert main(["bench", "--experts", "4", "--top-k", "2", "--hidden", "32", "--intermediate",
                 "16", "--dtype", "float32", "--tokens", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "* = the config-stage choice" in out and 'policy="auto" routes each T' in out


def test_console_script_and_module_entry():
    exe = Path(sys.executable).with_name("moe-dispatch")
    for cmd in ([str(exe), "doctor", "--json"], [sys.executable, "-m", "moe_dispatch", "doctor", "--json"]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(out.stdout)["backends"]


def test_support_matrix_is_current():
    from moe_dispatch._matrix import render
    committed = (ROOT / "docs" / "support-matrix.md").read_text()
    assert committed == render() + "\n", (
        "docs/support-matrix.md is stale: run `moe-dispatch matrix --write docs/support-matrix.md`")
