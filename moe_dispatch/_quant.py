"""Quantized expert weights: the scheme, the packed tensors, round-to-nearest quantization.

One layout for every scheme (docs/quantization.md has the exact math):

- ``qweight``: int8 ``[E, N, K]`` for int8; for int4, uint8 ``[E, N, K // 2]`` with two
  values per byte, element ``2j`` in the low nibble and ``2j + 1`` in the high one, each
  stored as ``q + 8`` (symmetric, q in [-8, 7]) or as ``q`` (with zero points, q in [0, 15]);
- ``scales``: ``[E, N, K // g]``, float32 per output channel (g = K), float16 per group (the
  GGUF convention: Q8_0 and Q4_0 blocks carry an fp16 scale, so they map without loss);
- ``zeros``: uint8 ``[E, N, K // g]`` for int4 with zero points, else None.

The value a quantized element stands for is ``(q - zero) * float32(scale)``, zero = 0 when
symmetric. K is the input dimension of each projection (H for ``w13``, I for ``w2``).
"""

from __future__ import annotations

import math

import attrs
import torch

from ._errors import InvalidArgumentError, InvalidTypeError

KINDS = ("int8", "int4")
INT8_GROUPS = (None, 32)
INT4_GROUPS = (32, 64, 128)


def _check_group(inst: "QuantScheme", attribute: attrs.Attribute, value: int | None) -> None:
    allowed = INT8_GROUPS if inst.kind == "int8" else INT4_GROUPS
    # 32.0 == 32 passes the membership test below, then fails later inside a reshape.
    if value is not None and type(value) is not int:
        raise InvalidTypeError("group_size", value, f"one of {allowed} for {inst.kind!r} "
                               f"(an int, not {type(value).__name__})")
    if value not in allowed:
        raise InvalidArgumentError("group_size", value, f"one of {allowed} for {inst.kind!r}")


@attrs.frozen(slots=True)
class QuantScheme:
    """How expert weights are quantized: ``QuantScheme("int8")`` (per output channel),
    ``QuantScheme("int8", group_size=32)``, ``QuantScheme("int4", group_size=128)``
    (symmetric) or ``QuantScheme("int4", group_size=32, symmetric=False)`` (zero points)."""

    kind: str = attrs.field()
    group_size: int | None = attrs.field(default=attrs.Factory(
        lambda self: None if self.kind == "int8" else 128, takes_self=True))
    symmetric: bool = attrs.field(default=True)

    @kind.validator
    def _kind(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in KINDS:
            raise InvalidArgumentError("kind", value, f"one of {KINDS}")

    @group_size.validator
    def _group(self, attribute: attrs.Attribute, value: int | None) -> None:
        _check_group(self, attribute, value)

    @symmetric.validator
    def _symmetric(self, attribute: attrs.Attribute, value: bool) -> None:
        if not isinstance(value, bool):
            raise InvalidTypeError("symmetric", value, "a bool")
        if self.kind == "int8" and not value:
            raise InvalidArgumentError("symmetric", value, "True for int8 (zero points are int4 only)")

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4

    def groups(self, k: int) -> int:
        """Scales per output channel for an input dimension of ``k``."""
        return 1 if self.group_size is None else k // self.group_size

    def check_dim(self, field: str, k: int) -> None:
        """Raise unless this scheme can quantize rows of length ``k``."""
        g = self.group_size
        if g is not None and k % g:
            raise InvalidArgumentError(f"{field} (the {self.kind} group_size={g})", k,
                                       f"a multiple of {g}")
        if self.bits == 4 and k % 2:
            raise InvalidArgumentError(field, k, "an even size (two int4 values per byte)")

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"g{self.group_size}"
        return f"{self.kind} {group}" + ("" if self.symmetric else " zero points")


@attrs.frozen(slots=True, eq=False)
class QuantizedTensor:
    """One projection's quantized weights, ``[E, N, K]`` in the module docstring's layout."""

    scheme: QuantScheme
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    shape: tuple[int, int, int]

    def __attrs_post_init__(self) -> None:
        e, n, k = self.shape
        s = self.scheme
        qdtype, qk = (torch.int8, k) if s.bits == 8 else (torch.uint8, k // 2)
        _expect("qweight", self.qweight, qdtype, (e, n, qk))
        sdtype = torch.float32 if s.group_size is None else torch.float16
        _expect("scales", self.scales, sdtype, (e, n, s.groups(k)))
        if s.symmetric:
            if self.zeros is not None:
                raise InvalidArgumentError("zeros", "a tensor", f"None for symmetric {s.describe()}")
        elif self.zeros is None:
            raise InvalidArgumentError("zeros", None, f"a uint8 tensor for {s.describe()}")
        else:
            _expect("zeros", self.zeros, torch.uint8, (e, n, s.groups(k)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros)
                   if t is not None)

    @classmethod
    def of(cls, scheme: QuantScheme, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None = None) -> "QuantizedTensor":
        """A tensor whose logical shape follows from ``qweight`` (two int4 values per byte)."""
        if not isinstance(scheme, QuantScheme):
            raise InvalidTypeError("scheme", scheme, "a moe_dispatch.QuantScheme")
        if not isinstance(qweight, torch.Tensor):
            raise InvalidTypeError("qweight", qweight, "a torch.Tensor")
        if qweight.dim() != 3:
            raise InvalidArgumentError("qweight", f"{qweight.dtype} {list(qweight.shape)}",
                                       "[E, N, K] ([E, N, K / 2] for int4)")
        e, n, width = qweight.shape
        return cls(scheme, qweight, scales, zeros, (e, n, width * (2 if scheme.bits == 4 else 1)))

    def stored(self, expert: int | None = None, dtype: torch.dtype = torch.int16) -> torch.Tensor:
        """The stored integers in element order, ``[E, N, K]`` (``[N, K]`` for one expert) in
        ``dtype``: int8 q as is, or the int4 nibbles (q + 8 symmetric, q with zero points)."""
        qweight = self.qweight if expert is None else self.qweight[expert]
        return qweight.to(dtype) if self.scheme.bits == 8 else unpack_nibbles(qweight).to(dtype)

    def _offsets(self, expert: int | None, dtype: torch.dtype) -> torch.Tensor | float:
        """What is subtracted from ``stored()`` per group: the zero points, or 8 / 0."""
        if self.zeros is not None:
            zeros = self.zeros if expert is None else self.zeros[expert]
            return zeros.to(dtype).unsqueeze(-1)
        return 8 if self.scheme.bits == 4 else 0

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        groups = self.scales.shape[-1]
        return q.reshape(*q.shape[:-1], groups, q.shape[-1] // groups)

    def values(self, expert: int | None = None) -> torch.Tensor:
        """The integer values q - zero, int16 ``[E, N, K]`` (``[N, K]`` for one expert)."""
        q = self.stored(expert)
        return (self._grouped(q) - self._offsets(expert, torch.int16)).reshape(q.shape)

    def dequantize(self, expert: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[E, N, K]`` (``[N, K]`` for one expert) these values stand for: exact in
        float32; in another ``dtype``, computed there (the scale rounded to it once, the
        product once)."""
        # In place on the one fresh tensor ``stored`` returns: a temporary per step costs a
        # fresh allocation, page faults and all (measured: sub and mul took 80% of the
        # portable loop's time at C2 T=1, 17 ms an expert in float32).
        q = self.stored(expert, dtype)
        scales = self.scales if expert is None else self.scales[expert]
        v = self._grouped(q)
        offsets = self._offsets(expert, dtype)
        if not isinstance(offsets, (int, float)) or offsets:
            v.sub_(offsets)
        return v.mul_(scales.to(dtype).unsqueeze(-1)).reshape(q.shape)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """4-bit stored values ``[..., K]`` in element order -> uint8 ``[..., K / 2]``, element
    2j in the low nibble and 2j + 1 in the high one (the layout of ``qweight``)."""
    u = u.to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`, as int16 ``[..., K]``."""
    p = packed.to(torch.int16)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def _expect(field: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(field, t, "a torch.Tensor")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise InvalidArgumentError(field, f"{t.dtype} {list(t.shape)}", f"{dtype} {list(shape)}")


def quantize(w: torch.Tensor, scheme: QuantScheme, field: str = "w") -> QuantizedTensor:
    """Round-to-nearest (ties to even) quantization of a float ``[E, N, K]`` tensor."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 3:
        raise InvalidArgumentError(field, type(w).__name__ if not isinstance(w, torch.Tensor)
                                   else f"{w.dtype} {list(w.shape)}", "a float tensor [E, N, K]")
    e, n, k = w.shape
    scheme.check_dim(f"{field}.shape[2]", k)
    g = k if scheme.group_size is None else scheme.group_size
    x = w.detach().to(torch.float32).reshape(e, n, k // g, g)
    zeros = None
    if scheme.symmetric:
        top = 127.0 if scheme.bits == 8 else 7.0
        scale = x.abs().amax(dim=-1) / top
    else:  # int4 with zero points: [min, max] onto [0, 15], 0.0 exactly representable
        lo = x.amin(dim=-1).clamp(max=0.0)
        hi = x.amax(dim=-1).clamp(min=0.0)
        scale = (hi - lo) / 15.0
    # The stored scale is the one the math uses: round it first (fp16 per group), then
    # quantize against it, so that |w - dequantized| <= scale / 2 holds for the stored scale.
    stored = scale.to(torch.float32 if scheme.group_size is None else torch.float16)
    if not torch.isfinite(stored).all():
        # A weight that is not finite, or a group whose scale exceeds fp16's 65504 (one
        # weight above 65504 * top): every value of the group would dequantize to NaN.
        bad = x.abs().amax().item()
        limit = ""
        if scheme.group_size is not None:
            limit = (" (a float16 scale per group, at most 65504: " + (
                f"max|w| of a group up to {65504 * (127 if scheme.bits == 8 else 7):g}"
                if scheme.symmetric else f"max - min of a group up to {65504 * 15:g}")
                + "; per-channel int8 stores float32 scales)")
        raise InvalidArgumentError(
            field, f"a weight of magnitude {bad:g}" if math.isfinite(bad) else "a weight that is not finite",
            "finite weights whose scale fits its stored type" + limit)
    s = stored.to(torch.float32)
    safe = torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1)
    if scheme.symmetric:
        lo_q, hi_q = (-127, 127) if scheme.bits == 8 else (-8, 7)
        q = torch.round(x / safe).clamp(lo_q, hi_q)
    else:
        z = torch.round(-lo / torch.where(s == 0, torch.ones_like(s), s)).clamp(0, 15)
        q = (torch.round(x / safe) + z.unsqueeze(-1)).clamp(0, 15)
        zeros = z.to(torch.uint8)
    q = q.reshape(e, n, k)
    qweight = q.to(torch.int8) if scheme.bits == 8 else pack_nibbles(q + 8 if scheme.symmetric else q)
    return QuantizedTensor.of(scheme, qweight, stored.contiguous(), zeros)


@attrs.frozen(slots=True, eq=False)
class QuantizedExperts:
    """A layer's experts, quantized: ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` in the
    canonical layout, biases float (they are not quantized)."""

    scheme: QuantScheme
    w13: QuantizedTensor
    w2: QuantizedTensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        biases = sum(b.numel() * b.element_size() for b in (self.w13_bias, self.w2_bias)
                     if b is not None)
        return self.w13.nbytes + self.w2.nbytes + biases

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``w13, w2`` the quantized values stand for."""
        return self.w13.dequantize(), self.w2.dequantize()


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, scheme: QuantScheme,
                     w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None) -> QuantizedExperts:
    """Quantize float experts (canonical layout) with ``scheme``; the inputs are only read."""
    if not isinstance(scheme, QuantScheme):
        raise InvalidTypeError("scheme", scheme, "a moe_dispatch.QuantScheme")
    q13 = quantize(w13, scheme, "w13")
    q2 = quantize(w2, scheme, "w2")
    e, two_i, h = q13.shape
    if q2.shape != (e, h, two_i // 2):
        raise InvalidArgumentError("w2", list(q2.shape), f"[E, H, I] = {[e, h, two_i // 2]} "
                                   f"for w13 {list(q13.shape)}")
    return QuantizedExperts(scheme, q13, q2, w13_bias, w2_bias)
