"""The vendor's own op, registered with ``torch.library`` when this module is imported.

A real vendor ships a compiled library that registers its ops; this example registers one
written in Python so that it installs anywhere. The backend gates on its presence and
schema through ``capabilities.op_schema("example_vendor::padded_bmm")``, exactly as it
would for a compiled one.
"""

from __future__ import annotations

import torch

OP_NAME = "example_vendor::padded_bmm"
OP_ARGS = (("padded", "Tensor"), ("weights", "Tensor"), ("active", "Tensor"))


@torch.library.custom_op(OP_NAME, mutates_args=())
def padded_bmm(padded: torch.Tensor, weights: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``padded [A, R, K] @ weights[active] [A, K, N]`` -> ``[A, R, N]``."""
    return torch.bmm(padded, weights[active])


@padded_bmm.register_fake
def _(padded: torch.Tensor, weights: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return padded.new_empty(padded.shape[0], padded.shape[1], weights.shape[2])


SCHEMA = str(torch.ops.example_vendor.padded_bmm.default._schema)
