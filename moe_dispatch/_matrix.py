"""The support matrix: every backend's gate evaluated on simulated machines, as Markdown.

Generated from the code (``moe-dispatch matrix``); a test fails when the committed
docs/support-matrix.md is stale.
"""

from __future__ import annotations

import torch

from ._capabilities import Capabilities
from ._config import Activation, MoEConfig, dtype_name
from ._registry import get_registry
from ._resolver import call_check

MACHINES = ("sapphire_rapids", "ice_lake", "zen3", "zen4", "zen5", "neoverse_v1")
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
SHAPE = dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768)
_ABBR = {Activation.SILU: "silu", Activation.GELU: "gelu", Activation.GELU_TANH: "gelu_tanh",
         Activation.SWIGLUOAI: "swigluoai"}


def canonical_ops() -> dict[str, str]:
    """The op schemas the built-in backends were written for (machine-independent)."""
    from moe_dispatch_backends.onednn import EXPECTED_SCHEMAS
    from moe_dispatch_backends.zentorch_fused import EXPECTED_SCHEMA, OP_NAME
    ops = dict(EXPECTED_SCHEMAS)
    ops[OP_NAME] = EXPECTED_SCHEMA
    ops["mkldnn::_linear_pointwise.binary"] = (
        "mkldnn::_linear_pointwise.binary(Tensor X, Tensor other, Tensor W, Tensor? B, str attr) -> Tensor Y")
    ops["aten::_grouped_mm"] = ("aten::_grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, "
                                "Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor")
    return ops


def machine(name: str) -> Capabilities:
    return Capabilities.preset(name, ops=canonical_ops(), zentorch_version="2.13.0.2",
                               torch_version="2.13.0", mkldnn=name != "neoverse_v1")


def render() -> str:
    snap = get_registry().snapshot()
    out = ["# Support matrix", "",
           "Generated from the backends' own gates by `moe-dispatch matrix --write "
           "docs/support-matrix.md`; a test fails when this file is stale.", "",
           f"Each cell lists the activations a backend accepts for E={SHAPE['num_experts']}, "
           f"top_k={SHAPE['top_k']}, H={SHAPE['hidden_size']}, I={SHAPE['intermediate_size']} on a "
           "simulated machine (`Capabilities.preset`) with torch 2.13.0 and zentorch 2.13.0.2. "
           "`bias` and `router-on-input` (top_k=1) are checked with silu in the first dtype "
           "the backend accepts there. `-` means rejected; `moe-dispatch explain` gives the "
           "reason.", ""]
    # Built-in backends only: the file documents this package, whatever else is installed.
    for rec in (r for r in snap.records if r.source.startswith("built-in")):
        out.append(f"## `{rec.name}` (priority {rec.priority})")
        out.append("")
        if rec.spec.description:
            out.append(rec.spec.description)
            out.append("")
        head = ["machine"] + [dtype_name(d) for d in DTYPES] + ["bias", "router-on-input"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + " --- |" * len(head))
        for mname in MACHINES:
            caps = machine(mname)
            cells, first = [], None
            for dtype in DTYPES:
                acts = [_ABBR[a] for a in Activation
                        if call_check(rec, "supports_config",
                                      MoEConfig(**SHAPE, activation=a, dtype=dtype), caps).accepted]
                if acts and first is None and Activation.SILU.value in acts:
                    first = dtype
                cells.append(", ".join(acts) if acts else "-")
            for flags in (dict(has_bias=True), dict(top_k=1, apply_router_weight_on_input=True)):
                if first is None:
                    cells.append("-")
                    continue
                cfg = MoEConfig(**{**SHAPE, **flags}, dtype=first)
                cells.append("yes" if call_check(rec, "supports_config", cfg, caps).accepted else "-")
            out.append("| " + " | ".join([mname] + cells) + " |")
        out.append("")
    return "\n".join(out)
