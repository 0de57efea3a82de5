"""Experts from compressed-tensors checkpoints: written with compressed-tensors' own
quantizer (calculate_qparams) and compressors (pack-quantized, int-quantized), saved with
safetensors, read back by md.experts_from_compressed_tensors."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.reference import moe_reference
from moe_dispatch.testing import TOLERANCE, random_routing, rel_error

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed "
                         "(the test extra has it)")
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

PREFIX = "model.layers.2.mlp.experts"


def _checkpoint(path, e, h, i, bits, group, symmetric, names=("gate_proj", "up_proj", "down_proj"), seed=0,
                compressor=PackedQuantizationCompressor):
    """(file, {(expert, name): the library's own decompressed weight})."""
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    g = torch.Generator().manual_seed(seed)
    tensors, theirs = {}, {}
    for x in range(e):
        for name, (n, k) in zip(names, ((i, h), (i, h), (h, i))):
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            rows = w.float().reshape(n, k // (group or k), group or k)
            scale, zp = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
            packed = compressor.compress(
                {"weight": w, "weight_scale": scale.bfloat16(), "weight_zero_point": zp}, scheme)
            for key, v in packed.items():
                tensors[f"{PREFIX}.{x}.{name}.{key}"] = v.contiguous()
            theirs[(x, name)] = compressor.decompress(packed, scheme)["weight"]
    save_file(tensors, str(path))
    return path, theirs


@pytest.mark.parametrize("bits,group,symmetric,scheme", [
    (4, 128, True, md.QuantScheme("int4", group_size=128)),
    (4, 32, False, md.QuantScheme("int4", group_size=32, symmetric=False)),
    (4, 64, True, md.QuantScheme("int4", group_size=64)),
    (8, None, True, md.QuantScheme("int8")),
])
def test_checkpoint_experts_map_exactly(tmp_path, bits, group, symmetric, scheme):
    e, h, i = 3, 256, 128
    path, theirs = _checkpoint(tmp_path / "model.safetensors", e, h, i, bits, group, symmetric)
    _check_against_theirs(md.experts_from_compressed_tensors(path, PREFIX, e), theirs, scheme, e, h, i)


def _check_against_theirs(qe, theirs, scheme, e, h, i):
    assert qe.scheme == scheme
    d13, d2 = qe.dequantize()
    # compressed-tensors dequantizes in the weights' dtype (one bf16 rounding of the exact
    # value): ours, exact in float32, rounds to the same bf16 numbers.
    names = ("gate_proj", "up_proj", "down_proj")
    want13 = torch.stack([torch.cat([theirs[(x, names[0])], theirs[(x, names[1])]]) for x in range(e)])
    want2 = torch.stack([theirs[(x, names[2])] for x in range(e)])
    assert torch.equal(d13.bfloat16(), want13) and torch.equal(d2.bfloat16(), want2)
    cfg = md.MoEConfig(e, 2, h, i, dtype=torch.bfloat16, weight_scheme=scheme)
    layer = md.MoELayer(cfg, backend="torch").load_weights(qe).prepare()
    x, tw, ids = random_routing(cfg, 6)
    assert rel_error(layer(x, tw, ids), moe_reference(cfg, x, d13, d2, tw, ids)) <= TOLERANCE[torch.bfloat16]


def test_mixtral_names_and_errors(tmp_path):
    path, _ = _checkpoint(tmp_path / "m.safetensors", 2, 64, 64, 4, 32, True,
                          names=("w1", "w3", "w2"))
    qe = md.experts_from_compressed_tensors(path, PREFIX, 2, names="mixtral")
    assert qe.scheme == md.QuantScheme("int4", group_size=32) and qe.w13.shape == (2, 128, 64)
    with pytest.raises(md.InvalidArgumentError, match="gate_proj"):
        md.experts_from_compressed_tensors(path, PREFIX, 2)  # the Qwen names are not there
    with pytest.raises(md.InvalidArgumentError, match=r"experts.2"):
        md.experts_from_compressed_tensors(path, PREFIX, 3, names="mixtral")
    with pytest.raises(md.InvalidArgumentError, match="names='deepseek'"):
        md.experts_from_compressed_tensors(path, PREFIX, 2, names="deepseek")
    odd, _ = _checkpoint(tmp_path / "g16.safetensors", 1, 64, 64, 4, 16, True)
    with pytest.raises(md.InvalidArgumentError, match="group_size=16"):
        md.experts_from_compressed_tensors(odd, PREFIX, 1)


def test_activation_order_group_index_is_refused_and_a_trivial_one_read(tmp_path):
    """GPTQ's act-order checkpoints carry weight_g_idx (column j in group g_idx[j]): this
    project's layouts have none, so such a file is refused by name, never read wrong; a
    g_idx of consecutive groups is the plain layout and reads as one."""
    from safetensors.torch import load_file
    path, _ = _checkpoint(tmp_path / "m.safetensors", 1, 64, 64, 4, 32, True)
    tensors = load_file(str(path))
    plain = md.experts_from_compressed_tensors(tensors, PREFIX, 1)
    trivial = dict(tensors)
    for name, k in (("gate_proj", 64), ("up_proj", 64), ("down_proj", 64)):
        trivial[f"{PREFIX}.0.{name}.weight_g_idx"] = torch.arange(k, dtype=torch.int32) // 32
    again = md.experts_from_compressed_tensors(trivial, PREFIX, 1)
    assert torch.equal(again.w13.qweight, plain.w13.qweight) and torch.equal(again.w2.scales, plain.w2.scales)
    shuffled = dict(trivial)
    shuffled[f"{PREFIX}.0.down_proj.weight_g_idx"] = torch.randperm(
        64, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 32
    with pytest.raises(md.InvalidArgumentError, match="down_proj.weight_g_idx"):
        md.experts_from_compressed_tensors(shuffled, PREFIX, 1)


@pytest.mark.parametrize("h,i", [(64, 70), (70, 64), (66, 70)])
def test_int_quantized_int8_per_channel_at_any_k(tmp_path, h, i):
    """compressed-tensors' int-quantized format (int8 ``weight`` as is) at input sizes that
    are not multiples of 4: per-channel int8 takes any K."""
    e = 2
    path, theirs = _checkpoint(tmp_path / "int8.safetensors", e, h, i, 8, None, True,
                               compressor=IntQuantizationCompressor)
    _check_against_theirs(md.experts_from_compressed_tensors(path, PREFIX, e), theirs,
                          md.QuantScheme("int8"), e, h, i)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_unpacked_zero_points_are_refused_by_name(tmp_path, dtype):
    """Zero points stored one per row ([N, K / g], as older writers did) instead of packed
    along the rows: read as packed words they would be other zero points, every value off."""
    from safetensors.torch import load_file
    path, _ = _checkpoint(tmp_path / "m.safetensors", 1, 64, 64, 4, 32, False)
    tensors = load_file(str(path))
    key = f"{PREFIX}.0.gate_proj.weight_zero_point"
    assert tensors[key].dtype == torch.int32 and tensors[key].shape == (8, 2)
    unpacked = dict(tensors)
    unpacked[key] = unpack_from_int32(tensors[key], 4, torch.Size([64, 2]), packed_dim=0).to(dtype)
    with pytest.raises(md.InvalidArgumentError, match=rf"gate_proj.weight_zero_point="
                       rf"'{dtype} \[64, 2\]'.*int32 \[8, 2\]"):
        md.experts_from_compressed_tensors(unpacked, PREFIX, 1)


def test_malformed_tensors_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file
    path, _ = _checkpoint(tmp_path / "m.safetensors", 1, 64, 64, 4, 32, False)
    tensors = load_file(str(path))
    up = f"{PREFIX}.0.up_proj"
    scale = tensors[f"{up}.weight_scale"]
    for bad, field, match in (
            (scale.flatten(), "weight_scale", r"\[128\]"),
            (scale[:10], "weight_scale", r"\[10, 2\]"),
            (scale[:, :1].repeat(1, 3), "weight_scale", r"\[64, 3\]"),
            (torch.zeros(3, 5, dtype=torch.int32), "weight_zero_point", r"\[3, 5\].*int32 \[8, 2\]")):
        broken = dict(tensors)
        broken[f"{up}.{field}"] = bad
        with pytest.raises(md.InvalidArgumentError, match=rf"up_proj.{field}='torch.\w+ {match}"):
            md.experts_from_compressed_tensors(broken, PREFIX, 1)
    with pytest.raises(md.InvalidArgumentError, match="num_experts=0"):
        md.experts_from_compressed_tensors(tensors, PREFIX, 0)
    with pytest.raises(md.InvalidTypeError, match="num_experts"):
        md.experts_from_compressed_tensors(tensors, PREFIX, 1.0)
