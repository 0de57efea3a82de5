"""The native extension's own functions beside a layer's forward, on every build this CPU
runs: the bf16 rows' input vectors (``rows_inputs``), the benchmarks' hooks (``read_steps``,
``Experts.stream_w13`` and ``w13_stream``) and the constructor's check of the blocks' layout.

The input vectors (backends/native/layout.h, ``Inputs::set``) are what steps 1 and 3 hand the
bf16 rows' dot products. avx512 build: each value v as hi = bf16(v) and lo = bf16(v - hi),
both rounded as c10's ``BFloat16(float)`` rounds (to nearest even on the bits, a NaN as
0x7FC0), the remainders only where some value is not a bf16. avx2 build: the float32 values,
per 16 the 8 evens then the 8 odds. The rest of each row (to ``kp``) stays zero."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.testing import random_weights
from moe_dispatch_backends.native import kernel

from native_layers import build, layer_config, native_layer  # noqa: F401  (build: a fixture)


def _floats(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _values(n: int, seed: int) -> torch.Tensor:
    """n values: the specials (+-0, +-infinity, NaNs with payloads) first, then the classes in
    turn (normal, exact bf16, subnormal, subnormals that round up to the smallest normal bf16,
    values that round up to infinity, ties to even), so that every class is among the first
    7 + 6 values, shuffled."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 1 << 15, (n,), generator=g).tolist()
    sign = [(b & 1) << 31 for b in torch.randint(0, 2, (n,), generator=g).tolist()]
    classes = torch.stack([
        torch.randn(n, generator=g) * torch.logspace(-30, 30, n),                           # normal
        torch.randn(n, generator=g).bfloat16().float(),                                     # bf16
        _floats([s | (b * 97 % 0x7FFFFF) for s, b in zip(sign, low)]),                      # subnormal
        _floats([s | (0x007F8000 + b) for s, b in zip(sign, low)]),                          # -> 2**-126
        _floats([s | (0x7F7F8000 + b) for s, b in zip(sign, low)]),                          # -> inf
        _floats([s | (0x3F800000 + ((b % 2) << 16) + 0x8000) for s, b in zip(sign, low)]),  # ties
    ], dim=1).reshape(-1)  # in turn
    specials = _floats([0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0xFFC12345])
    x = torch.cat([specials, classes])[:n]
    return x[torch.randperm(n, generator=g)]


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """c10's rounding on the bits, as int64 (the spec the kernel's vectors follow)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return torch.where(torch.isnan(x), torch.full_like(b, 0x7FC0), b & 0xFFFF)


def _as_int16(bits: torch.Tensor) -> torch.Tensor:
    return (bits - ((bits >> 15) << 16)).to(torch.int16)


@pytest.mark.parametrize("length", [1, 16, 37, 100, 130])
def test_rows_inputs_hold_each_value_as_its_build_says(build, length):
    module = kernel.load(build)
    kp = (length + 31) // 32 * 32 + 32  # one block of padding beyond the rounding up
    x = _values(3 * length, seed=length).reshape(3, length).contiguous()
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
    assert lo.shape == ((3, kp) if keep.any() else (0, kp)) and (keep.any() or length == 1)
    if not keep.any():  # length 1: the specials 0, -0, infinity alone, all bf16
        return
    want = torch.where(keep, _as_int16(_bf16_bits(r)), torch.zeros_like(hi, dtype=torch.int16))
    assert torch.equal(lo[:, :length], want) and not lo[:, length:].any()


def test_bf16_values_get_no_remainders(build):
    """x in bf16 (the layer's dtype), subnormals, zeros and infinities included: no second
    dot product for it (the remainders' vector is not made), and an infinity reaches the dot
    product as an infinity."""
    module = kernel.load(build)
    x = torch.cat([torch.randn(60).bfloat16().float(), _floats([0x00010000, 0x8001_0000, 0, 0x7F800000])])
    f, lo = module.rows_inputs(x.reshape(2, 32).contiguous(), 64)
    assert lo.shape == (0, 64)
    if module.ISA == "avx2":  # the values themselves, interleaved (the other test: the order)
        assert torch.equal(f[:, :32].reshape(-1).sort().values, x.sort().values)
    else:
        assert torch.equal(f[:, :32].reshape(-1), x.bfloat16().view(torch.int16))


def test_rows_inputs_names_what_it_accepts(build):
    module = kernel.load(build)
    with pytest.raises(RuntimeError, match=r"x float32 \[n, len\], contiguous; got Double"):
        module.rows_inputs(torch.zeros(2, 8, dtype=torch.float64), 32)
    with pytest.raises(RuntimeError, match=r"kp a multiple of 32 and at least len \(40\), got 32"):
        module.rows_inputs(torch.zeros(2, 40), 32)


@pytest.mark.parametrize("sizes", [[64 * 7], [4096, 192], [0, 128, 640], [1 << 16]], ids=str)
def test_read_steps_reads_every_byte_asked(build, sizes):
    """benchmarks/bench_ceiling.py's plain read (kernel.cpp, read_steps): the XOR of the 64-bit
    words of exactly bytes [0, sum(sizes)), segment after segment, on every thread count."""
    module = kernel.load(build)
    t = torch.randint(0, 256, (1 << 17,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    n = sum(sizes)
    words = t[:n].view(torch.int64)
    while words.numel() > 1:  # XOR-fold in halves (torch has no XOR reduction)
        if words.numel() % 2:
            words = torch.cat([words, words.new_zeros(1)])
        words = torch.bitwise_xor(words[0::2], words[1::2])
    want = int(words[0]) % (1 << 64) if n else 0
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            seconds, fold = module.read_steps(t, sizes)
            assert fold == want and seconds > 0, threads
    finally:
        torch.set_num_threads(before)
    t[n:].random_(0, 256, generator=torch.Generator().manual_seed(4))  # bytes past the sizes:
    assert module.read_steps(t, sizes)[1] == want                     # never read


def test_read_steps_names_what_it_accepts(build):
    module = kernel.load(build)
    t = torch.zeros(1024, dtype=torch.uint8)
    for sizes in ([65], [-64]):
        with pytest.raises(RuntimeError, match=f"non-negative multiples of 64 bytes, got {sizes[0]}"):
            module.read_steps(t, sizes)
    for sizes in ([1024, 1024], [1 << 62] * 4):  # the second sums to 0 in int64
        with pytest.raises(RuntimeError, match="more bytes asked than the tensor's 1024"):
            module.read_steps(t, sizes)
    with pytest.raises(RuntimeError, match="a uint8 tensor, got Float"):
        module.read_steps(t.float(), [64])
    with pytest.raises(RuntimeError, match=r"not contiguous"):
        module.read_steps(torch.zeros(64, 2, dtype=torch.uint8).t(), [64])
    with pytest.raises(RuntimeError, match="aligned to 8 bytes"):
        module.read_steps(t[1:], [64])


def test_blocked_weights_of_the_wrong_layout_are_refused(build):
    """The kernel's constructor checks the pairs' streams against the scales' groups: weights
    packed without the scales in the stream (each pair its steps alone) are refused by name."""
    from moe_dispatch_backends.native import _pack

    cfg = layer_config(md.QuantScheme("int4", group_size=32))
    w = random_weights(cfg, seed=1)
    qe = md.quantize_experts(w["w13"].float(), w["w2"].float(), cfg.weight_scheme)
    args = list(_pack.experts_args(cfg, md.LayerWeights(cfg, qe.w13.qweight, qe.w2.qweight, quantized=qe)))
    module = kernel.load(build)
    module.Experts(*args)  # as packed: accepted
    e, pairs, _ = args[5].shape
    head = 2 * 16 * args[6].element_size()
    args[5] = args[5].view(e, pairs, args[6].shape[2], -1)[..., head:].reshape(e, pairs, -1).contiguous()
    with pytest.raises(RuntimeError, match=r"per pair, groups x \(scales \+ steps\)"):
        module.Experts(*args)


@pytest.mark.parametrize("scheme", [md.QuantScheme("int8"), md.QuantScheme("int4", group_size=32),
                                    md.QuantScheme("int4", group_size=64, symmetric=False)],
                         ids=lambda s: s.describe())
def test_stream_w13_runs_step_twos_loop_over_the_window(build, scheme):
    """benchmarks/bench_stream.py's loop (stream.h): every pair of w13 of the experts asked, its
    two blocks' first rows (a gate row and an up row) dotted with the first input, summed
    pair by pair in order: the same at any thread count and any number of inputs beside it
    (each input's sums are its own), and what the dequantized weights give (the input
    quantized per 32 values)."""
    cfg = layer_config(scheme, hidden_size=256, intermediate_size=64)
    layer, ref_w, _ = native_layer(cfg)
    experts = layer.plan.route.state.experts
    stream = experts.w13_stream()
    assert stream.dtype == torch.uint8 and stream.shape[:2] == (8, 64 // 16)
    x = torch.sin(0.37 * torch.arange(256, dtype=torch.float32) + 1).double()
    w13 = ref_w["w13"].double()  # [E, 2I, H], silu: gate rows 0..I-1, up rows I..2I-1
    before = torch.get_num_threads()
    try:
        for first, count in ((0, 8), (3, 2), (7, 1)):
            rows = [w13[e, u] @ x + w13[e, 64 + u] @ x for e in range(first, first + count)
                    for u in range(0, 64, 16)]
            want = float(sum(rows))
            sums = set()
            for threads, inputs in ((1, 1), (2, 1), (3, 1), (2, 2), (1, 6)):
                torch.set_num_threads(threads)
                seconds, checksum = experts.stream_w13(first, count, inputs)
                assert seconds > 0
                sums.add(checksum)
            assert len(sums) == 1, (first, count, sums)
            assert abs(sums.pop() - want) <= 4e-3 * float(sum(abs(r) for r in rows)), (first, count)
    finally:
        torch.set_num_threads(before)


def test_stream_w13_names_what_it_accepts(build):
    experts = native_layer(layer_config(md.QuantScheme("int8")))[0].plan.route.state.experts
    for first, count in ((-1, 1), (0, 0), (7, 2), (8, 1)):
        with pytest.raises(RuntimeError, match=r"experts \[first, first \+ count\) within \[0, 8\)"):
            experts.stream_w13(first, count)
    for inputs in (0, 7):
        with pytest.raises(RuntimeError, match=rf"inputs in \[1, 6\], got {inputs}"):
            experts.stream_w13(0, 1, inputs)
    bf16 = native_layer(layer_config(None))[0].plan.route.state.experts
    with pytest.raises(RuntimeError, match="int8 or int4 weights"):
        bf16.stream_w13(0, 1)
    with pytest.raises(RuntimeError, match="int8 or int4 weights"):
        bf16.w13_stream()
