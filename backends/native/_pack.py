"""The native kernel's weight layout, packed at prepare() from the canonical weights.

bf16 weights keep their rows ``[E, N, K]`` as stored, the reduction axis K padded with zeros
to a multiple of 32 (the inputs are zero there too, so the padding adds exactly nothing).

int8 and int4 weights go in blocks of 16 rows (``pack_blocked``; ``blocks_quant.h`` reads
them), K padded the same way: per block and per 4 values of K (a
step), 64 bytes hold the 16 rows' 4 values (row r's at bytes 4r..4r+3), so that one load
feeds a ``vpdpbusd`` for 16 rows at once (the avx2 build reads each 64 bytes as two halves
of 8 rows, ``maddubs`` then ``madd``); int4 values (u, 0..15) pair two steps in one 64
bytes, the first in the low nibbles. int8 values are stored + 128 (``vpdpbusd``'s unsigned
operand; the avx2 build flips them back to signed). Blocks go in pairs (2p, 2p + 1),
interleaved step by step (block 2p's 64 bytes, then block 2p + 1's), so that the kernel,
which reads a pair at once, reads one stream: two streams 32 KB apart made C2 decode 10-20%
slower on a Zen 4. The scales go in the same stream: ``q`` is ``[E, pairs, G * (scales +
steps)]`` bytes, per weight group (one group: per channel) the pair's 2 x 16 scales (fp16 or
fp32, block 2p's first), then the group's steps (``blocks_quant.h`` says why). Zero points
stay ``[E, blocks, G, 16]``. w13's blocks alternate gate and up rows of 16 intermediate units
(block 2j: gate rows of units 16j..16j+15, block 2j + 1: their up rows), whatever the
canonical row order of the activation; rows past the end (to whole pairs of blocks) are
zero padding.

The integers and scales are those of :class:`~moe_dispatch.QuantizedExperts` (and so of a
GGUF Q8_0 / Q4_0 file), moved, never rounded: the mapping is lossless. Everything here is
a new tensor, the large ones in huge pages where the OS offers them (the toolkit's
``large_zeros``): the caller's are only read.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

import moe_dispatch as md

BLOCK = 32
ROWS = 16  # rows per block of the blocked int8 / int4 layout
FORMATS = {"float": 0, "int8": 1, "int4": 2}
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}


def padded(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


@attrs.frozen(slots=True, eq=False)
class Packed:
    """One projection in the kernel's layout (the constructor arguments of ``Experts``):
    blocked, ``q`` holds the scales too, and ``scales`` is a separate ``[E, blocks, G, 16]``
    tensor of the same values for the constructor's checks (which does not keep it)."""

    q: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    blocks_per_group: int = 1

    @property
    def nbytes(self) -> int:
        """The bytes the kernel keeps."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.zeros) if t is not None)


def _pad_k(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    e, n, k = t.shape
    out = md.kernels.large_zeros((e, n, padded(k)), dtype)
    out[..., :k] = t  # a copy even when no padding is needed: the kernel owns its weights
    return out


def pack_float(w: torch.Tensor) -> Packed:
    return Packed(_pad_k(w, torch.bfloat16))


def _blocks(rows: list[int]) -> torch.Tensor:
    """Canonical row of each blocked row (-1: padding), padded to whole pairs of blocks."""
    rows = rows + [-1] * (-len(rows) % (2 * ROWS))
    return torch.tensor(rows, dtype=torch.int64)


def w13_rows(config: md.MoEConfig) -> torch.Tensor:
    """w13's blocked row order: per 16 intermediate units, their gate rows, then their up rows."""
    i = config.intermediate_size
    oai = str(config.activation) == "swigluoai"  # interleaved: gate u is row 2u, up 2u + 1
    order: list[int] = []
    for u0 in range(0, i, ROWS):
        units = range(u0, u0 + ROWS)
        order += [(2 * u if oai else u) if u < i else -1 for u in units]
        order += [(2 * u + 1 if oai else i + u) if u < i else -1 for u in units]
    return _blocks(order)


def _rows_of(t: torch.Tensor, order: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """t's rows (dim -2) in ``order``, zero where it is -1; the last dim padded to width."""
    *lead, _, k = t.shape
    out = torch.zeros((*lead, order.numel(), width or k), dtype=t.dtype)
    valid = order >= 0
    out[..., valid, :k] = t[..., order[valid], :]
    return out


def pack_blocked(t: md.QuantizedTensor, order: torch.Tensor) -> Packed:
    """One projection in the blocked layout (module docstring): ``q`` the pairs' streams,
    ``scales`` the same scales as ``[E, blocks, G, 16]`` (checked by the kernel's
    constructor, which keeps only the stream)."""
    e, _, k = t.shape
    s, kp, blocks = t.scheme, padded(k), order.numel() // ROWS
    pairs, per_value = blocks // 2, 2 * ROWS // (2 if s.bits == 4 else 1)  # bytes of a pair per K value

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [E, N, G] -> [E, blocks, G, 16]
        g = x.shape[-1]
        return _rows_of(x, order).view(e, blocks, ROWS, g).transpose(2, 3).contiguous()

    scales = grouped(t.scales.to(torch.float32) if s.group_size is None else t.scales)
    zeros = None if t.zeros is None else grouped(t.zeros)
    groups, group = scales.shape[2], kp if s.group_size is None else s.group_size
    values = min(group, kp)  # per group
    head = 2 * ROWS * scales.element_size()  # the pair's scales of one group
    q = md.kernels.large_zeros((e, pairs, groups * (head + values * per_value)), torch.uint8)
    stream = q.view(e, pairs, groups, head + values * per_value)
    for i in range(e):  # one expert at a time: its values widened are 2x-4x its bytes
        # [pairs, 2, G, 16] -> [pairs, G, 2, 16]: per group, block 2p's 16 scales, then 2p + 1's
        stream[i, :, :, :head] = scales[i].view(pairs, 2, groups, ROWS).transpose(1, 2).reshape(
            pairs, groups, 2 * ROWS).view(torch.uint8)
        u = _rows_of(t.stored(i, torch.int16), order, kp)
        # [pairs of blocks, 2, 16 rows, steps, 4] -> [pairs, steps, 2, 16, 4]
        if s.bits == 8:
            v = (u + 128).view(pairs, 2, ROWS, kp // 4, 4).permute(0, 3, 1, 2, 4)
        else:
            v = u.view(pairs, 2, ROWS, kp // 8, 2, 4)
            v = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 3, 1, 2, 4)
        stream[i, :, :, head:] = v.reshape(pairs, groups, -1).to(torch.uint8)
    return Packed(q, scales, zeros, group // BLOCK)


def experts_args(config: md.MoEConfig, weights: md.LayerWeights) -> tuple[Any, ...]:
    """The constructor arguments of the kernel's ``Experts`` for this layer (both builds
    read the same layout)."""
    q = weights.quantized
    if q is None:
        w13, w2 = pack_float(weights.w13), pack_float(weights.w2)
        b13, b2, fmt, offset = weights.w13_bias, weights.w2_bias, "float", 0
    else:
        w13 = pack_blocked(q.w13, w13_rows(config))
        w2 = pack_blocked(q.w2, _blocks(list(range(config.hidden_size))))
        b13, b2 = q.w13_bias, q.w2_bias
        fmt = f"int{q.w13.scheme.bits}"
        offset = 8 if q.w13.scheme.bits == 4 else 0  # symmetric int4 stores q + 8
    bias = [None if b is None else b.to(torch.float32, copy=True).contiguous() for b in (b13, b2)]
    return (FORMATS[fmt], ACTIVATIONS[str(config.activation)], config.num_experts,
            config.hidden_size, config.intermediate_size,
            w13.q, w13.scales, w13.zeros, w13.blocks_per_group,
            w2.q, w2.scales, w2.zeros, w2.blocks_per_group, offset, bias[0], bias[1])
