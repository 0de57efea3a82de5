"""The native kernel's weight layout, packed at prepare() from the canonical weights.

Every projection ``[E, N, K]`` keeps its rows; the reduction axis K is padded with zeros to
a multiple of 32 (the inputs are zero there too, so the padding adds exactly nothing):

- bf16: the values as stored;
- int8: the values; scales fp32 ``[E, N, 1]`` (per channel) or fp16 ``[E, N, K/32]``;
- int4: in each block of 32 values, byte j holds value j in its low nibble and value j + 16
  in its high one (so one 16-byte load unpacks into the 32 values in order); scales fp16
  ``[E, N, K/g]`` and zero points uint8 ``[E, N, K/g]``, or the constant offset 8 when
  symmetric.

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
FORMATS = {"float": 0, "int8": 1, "int4": 2}
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}


def padded(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


@attrs.frozen(slots=True, eq=False)
class Packed:
    """One projection in the kernel's layout (the constructor arguments of ``Experts``)."""

    q: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    blocks_per_group: int = 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.zeros)
                   if t is not None)


def _pad_k(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    e, n, k = t.shape
    out = md.kernels.large_zeros((e, n, padded(k)), dtype)
    out[..., :k] = t  # a copy even when no padding is needed: the kernel owns its weights
    return out


def pack_float(w: torch.Tensor) -> Packed:
    return Packed(_pad_k(w, torch.bfloat16))


def pack_quantized(t: md.QuantizedTensor) -> Packed:
    e, n, k = t.shape
    s = t.scheme
    if s.bits == 8:
        q = _pad_k(t.qweight, torch.int8)
        if s.group_size is None:  # one scale per row: every block of the row is in group 0
            return Packed(q, t.scales.to(torch.float32, copy=True).contiguous(), None,
                          padded(k) // BLOCK)
        return Packed(q, t.scales.clone().contiguous(), None, s.group_size // BLOCK)
    g = s.group_size
    assert g is not None and k % BLOCK == 0  # the config checks that g divides K
    q = md.kernels.large_zeros((e, n, k // 2), torch.uint8)
    for i in range(e):  # one expert at a time: the unpacked values are 4x its packed bytes
        u = t.stored(i, torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
        q[i] = (u[:, :, 0, :] | (u[:, :, 1, :] << 4)).reshape(n, k // 2)
    zeros = None if t.zeros is None else t.zeros.clone().contiguous()
    return Packed(q, t.scales.clone().contiguous(), zeros, g // BLOCK)


def experts_args(config: md.MoEConfig, weights: md.LayerWeights) -> tuple[Any, ...]:
    """The constructor arguments of the kernel's ``Experts`` for this layer."""
    q = weights.quantized
    if q is None:
        w13, w2 = pack_float(weights.w13), pack_float(weights.w2)
        b13, b2, fmt, offset = weights.w13_bias, weights.w2_bias, "float", 0
    else:
        w13, w2 = pack_quantized(q.w13), pack_quantized(q.w2)
        b13, b2 = q.w13_bias, q.w2_bias
        fmt = f"int{q.w13.scheme.bits}"
        offset = 8 if q.w13.scheme.bits == 4 else 0  # symmetric int4 stores q + 8
    bias = [None if b is None else b.to(torch.float32, copy=True).contiguous() for b in (b13, b2)]
    return (FORMATS[fmt], ACTIVATIONS[str(config.activation)], config.num_experts,
            config.hidden_size, config.intermediate_size,
            w13.q, w13.scales, w13.zeros, w13.blocks_per_group,
            w2.q, w2.scales, w2.zeros, w2.blocks_per_group, offset, bias[0], bias[1])
