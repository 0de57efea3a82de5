"""Experts from GGUF files written by the gguf library's own writer and quantizers."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, random_routing, rel_error

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (the test extra has it)")
np = pytest.importorskip("numpy")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _write(path, layer, arrays, types):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, a, qt in zip(NAMES, arrays, types):
        if qt in (Q.F32, Q.F16):
            w.add_tensor(f"blk.{layer}.{name}.weight", a.astype(np.float16 if qt == Q.F16 else np.float32))
        else:
            w.add_tensor(f"blk.{layer}.{name}.weight", quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _experts(e, h, i, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((e, i, h), dtype=np.float32) * 0.1,
            rng.standard_normal((e, i, h), dtype=np.float32) * 0.1,
            rng.standard_normal((e, h, i), dtype=np.float32) * 0.1)


@pytest.mark.parametrize("qt,scheme", [(Q.Q8_0, md.QuantScheme("int8", group_size=32)),
                                       (Q.Q4_0, md.QuantScheme("int4", group_size=32))])
@pytest.mark.parametrize("e,h,i,seed", [(4, 64, 96, 0), (8, 256, 128, 1), (3, 32, 32, 2)])
def test_gguf_experts_map_without_loss(tmp_path, qt, scheme, e, h, i, seed):
    gate, up, down = _experts(e, h, i, seed)
    path = tmp_path / "m.gguf"
    _write(path, 5, (gate, up, down), (qt,) * 3)
    qe = md.experts_from_gguf(path, 5)
    assert qe.scheme == scheme
    d13, d2 = qe.dequantize()
    # Exactly what llama.cpp's own dequantization gives (gguf.quants mirrors ggml-quants.c).
    want13 = np.concatenate([dequantize(quantize(gate, qt), qt), dequantize(quantize(up, qt), qt)], axis=1)
    assert np.array_equal(d13.numpy(), want13)
    assert np.array_equal(d2.numpy(), dequantize(quantize(down, qt), qt))
    cfg = md.MoEConfig(e, 2, h, i, dtype=torch.float32, weight_scheme=scheme)
    layer = md.MoELayer(cfg, backend="torch").load_weights(qe).prepare()
    x, tw, ids = random_routing(cfg, 5, seed=seed)
    ref = moe_reference(cfg, x, d13, d2, tw, ids)
    assert rel_error(layer(x, tw, ids), ref) <= TOLERANCE[torch.float32]


def test_gguf_errors_name_what_is_wrong(tmp_path):
    gate, up, down = _experts(2, 64, 64, 3)
    mixed = tmp_path / "mixed.gguf"
    _write(mixed, 0, (gate, up, down), (Q.Q4_0, Q.Q4_0, Q.Q8_0))  # a common llama.cpp mix
    with pytest.raises(md.InvalidArgumentError, match="ffn_down_exps=Q8_0"):
        md.experts_from_gguf(mixed, 0)
    with pytest.raises(md.InvalidArgumentError, match=r"blk.1.ffn_gate_exps.weight.*no tensors"):
        md.experts_from_gguf(mixed, 1)
    f16 = tmp_path / "f16.gguf"
    _write(f16, 0, (gate, up, down), (Q.F16,) * 3)
    with pytest.raises(md.InvalidArgumentError, match="all Q8_0 or all Q4_0"):
        md.experts_from_gguf(f16, 0)


@pytest.mark.parametrize("shapes,bad,want", [
    pytest.param(((2, 32, 64), (2, 64, 64), (2, 64, 32)), "ffn_up_exps",
                 r"\[2, 64, 64\].*\[E, I, H\] = \[2, 32, 64\]", id="up-I"),
    pytest.param(((2, 32, 64), (2, 32, 64), (2, 64, 64)), "ffn_down_exps",
                 r"\[2, 64, 64\].*\[E, H, I\] = \[2, 64, 32\]", id="down-I"),
    pytest.param(((2, 32, 64), (2, 32, 64), (3, 64, 32)), "ffn_down_exps",
                 r"\[3, 64, 32\].*\[E, H, I\] = \[2, 64, 32\]", id="down-E"),
    pytest.param(((2, 32, 64), (2, 32, 64), (2, 32, 64)), "ffn_down_exps",
                 r"\[2, 32, 64\].*\[E, H, I\] = \[2, 64, 32\]", id="down-as-gate"),
    pytest.param(((32, 64), (32, 64), (64, 32)), "ffn_gate_exps", r"\[32, 64\].*\[E, I, H\]", id="2-D"),
])
@pytest.mark.parametrize("qt", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
def test_expert_tensors_that_disagree_in_shape_are_refused_by_name(tmp_path, shapes, bad, want, qt):
    """gate and up [E, I, H], down [E, H, I] (numpy order), all with the gate's E, I, H."""
    rng = np.random.default_rng(0)
    path = tmp_path / "bad.gguf"
    _write(path, 0, [rng.standard_normal(s, dtype=np.float32) for s in shapes], (qt,) * 3)
    with pytest.raises(md.InvalidArgumentError, match=rf"blk.0.{bad}.weight shape={want}"):
        md.experts_from_gguf(path, 0)
