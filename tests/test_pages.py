"""The toolkit's huge-page buffers: what they hold, when they are advised, and that the
native and vllm backends keep their prepacked weights in them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.kernels import _pages, huge_pages_used, large_copy, large_zeros, thp_mode
from helpers import random_weights

BIG = (4, 512, 1024)  # 4 MiB of bf16: above one huge page


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte carries MADV_HUGEPAGE (``hg``)."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


needs_thp = pytest.mark.skipif(not huge_pages_used(), reason=f"transparent huge pages: {thp_mode()}")


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"),
                                        ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never"), ("garbled\n", "unavailable")])
def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    monkeypatch.setattr(_pages, "_MODE_FILE", f)
    assert thp_mode() == mode
    assert huge_pages_used() is (mode in ("always", "madvise"))
    monkeypatch.setattr(_pages, "_MODE_FILE", tmp_path / "absent")
    assert thp_mode() == "unavailable" and not huge_pages_used()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8])
def test_large_zeros_is_a_zero_contiguous_tensor_of_its_own(dtype):
    t = large_zeros(BIG, dtype)
    assert t.shape == BIG and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t.fill_(3)
    gc.collect()  # the mapping lives as long as the tensor
    assert bool((t == 3).all())
    u = large_zeros(BIG, dtype)
    assert not u.any(), "a second buffer is fresh memory, never the first one's"


@needs_thp
def test_large_buffers_are_advised_and_aligned():
    t = large_zeros(BIG, torch.bfloat16)
    assert t.data_ptr() % _pages.HUGE_PAGE == 0 and advised(t)


def test_small_buffers_and_the_off_switch_are_plain_torch(monkeypatch):
    small = large_zeros((16, 16), torch.float32)
    assert small._base is None and not small.any()
    monkeypatch.setenv(_pages.SWITCH, "0")
    assert not huge_pages_used()
    off = large_zeros(BIG, torch.bfloat16)
    assert off._base is None and not off.any()  # torch's own allocation
    assert not advised(off)


def test_large_copy_is_an_independent_equal_copy():
    src = torch.randn(BIG).to(torch.bfloat16)
    cp = large_copy(src)
    assert torch.equal(cp, src) and cp.data_ptr() != src.data_ptr()
    src.add_(1)
    assert not torch.equal(cp, src)
    assert large_copy(None) is None
    strided = torch.randn(1024, 2048)[:, ::2]
    assert torch.equal(large_copy(strided), strided) and large_copy(strided).is_contiguous()


def _large(tensors) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor)
            and t.numel() * t.element_size() >= _pages.HUGE_PAGE]


CFG = md.MoEConfig(8, 2, 1024, 512, dtype=torch.bfloat16)


@needs_thp
def test_the_native_kernels_weights_are_in_huge_pages():
    from moe_dispatch_backends.native._pack import experts_args

    w = random_weights(CFG)
    packed = _large(experts_args(CFG, md.LayerWeights(CFG, w["w13"], w["w2"])))
    assert len(packed) == 2 and all(advised(t) for t in packed)


@needs_thp
def test_the_vllm_backends_prepacked_weights_are_in_huge_pages():
    from moe_dispatch_backends.vllm_cpu import _library

    loaded, why = _library.load()
    if not loaded:
        pytest.skip(f"vLLM's CPU kernels unavailable: {why}")
    layer = md.MoELayer(CFG, backend="vllm").load_weights(**random_weights(CFG)).prepare()
    state = layer.plan.route.state
    assert all(advised(t) for t in (state.w13, state.w2))
