"""Experts from a compressed-tensors checkpoint ("pack-quantized": llm-compressor's int4/int8).

Each expert projection is a module with (compressed-tensors 0.20's pack-quantized format):

- ``weight_packed`` int32 ``[N, K * b / 32]``: the b-bit values of a row packed densely,
  element i at bits ``i*b .. i*b + b - 1`` (word ``i*b // 32``), each stored as
  ``q + 2**(b-1)`` (q signed);
- ``weight_scale`` ``[N, K / g]`` (``[N, 1]`` per channel) in the model's dtype;
- ``weight_zero_point`` (asymmetric only) int32 ``[N * b / 32, K / g]``: the signed zero
  points packed the same way along the rows;
- ``weight_shape`` ``[N, K]``.

The value is ``(q - zp) * scale``. This project stores ``u = q + 8`` and ``z = zp + 8`` for
int4 (value ``(u - z) * s``) and q itself for int8, so the values map exactly; the scales map
exactly when they are representable in this project's scale dtype (float32 per channel,
float16 per group), which is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from ._errors import InvalidArgumentError, InvalidTypeError
from ._quant import QuantizedExperts, QuantizedTensor, QuantScheme, pack_nibbles

# (gate, up, down) module names per expert, by checkpoint family.
NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def experts_from_compressed_tensors(source: str | Path | Mapping[str, torch.Tensor], prefix: str,
                                    num_experts: int, names: str | tuple[str, str, str] = "qwen"
                                    ) -> QuantizedExperts:
    """The experts under ``{prefix}.{e}.{gate|up|down}`` (e.g. ``model.layers.3.mlp.experts``)
    of a state dict or a ``.safetensors`` file, as :class:`QuantizedExperts`. ``names``: the
    three module names, or ``"qwen"`` (gate_proj, up_proj, down_proj) / ``"mixtral"`` (w1,
    w3, w2). The scheme (bits, group size, zero points) is read from the tensors and must be
    one of this project's (``QuantScheme``) and the same for every projection."""
    if isinstance(names, str):
        if names not in NAMES:
            raise InvalidArgumentError("names", names, f"one of {sorted(NAMES)} or three module names")
        names = NAMES[names]
    # bool is an int subclass; True experts is a bug, not a count.
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise InvalidTypeError("num_experts", num_experts, "a positive int")
    if num_experts <= 0:
        raise InvalidArgumentError("num_experts", num_experts, "a positive int (> 0)")
    tensors = _load(source, prefix)
    parts: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, QuantScheme]]] = [[], [], []]
    for e in range(num_experts):
        for j, name in enumerate(names):
            parts[j].append(_projection(tensors, f"{prefix}.{e}.{name}"))
    schemes = {p[3] for part in parts for p in part}
    if len(schemes) != 1:
        raise InvalidArgumentError(f"{prefix} schemes", sorted(s.describe() for s in schemes),
                                   "one scheme for every expert projection")
    scheme = schemes.pop()
    gate, up, down = (_stack(part, scheme) for part in parts)
    w13 = QuantizedTensor.of(scheme, torch.cat([gate.qweight, up.qweight], 1),
                             torch.cat([gate.scales, up.scales], 1),
                             None if gate.zeros is None else torch.cat([gate.zeros, up.zeros], 1))
    return QuantizedExperts(scheme, w13, down)


def _load(source: str | Path | Mapping[str, torch.Tensor], prefix: str) -> Mapping[str, torch.Tensor]:
    if isinstance(source, Mapping):
        return source
    from safetensors import safe_open  # comes with transformers / huggingface_hub

    out = {}
    with safe_open(str(source), framework="pt") as fh:
        for key in fh.keys():
            if key.startswith(prefix + "."):
                out[key] = fh.get_tensor(key)
    return out


def _unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 ``[R, W]`` densely packed b-bit fields -> int32 ``[R, count]`` stored values
    (b in 4 and 8 only: a field never straddles two words)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(words.shape[0], -1)[:, :count]


def _projection(tensors: Mapping[str, torch.Tensor], name: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, QuantScheme]:
    plain = tensors.get(f"{name}.weight")
    values: torch.Tensor | None = None
    if plain is not None and plain.dtype == torch.int8 and f"{name}.weight_scale" in tensors:
        # "int-quantized": int8 values as they are (compressed-tensors' naive format)
        if plain.dim() != 2 or 0 in plain.shape:
            raise InvalidArgumentError(f"{name}.weight", f"{plain.dtype} {list(plain.shape)}",
                                       "int8 [N, K] with N, K > 0")
        n, k = plain.shape
        values, bits = plain, 8
        scale = tensors[f"{name}.weight_scale"]
    else:
        try:
            packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
            shape = tensors[f"{name}.weight_shape"]
        except KeyError as exc:
            raise InvalidArgumentError("prefix", name, f"a pack-quantized module with "
                                       f"{exc.args[0]}") from None
        if shape.numel() != 2 or shape.is_floating_point() or bool((shape <= 0).any()):
            raise InvalidArgumentError(f"{name}.weight_shape", shape.tolist(), "[N, K] with N, K > 0")
        n, k = (int(v) for v in shape.tolist())
        if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n \
                or (packed.shape[1] * 32) % k:
            raise InvalidArgumentError(f"{name}.weight_packed", f"{packed.dtype} {list(packed.shape)}",
                                       f"int32 [{n}, {k} * bits / 32]")
        bits = packed.shape[1] * 32 // k
    if not scale.is_floating_point() or scale.dim() != 2 or scale.shape[0] != n \
            or scale.shape[1] == 0 or k % scale.shape[1]:
        raise InvalidArgumentError(f"{name}.weight_scale", f"{scale.dtype} {list(scale.shape)}",
                                   f"a float tensor [{n}, {k} / group_size] ([{n}, 1] per channel)")
    groups = scale.shape[1]
    g_idx = tensors.get(f"{name}.weight_g_idx")
    if g_idx is not None and not torch.equal(
            g_idx.to(torch.int64), torch.arange(k, dtype=torch.int64) // max(1, k // groups)):
        # GPTQ's activation order: column j belongs to group g_idx[j], not j // g. Read
        # without it, the groups would be wrong and every value silently off.
        raise InvalidArgumentError(f"{name}.weight_g_idx", "an activation-order group index",
                                   "groups of consecutive columns (g_idx[j] == j // group_size): "
                                   "this project's layouts have no column permutation")
    zp = tensors.get(f"{name}.weight_zero_point")
    group = None if groups == 1 and bits == 8 else k // groups
    try:
        scheme = QuantScheme("int8" if bits == 8 else "int4" if bits == 4 else f"{bits}-bit",
                             group_size=group, symmetric=zp is None)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{name}", f"{bits}-bit, {groups} scale(s) per row, "
                                   f"{'asymmetric' if zp is not None else 'symmetric'}",
                                   f"one of this project's schemes ({exc})") from None
    want = torch.float32 if group is None else torch.float16
    scales = scale.to(want)
    if not torch.equal(scales.to(scale.dtype), scale):
        raise InvalidArgumentError(f"{name}.weight_scale", f"{scale.dtype} values",
                                   f"scales exactly representable in {want} (this project's "
                                   "scale dtype for the scheme)")
    zeros = None
    if zp is not None:  # packed along the rows: unpack the transpose
        rows = -(-n * bits // 32)
        if zp.dtype != torch.int32 or tuple(zp.shape) != (rows, groups):
            # Older writers stored the zero points unpacked ([N, K / g], int8 or int32); read
            # as packed words they would give other zero points and silently wrong values.
            raise InvalidArgumentError(f"{name}.weight_zero_point", f"{zp.dtype} {list(zp.shape)}",
                                       f"int32 [{rows}, {groups}]: the {bits}-bit zero points "
                                       f"of the {n} rows packed along the rows (unpacked zero "
                                       "points are not read)")
        zeros = _unpack(zp.t().contiguous(), bits, n).t().to(torch.uint8)  # stored zp + 8
    if values is None:
        stored = _unpack(packed, bits, k)  # q + 2**(b-1)
        values = (stored - 128).to(torch.int8) if bits == 8 else pack_nibbles(stored)
    return values, scales.reshape(n, groups), zeros, scheme


def _stack(part: list, scheme: QuantScheme) -> QuantizedTensor:
    z = None if part[0][2] is None else torch.stack([p[2] for p in part])
    return QuantizedTensor.of(scheme, torch.stack([p[0] for p in part]),
                              torch.stack([p[1] for p in part]), z)
