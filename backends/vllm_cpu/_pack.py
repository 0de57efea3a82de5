"""The backend's own weights: padded to the kernel's alignment and prepacked.

The kernel needs H and I to be multiples of 32. I is padded with zero rows of ``w13`` (both
gate and up, or zero gate/up pairs for the interleaved swigluoai layout), zero bias entries
and zero columns of ``w2``: a padded unit computes act(0, 0) = 0 for every activation here
(silu, gelu, gelu_tanh: ``f(0) * 0``; swigluoai: ``(0 + 1) * 0 * sigmoid(0)``), and its zero
``w2`` column adds nothing, so the result is exact. ``prepack_moe_weight`` is a pure
permutation into the kernel's blocked layout, written out of place: the caller's tensors are
only read.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

import moe_dispatch as md

ALIGN = 32


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@attrs.frozen(slots=True, eq=False)
class VllmState:
    config: md.MoEConfig
    w13: torch.Tensor  # [E, 2I', H], packed
    w2: torch.Tensor  # [E, H, I'], packed
    w13_bias: torch.Tensor | None  # [E, 2I'], contiguous, owned
    w2_bias: torch.Tensor | None  # [E, H]
    act: str
    inter: int  # I' (padded)
    isa: str  # "vec", or "amx" for bf16 where AMX tiles are
    # The serialised kernel call, resolved once: the native module's run_op when it is
    # loaded (one mutex for every call in the process), else a Python lock around the op.
    call: Callable[..., None] = attrs.field(repr=False)


def _pad_w13(w: torch.Tensor, inter: int, new: int, interleaved: bool) -> torch.Tensor:
    """``[..., 2I, (H)]`` -> ``[..., 2I', (H)]`` along dim 1 with zero units."""
    e = w.shape[0]
    rest = tuple(w.shape[2:])
    if interleaved:  # (gate, up) pairs: append zero pairs
        out = w.new_zeros((e, 2 * new) + rest)
        out[:, :2 * inter] = w
        return out
    out = w.new_zeros((e, 2, new) + rest)
    out[:, :, :inter] = w.reshape((e, 2, inter) + rest)
    return out.reshape((e, 2 * new) + rest)


def _prepack(w: torch.Tensor, isa: str) -> torch.Tensor:
    src = w.contiguous()
    out = md.kernels.large_zeros(src.shape, src.dtype)  # huge pages where offered
    torch.ops._C.prepack_moe_weight(src, out, isa)
    return out


def build_state(weights: md.LayerWeights, isa: str, call: Callable[..., None]) -> VllmState:
    config = weights.config
    inter, new = config.intermediate_size, padded(config.intermediate_size)
    inter_leaved = config.activation is md.Activation.SWIGLUOAI
    w13, w2, b13 = weights.w13, weights.w2, weights.w13_bias
    if new != inter:
        w13 = _pad_w13(w13, inter, new, inter_leaved)
        b13 = _pad_w13(b13, inter, new, inter_leaved) if b13 is not None else None
        w2 = torch.nn.functional.pad(w2, (0, new - inter))
    return VllmState(config, _prepack(w13, isa), _prepack(w2, isa), md.kernels.owned_copy(b13),
                     md.kernels.owned_copy(weights.w2_bias), config.activation.value, new, isa,
                     call)
