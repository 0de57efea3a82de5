"""Experts from a GGUF file (llama.cpp's format): Q8_0 and Q4_0 expert tensors, without loss.

llama.cpp stores a MoE layer's experts as ``blk.N.ffn_gate_exps.weight``,
``blk.N.ffn_up_exps.weight`` ``[E, I, H]`` and ``blk.N.ffn_down_exps.weight`` ``[E, H, I]``
(numpy order; ggml's ``ne`` is the reverse), each row cut into blocks of 32 values:

- Q8_0: an fp16 scale ``d`` and 32 int8 ``q``; the value is ``q * d``. That is this
  project's int8 g32 scheme as is.
- Q4_0: an fp16 scale ``d`` and 16 bytes; byte ``j`` holds element ``j`` in its low nibble
  and element ``j + 16`` in its high nibble, each as ``n`` with value ``(n - 8) * d`` (``d``
  may be negative: llama.cpp's quantizer sets it to the signed extreme over -8). That is
  this project's int4 g32 symmetric scheme with ``q = n - 8`` (stored ``n``), once the nibbles
  are put in this project's order (element 2j low, 2j + 1 high).

Reading needs the ``gguf`` package (``pip install moe-dispatch[gguf]``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ._errors import InvalidArgumentError
from ._quant import QuantizedExperts, QuantizedTensor, QuantScheme, pack_nibbles

BLOCK = 32
NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def experts_from_gguf(path: str | Path, layer: int) -> QuantizedExperts:
    """The experts of block ``layer`` of a GGUF file as :class:`QuantizedExperts`: Q8_0 ->
    ``QuantScheme("int8", group_size=32)``, Q4_0 -> ``QuantScheme("int4", group_size=32)``.
    The three expert tensors must share one of these types."""
    try:
        import gguf  # numpy comes with it
    except ImportError as exc:
        raise ImportError("reading GGUF files needs the gguf package: "
                          "pip install 'moe-dispatch[gguf]'") from exc
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    found = {}
    for name in NAMES:
        key = f"blk.{layer}.{name}.weight"
        if key not in tensors:
            have = sorted(n for n in tensors if n.startswith(f"blk.{layer}."))
            raise InvalidArgumentError("layer", layer, f"a block with {key} in {path} (it has: "
                                       f"{', '.join(have) or 'no tensors for this block'})")
        found[name] = tensors[key]
    kinds = {t.tensor_type.name for t in found.values()}
    if len(kinds) != 1 or not kinds <= {"Q8_0", "Q4_0"}:
        types = ", ".join(f"{n}={t.tensor_type.name}" for n, t in found.items())
        raise InvalidArgumentError(f"blk.{layer} expert tensor types", types,
                                   "all Q8_0 or all Q4_0 (other types are not mapped)")
    kind = kinds.pop()
    # ggml's ne is the reverse of numpy's order, in which the shapes below are written.
    shapes = {n: tuple(int(v) for v in reversed(list(t.shape))) for n, t in found.items()}
    gate = shapes["ffn_gate_exps"]
    if len(gate) != 3:
        raise InvalidArgumentError(f"blk.{layer}.ffn_gate_exps.weight shape", list(gate),
                                   "[E, I, H] (3 dims, numpy order: one matrix per expert)")
    e, i, h = gate
    for name, want, dims in (("ffn_up_exps", (e, i, h), "[E, I, H]"),
                             ("ffn_down_exps", (e, h, i), "[E, H, I]")):
        if shapes[name] != want:
            raise InvalidArgumentError(f"blk.{layer}.{name}.weight shape", list(shapes[name]),
                                       f"{dims} = {list(want)} (numpy order) for "
                                       f"blk.{layer}.ffn_gate_exps.weight [E, I, H] = {list(gate)}")
    scheme = QuantScheme("int8", group_size=BLOCK) if kind == "Q8_0" else QuantScheme("int4", group_size=BLOCK)
    gate, up, down = (_unpack(found[n], kind) for n in NAMES)
    w13 = [torch.cat([g, u], dim=1) for g, u in zip(gate, up)]  # (values, scales) along N
    return QuantizedExperts(scheme, QuantizedTensor.of(scheme, *w13), QuantizedTensor.of(scheme, *down))


def _unpack(t, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in this project's layout, fp16 scales [E, N, K/32]) of one GGUF tensor."""
    import numpy as np
    e, n, k = (int(v) for v in reversed(list(t.shape)))  # ggml ne -> numpy order
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(e * n * (k // BLOCK), -1)
    scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16).reshape(e, n, k // BLOCK))
    body = blocks[:, 2:]
    if kind == "Q8_0":
        values = torch.from_numpy(body.copy().view(np.int8).reshape(e, n, k))
        return values, scales
    # Q4_0: low nibbles are elements 0..15 of the block, high nibbles 16..31.
    body = torch.from_numpy(body.copy())
    nib = torch.cat([body & 0x0F, body >> 4], dim=1)  # [blocks, 32] in element order
    return pack_nibbles(nib).reshape(e, n, k // 2), scales
