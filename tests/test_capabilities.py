import platform

import pytest

import moe_dispatch as md
from moe_dispatch._capabilities import zen_generation


def test_detect_is_cached_and_real():
    a, b = md.Capabilities.detect(), md.Capabilities.detect()
    assert a is b
    assert a.threads >= 1 and a.torch_version.startswith("2.13")
    assert a.arch == platform.machine()
    assert a.has_op("mkldnn::_linear_pointwise")


@pytest.mark.parametrize("family,model,gen", [
    (0x17, 0x01, 1), (0x17, 0x31, 2), (0x19, 0x01, 3), (0x19, 0x21, 3), (0x19, 0x11, 4),
    (0x19, 0x61, 4), (0x19, 0xA0, 4), (0x1A, 0x02, 5), (0x15, 0x02, None), (None, 1, None),
])
def test_zen_generation_table(family, model, gen):
    assert zen_generation(family, model) == gen


def test_presets_describe_other_machines():
    spr = md.Capabilities.preset("sapphire_rapids")
    assert spr.amx_tile and spr.cpu_vendor == "Intel" and not spr.is_amd_zen
    assert not md.Capabilities.preset("zen3").avx512_bf16
    assert md.Capabilities.preset("zen4").avx512_bf16 and md.Capabilities.preset("zen5").zen_generation == 5
    assert md.Capabilities.preset("neoverse_v1").arch == "aarch64"
    with pytest.raises(md.InvalidArgumentError, match="preset='pentium'"):
        md.Capabilities.preset("pentium")


def test_capabilities_hashable_and_evolve():
    caps = md.Capabilities.preset("zen4", ops={"a::b": "s"})
    assert caps.op_schema("a::b") == "s" and caps.op_schema("x::y") is None
    assert hash(caps) == hash(md.Capabilities.preset("zen4", ops={"a::b": "s"}))
    assert caps.evolve(threads=7).threads == 7


def test_an_unknown_preset_is_a_typed_error_and_names_are_normalised():
    with pytest.raises(md.InvalidArgumentError, match="preset='skylake'.*zen4"):
        md.Capabilities.preset("skylake")
    assert md.Capabilities.preset(" Zen4 ") == md.Capabilities.preset("zen4")
