"""Quantized weights on zentorch's op (its ``w13_scales`` / ``w2_scales`` arguments).

Measured on a Zen 4 (AVX-512 with BF16 and VNNI) with zentorch 2.13.0.2
(docs/backends/zentorch.md, "Quantized weights"):

- The op is W8A8 / W4A8: it never dequantizes the weights; it quantizes both GEMM inputs
  (x, and act(gate) * up before w2) per token to symmetric int8 (scale = row max / 127) and
  runs integer dot products. Against the float64 reference on the dequantized weights its
  error is 1.5e-2 to 1.9e-2 at E=8 H=256 I=128 and 2.2e-2 to 2.5e-2 at E=64 H=2048 I=768,
  which no caller can remove: ``ERROR_BOUND`` documents it and the tests check it.
- int8: int8 ``[E, N, K]`` values; scales ``[E, N]`` per output channel, or ``[E, K/g, N]``
  per group (groups first: the transpose of this project's ``[E, N, K/g]``). int4: signed
  values in [-8, 7] two per byte in an int8 ``[E, N, K/2]``, element 2j in the low nibble
  (the high nibble first is silently wrong); scales ``[E, K/g, N]``. Non-contiguous scales
  are silently wrong: every tensor handed over is a contiguous private copy.
- No zero points (no argument for them); bf16 activations only (fp32 fails with status
  -17); int8 with H = 130 fails ("status 0") where 128, 132 and 136 run: H and I are
  required to be multiples of 4 (I is not measured; required too, to be safe).
- Its cache is keyed by address, like the float path's: the ledger gives it private copies
  at addresses it has never seen.
"""

from __future__ import annotations

import torch

import moe_dispatch as md
from moe_dispatch.kernels import op_problem

from . import _gate

# The arguments this backend passes for quantized weights, by name and type.
ARGS = _gate.EXPECTED_ARGS + (("w13_scales", "Optional[Tensor]"), ("w2_scales", "Optional[Tensor]"))
# The op's error against the float64 reference on the dequantized weights, measured up to
# 2.5e-2 (module docstring); the tests and the warm-up self-check hold it to this.
ERROR_BOUND = 3e-2


def supports_config(config: md.MoEConfig, caps: md.Capabilities, library: str) -> md.Decision:
    """The rules for a quantized config (the common ones are checked first by ``_gate``)."""
    scheme = config.weight_scheme
    assert scheme is not None
    problem = op_problem(caps, _gate.OP_NAME, ARGS, source=f"zentorch: {library}",
                         hint=_gate.INSTALL_HINT)
    if problem:
        return md.reject(problem)
    if not caps.avx512_vnni:
        return md.reject(f"zentorch's {scheme.kind} MoE needs AVX-512 VNNI, which this CPU lacks "
                         f"(Zen {caps.zen_generation or '?'}); the torch backend runs it")
    if not scheme.symmetric:
        return md.reject(f"{scheme.describe()}: the op has no zero points (symmetric schemes only)")
    if config.dtype != torch.bfloat16:
        return md.reject(f"quantized weights need bfloat16 activations on this op (float32 "
                         f"fails with status -17); the config has {md.kernels.dtype_name(config.dtype)}")
    if config.activation is not md.Activation.SILU:
        return md.reject(f"quantized weights are measured with silu only; "
                         f"{config.activation.value!r} is not")
    if config.hidden_size % 4 or config.intermediate_size % 4:
        return md.reject(f"quantized weights need H and I multiples of 4 (int8 with H=130 fails "
                         f"in the op); H={config.hidden_size}, I={config.intermediate_size}")
    return md.accept(f"zentorch {scheme.describe()} fused MoE (W{scheme.bits}A8: activations "
                     f"quantized per token; error up to {ERROR_BOUND:g} of the reference)")


def op_tensors(q: md.QuantizedExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13, w2, w13_scales, w2_scales) in the op's layout, new contiguous tensors that
    share no storage with the caller's (they are handed to the op as they are)."""
    return (_values(q.w13), _values(q.w2), _scales(q.w13), _scales(q.w2))


def _values(t: md.QuantizedTensor) -> torch.Tensor:
    if t.scheme.bits == 8:
        return t.qweight.clone()
    # This project stores q + 8 per nibble; the op wants q's two's complement nibble, which
    # is (q + 8) ^ 8 in each half of the byte.
    return (t.qweight ^ 0x88).view(torch.int8).contiguous()


def _scales(t: md.QuantizedTensor) -> torch.Tensor:
    s = t.scales.to(torch.float32, copy=True)  # new (fp16 group scales are exact in fp32)
    if t.scheme.group_size is None:
        return s.reshape(s.shape[0], s.shape[1]).contiguous()  # [E, N]
    return s.transpose(1, 2).contiguous()  # [E, K/g, N]
