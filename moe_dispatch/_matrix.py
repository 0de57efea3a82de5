"""The support matrix: every backend's gate evaluated on simulated machines, as Markdown.

Generated from the code (``moe-dispatch matrix``); a test fails when the committed
docs/support-matrix.md is stale.
"""

from __future__ import annotations

import torch

from ._capabilities import Capabilities
from ._config import Activation, MoEConfig, dtype_name
from ._quant import QuantScheme
from ._registry import BUILTIN_DISTRIBUTION, get_registry
from ._resolver import call_check
from ._spec import normalize_name

MACHINES = ("sapphire_rapids", "ice_lake", "zen3", "zen4", "zen5", "neoverse_v1")
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
SHAPE = dict(num_experts=64, top_k=8, hidden_size=2048, intermediate_size=768)
SCHEMES = (QuantScheme("int8"), QuantScheme("int8", group_size=32), QuantScheme("int4", group_size=32),
           QuantScheme("int4", group_size=128), QuantScheme("int4", group_size=32, symmetric=False))
_ABBR = {Activation.SILU: "silu", Activation.GELU: "gelu", Activation.GELU_TANH: "gelu_tanh",
         Activation.SWIGLUOAI: "swigluoai"}


def canonical_ops() -> dict[str, str]:
    """The op schemas the registered backends were written for (``BackendSpec.ops``):
    what a simulated machine's software provides."""
    return {name: schema for rec in get_registry().snapshot().records for name, schema in rec.spec.ops}


def machine(name: str) -> Capabilities:
    """A simulated machine with every backend's ops at the schemas it expects."""
    return Capabilities.preset(name, ops=canonical_ops(), mkldnn=name != "neoverse_v1")


def _documented(distribution: str | None) -> bool:
    return distribution is not None and normalize_name(distribution) == normalize_name(BUILTIN_DISTRIBUTION)


def render() -> str:
    snap = get_registry().snapshot()
    out = ["# Support matrix", "",
           "Generated from the backends' own gates by `moe-dispatch matrix --write "
           "docs/support-matrix.md`; a test fails when this file is stale.", "",
           f"Each cell lists the activations a backend accepts for E={SHAPE['num_experts']}, "
           f"top_k={SHAPE['top_k']}, H={SHAPE['hidden_size']}, I={SHAPE['intermediate_size']} on a "
           "simulated machine (`Capabilities.preset`) that has every backend's ops at the "
           "schemas it declares (`BackendSpec.ops`). "
           "`bias` and `router-on-input` (top_k=1) are checked with silu in the first dtype "
           "the backend accepts there. Backends that run quantized weights "
           "(`BackendSpec.weights`) add a table of the activation dtypes they accept per "
           "scheme (docs/quantization.md). `-` means rejected; `moe-dispatch explain` gives "
           "the reason.", ""]
    # This distribution's backends only: the file documents this package, whatever else is
    # installed.
    for rec in (r for r in snap.records if _documented(r.distribution)):
        out.append(f"## `{rec.name}` (priority {rec.priority})")
        out.append("")
        if rec.spec.description:
            out.append(rec.spec.description)
            out.append("")
        out.append(f"Weights: {', '.join(rec.spec.weights)}.")
        out.append("")
        if "float" in rec.spec.weights:
            out += _float_table(rec)
        quantized = [s for s in SCHEMES if s.kind in rec.spec.weights]
        if quantized:
            out += _quantized_table(rec, quantized)
    return "\n".join(out)


def _float_table(rec) -> list[str]:
    head = ["machine"] + [dtype_name(d) for d in DTYPES] + ["bias", "router-on-input"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
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
    return out + [""]


def _quantized_table(rec, schemes: list[QuantScheme]) -> list[str]:
    """Quantized weights: the activation dtypes accepted per scheme (silu)."""
    head = ["machine"] + [s.describe() for s in schemes]
    out = ["Quantized weights (silu; the activation dtypes accepted):", "",
           "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for mname in MACHINES:
        caps = machine(mname)
        cells = []
        for scheme in schemes:
            ok = [dtype_name(d) for d in DTYPES
                  if call_check(rec, "supports_config",
                                MoEConfig(**SHAPE, dtype=d, weight_scheme=scheme), caps).accepted]
            cells.append(", ".join(ok) if ok else "-")
        out.append("| " + " | ".join([mname] + cells) + " |")
    return out + [""]
