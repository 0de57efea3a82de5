"""The bf16 rows' input vectors (backends/native/layout.h, ``Inputs::set``): what steps 1 and
3 hand the dot products, for every class of float32 value, on every build this CPU runs.

avx512 build: each value v as hi = bf16(v) and lo = bf16(v - hi), both rounded as c10's
``BFloat16(float)`` rounds (to nearest even on the bits, a NaN as 0x7FC0), the remainders
only where some value is not a bf16. avx2 build: the float32 values, per 16 the 8 evens then
the 8 odds. The rest of each row (to ``kp``) stays zero."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_backends.native import kernel

HERE = md.Capabilities.detect()
BUILDS = [isa for isa in kernel.ISAS if kernel.runs(isa, HERE)]


@pytest.fixture(params=BUILDS or ["none"])
def module(request):
    if request.param == "none":
        pytest.skip(f"this CPU runs no build of the native kernel: {kernel.isa_for(HERE)[1]}")
    built = kernel.load(request.param)
    if built is None:
        pytest.skip(f"the native kernel's {request.param} build is unavailable: {kernel.status(request.param)}")
    return built


def _floats(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _values(n: int, seed: int) -> torch.Tensor:
    """n values of each class, shuffled: normal, exact bf16, subnormal, subnormals that round
    up to the smallest normal bf16, values that round up to infinity, ties to even, +-0,
    +-infinity, NaNs with payloads."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 1 << 15, (n,), generator=g).tolist()
    sign = [(b & 1) << 31 for b in torch.randint(0, 2, (n,), generator=g).tolist()]
    normal = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    exact = torch.randn(n, generator=g).bfloat16().float()
    parts = [
        normal, exact,
        _floats([s | (b * 97 % 0x7FFFFF) for s, b in zip(sign, low)]),                # subnormal
        _floats([s | (0x007F8000 + b) for s, b in zip(sign, low)]),                    # -> 2**-126
        _floats([s | (0x7F7F8000 + b) for s, b in zip(sign, low)]),                    # -> inf
        _floats([s | (0x3F800000 + ((b % 2) << 16) + 0x8000) for s, b in zip(sign, low)]),  # ties
        _floats([0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0xFFC12345]),
    ]
    x = torch.cat(parts)
    return x[torch.randperm(x.numel(), generator=g)]


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """c10's rounding on the bits, as int64 (the spec the kernel's vectors follow)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return torch.where(torch.isnan(x), torch.full_like(b, 0x7FC0), b & 0xFFFF)


def _as_int16(bits: torch.Tensor) -> torch.Tensor:
    return (bits - ((bits >> 15) << 16)).to(torch.int16)


@pytest.mark.parametrize("length", [1, 16, 37, 100, 130])
def test_rows_inputs_hold_each_value_as_its_build_says(module, length):
    kp = (length + 31) // 32 * 32 + 32  # one block of padding beyond the rounding up
    x = _values(3 * length, seed=length)[: 3 * length].reshape(3, length).contiguous()
    f, lo = module.rows_inputs(x, kp)
    if module.ISA == "avx2":
        assert lo.shape == (0, kp)
        k = torch.arange(length)
        block, j = k - k % 16, k % 16
        want = torch.zeros(3, kp)
        want[:, block + (j % 2) * 8 + j // 2] = x
        assert torch.equal(f.view(torch.int32), want.view(torch.int32))
        return
    hi = _bf16_bits(x)
    assert torch.equal(f[:, :length], _as_int16(hi)) and not f[:, length:].any()
    r = x - (hi << 16).to(torch.int32).view(torch.float32)  # the remainder, in float32
    r[x.isinf()] = 0  # an infinity is a bf16 (the avx2 build, and float math, keep it)
    keep = r != 0  # NaN included
    assert keep.any() and lo.shape == (3, kp)
    want = torch.where(keep, _as_int16(_bf16_bits(r)), torch.zeros_like(hi, dtype=torch.int16))
    assert torch.equal(lo[:, :length], want) and not lo[:, length:].any()


def test_bf16_values_get_no_remainders(module):
    """x in bf16 (the layer's dtype), subnormals, zeros and infinities included: no second
    dot product for it (the remainders' vector is not made), and an infinity reaches the dot
    product as an infinity."""
    x = torch.cat([torch.randn(60).bfloat16().float(), _floats([0x00010000, 0x8001_0000, 0, 0x7F800000])])
    f, lo = module.rows_inputs(x.reshape(2, 32).contiguous(), 64)
    assert lo.shape == (0, 64)
    if module.ISA != "avx2":
        assert torch.equal(f[:, :32].reshape(-1), x.bfloat16().view(torch.int16))


def test_rows_inputs_names_what_it_accepts(module):
    with pytest.raises(RuntimeError, match=r"x float32 \[n, len\], contiguous; got Double"):
        module.rows_inputs(torch.zeros(2, 8, dtype=torch.float64), 32)
    with pytest.raises(RuntimeError, match=r"kp a multiple of 32 and at least len \(40\), got 32"):
        module.rows_inputs(torch.zeros(2, 40), 32)
