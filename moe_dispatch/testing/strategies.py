"""Hypothesis strategies: the one home of those the conformance kit, the project's tests
and a vendor's tests share (configs, machines, synthetic backends, routing, call variants)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch.kernels import expert_loop, schema_arguments

from .._matrix import canonical_ops


# How a forward call can differ from the plain case a native entry takes (fast_call).
CALL_VARIANTS = ("plain", "int64_ids", "bf16_weights", "fp16_weights", "float64_weights",
                 "strided_hidden", "strided_ids", "strided_weights", "repeated_id", "id_too_large",
                 "negative_id", "id_past_int32", "no_tokens", "parameter_input", "grad_hidden",
                 "grad_router_weights")
# The variants the toolkit's PlainCall::check takes and converts (ids to int32, router
# weights to float32), so an entry built on it takes them too.
TOOLKIT_CONVERTS = ("int64_ids", "bf16_weights", "fp16_weights", "float64_weights")
# The variants that break BackendBase.fast_call's contract: every entry must decline them
# (the grad_ ones: autograd would record the call, and grad mode is on where they are drawn;
# id_past_int32: an int64 id of 2**32 plus a valid one, valid once narrowed to int32).
MUST_DECLINE = ("id_too_large", "negative_id", "id_past_int32", "no_tokens", "parameter_input",
                "grad_hidden", "grad_router_weights")


@st.composite
def call_variants(draw: st.DrawFn, config: md.MoEConfig, max_tokens: int = 12
                  ) -> tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(variant, (hidden_states, topk_weights, topk_ids)): fresh random routing (int32 ids,
    float32 weights, contiguous) changed in one of the ways of CALL_VARIANTS. Needs
    top_k >= 2 (a repeated id) and num_experts > top_k."""
    variant = draw(st.sampled_from(CALL_VARIANTS))
    tokens = 0 if variant == "no_tokens" else draw(st.integers(1, max_tokens))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
    tw, ids = md.select_experts(torch.randn(tokens, config.num_experts, generator=g), config.top_k)
    row = draw(st.integers(0, max(tokens - 1, 0)))
    if variant == "int64_ids":
        ids = ids.long()
    elif variant == "bf16_weights":
        tw = tw.bfloat16()
    elif variant == "fp16_weights":
        tw = tw.half()
    elif variant == "float64_weights":
        tw = tw.double()
    elif variant == "strided_hidden":
        x = torch.cat([x, x], 1)[:, ::2]
    elif variant == "strided_ids":
        ids = ids.t().contiguous().t()
    elif variant == "strided_weights":
        tw = tw.t().contiguous().t()
    elif variant == "repeated_id":
        ids[row, 1] = ids[row, 0]
    elif variant == "id_too_large":
        ids[row, 0] = config.num_experts
    elif variant == "negative_id":
        ids[row, 0] = -1
    elif variant == "id_past_int32":
        ids = ids.long()
        ids[row, 0] += 2**32
    elif variant == "parameter_input":
        x = torch.nn.Parameter(x, requires_grad=False)
    elif variant == "grad_hidden":
        x.requires_grad_(True)
    elif variant == "grad_router_weights":
        tw.requires_grad_(True)
    return variant, (x, tw, ids)


DTYPES = (torch.bfloat16, torch.float32, torch.float16)
VENDORS = ("AMD", "Intel", "ARM", "unknown")
FLAGS = ("avx2", "avx512", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
         "mkldnn")


@st.composite
def configs(draw: st.DrawFn, *, max_experts: int = 128, max_hidden: int = 4096,
            max_inter: int = 4096, min_hidden: int = 1, min_inter: int = 1, dtypes: tuple[torch.dtype, ...] = DTYPES,
            activations: tuple[md.Activation, ...] = tuple(md.Activation)) -> md.MoEConfig:
    """Valid MoEConfigs (shape fields only as large as asked)."""
    experts = draw(st.integers(1, max_experts))
    on_input = draw(st.booleans())
    top_k = 1 if on_input else draw(st.integers(1, min(8, experts)))
    return md.MoEConfig(
        num_experts=experts, top_k=top_k,
        hidden_size=draw(st.integers(min_hidden, max_hidden)),
        intermediate_size=draw(st.integers(min_inter, max_inter)),
        activation=draw(st.sampled_from(activations)),
        dtype=draw(st.sampled_from(dtypes)),
        has_bias=draw(st.booleans()),
        apply_router_weight_on_input=on_input)


def small_configs(**kw: Any) -> st.SearchStrategy[md.MoEConfig]:
    """Configs small enough to run a real forward in milliseconds.

    H >= 16 and I >= 8 so that a norm-wise relative error is a meaningful statistic: with
    a handful of output elements, one bf16 rounding under cancellation can exceed 1e-2
    on its own (measured: up to 0.9% at H=8..80).
    """
    kw.setdefault("min_hidden", 16)
    kw.setdefault("min_inter", 8)
    kw.setdefault("max_experts", 16)
    kw.setdefault("max_hidden", 80)
    kw.setdefault("max_inter", 48)
    return configs(**kw)


def declared_ops() -> dict[str, str]:
    """Every op schema the registered backends declare (``BackendSpec.ops``)."""
    return canonical_ops()


@st.composite
def mutated_schema(draw: st.DrawFn, schema: str) -> str:
    """``schema`` with one argument renamed or retyped: an upstream signature change."""
    head, _, tail = schema.partition("(")
    inner, _, ret = tail.rpartition(")")
    params = _split_params(inner)
    real = [i for i, p in enumerate(params) if p != "*"]  # "*" marks keyword-only ones
    names = [n for n, _ in schema_arguments(schema)]
    j = draw(st.integers(0, len(real) - 1))
    i, name = real[j], names[j]
    param = params[i]
    at = param.rindex(name)
    if draw(st.booleans()):
        params[i] = param[:at] + name + "_renamed" + param[at + len(name):]
    else:
        params[i] = ("float " if param.startswith("int") else "int ") + param[at:]
    return f"{head}({', '.join(params)}){ret}"


def _split_params(text: str) -> list[str]:
    """Top-level comma split of a schema's argument list (keeps ``Tensor(a!)`` intact)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@st.composite
def capabilities(draw: st.DrawFn) -> md.Capabilities:
    """Arbitrary machines, including impossible ones: gates must not depend on plausibility.
    Each backend-declared op is present, absent, or present with a mutated schema."""
    vendor = draw(st.sampled_from(VENDORS))
    zen = draw(st.sampled_from((None, 1, 2, 3, 4, 5))) if vendor == "AMD" else None
    flags = {f: draw(st.booleans()) for f in FLAGS}
    ops: dict[str, str] = {}
    for name, schema in sorted(declared_ops().items()):
        fate = draw(st.sampled_from(("present", "present", "absent", "mutated")))
        if fate == "present":
            ops[name] = schema
        elif fate == "mutated":
            ops[name] = draw(mutated_schema(schema))
    return md.Capabilities(
        cpu_vendor=vendor, cpu_model=f"{vendor} test cpu",
        arch="aarch64" if vendor == "ARM" else "x86_64",
        zen_generation=zen, threads=draw(st.integers(1, 256)), ops=ops, **flags)


@attrs.frozen
class Gate:
    """A synthetic backend's acceptance rule: a pure function of (config, capabilities)."""

    dtypes: frozenset[torch.dtype]
    needs_flag: str | None
    align: int
    raises: bool = False  # supports_config raises instead of answering

    def decide(self, config: md.MoEConfig, caps: md.Capabilities) -> md.Decision:
        if config.dtype not in self.dtypes:
            return md.reject(f"dtype {config.dtype} not in {sorted(map(str, self.dtypes))}")
        if self.needs_flag and not getattr(caps, self.needs_flag):
            return md.reject(f"needs {self.needs_flag}")
        if config.hidden_size % self.align:
            return md.reject(f"hidden_size {config.hidden_size} not a multiple of {self.align}")
        return md.accept("synthetic")

    def accepts(self, config: md.MoEConfig, caps: md.Capabilities) -> bool:
        return not self.raises and self.decide(config, caps).accepted


class SyntheticBackend(md.BackendBase):
    """A backend with a drawn gate; its kernel is the portable loop, so it really runs."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def supports_config(self, config: md.MoEConfig, capabilities: md.Capabilities) -> md.Decision:
        if self.gate.raises:
            raise RuntimeError("synthetic failure in supports_config")
        return self.gate.decide(config, capabilities)

    def process_weights(self, weights: md.LayerWeights, capabilities: md.Capabilities) -> Any:
        return weights

    def apply(self, state: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return expert_loop(state, hidden_states, topk_weights, topk_ids)


gates = st.builds(
    Gate,
    dtypes=st.frozensets(st.sampled_from(DTYPES), min_size=1),
    needs_flag=st.one_of(st.none(), st.sampled_from(FLAGS)),
    align=st.sampled_from((1, 2, 16, 32)),
    raises=st.sampled_from((False, False, False, True)),
)

backend_names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)


@st.composite
def synthetic_specs(draw: st.DrawFn, min_size: int = 1, max_size: int = 6) -> list[md.BackendSpec]:
    names = draw(st.lists(backend_names, min_size=min_size, max_size=max_size, unique=True))
    return [md.BackendSpec(n, draw(st.integers(-5, 5)), SyntheticBackend(draw(gates)))
            for n in names]


def expected_choice(specs: list[md.BackendSpec], config: md.MoEConfig,
                    caps: md.Capabilities, excluded: frozenset[str] = frozenset()) -> str | None:
    """The model: highest priority, then name, among non-excluded accepting backends."""
    for spec in sorted(specs, key=lambda s: (-s.priority, s.name)):
        if spec.name in excluded:
            continue
        if spec.backend.gate.accepts(config, caps):  # type: ignore[attr-defined]
            return spec.name
    return None


@st.composite
def routing(draw: st.DrawFn, config: md.MoEConfig, max_tokens: int = 40, min_tokens: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states, topk_weights, topk_ids) on fresh random data, via select_experts."""
    tokens = draw(st.integers(min(min_tokens, max_tokens), max_tokens))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=g).to(config.dtype)
    logits = torch.randn(tokens, config.num_experts, generator=g) * 2
    scoring = draw(st.sampled_from(("softmax", "sigmoid")))
    groups = None
    kwargs: dict[str, Any] = {}
    divisors = [d for d in range(2, config.num_experts + 1) if config.num_experts % d == 0]
    if divisors and draw(st.booleans()):
        groups = draw(st.sampled_from(divisors))
        per = config.num_experts // groups
        min_groups = -(-config.top_k // per)
        kwargs = dict(num_expert_group=groups, topk_group=draw(st.integers(min_groups, groups)))
    if draw(st.booleans()):
        kwargs["correction_bias"] = torch.randn(config.num_experts, generator=g) * 0.1
    tw, ids = md.select_experts(
        logits, config.top_k, scoring=scoring, renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from((1.0, 2.5))), **kwargs)
    return x, tw, ids


# -- quantized weights -----------------------------------------------------------------------
def quant_schemes() -> st.SearchStrategy[md.QuantScheme]:
    """Every valid scheme: int8 per channel or g32; int4 g32/64/128, symmetric or not."""
    int8 = st.sampled_from([None, 32]).map(lambda g: md.QuantScheme("int8", group_size=g))
    int4 = st.builds(lambda g, sym: md.QuantScheme("int4", group_size=g, symmetric=sym),
                     st.sampled_from([32, 64, 128]), st.booleans())
    return st.one_of(int8, int4)


@st.composite
def quantizable_experts(draw: st.DrawFn, scheme: md.QuantScheme, max_experts: int = 3,
                        max_groups: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random float32 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` with H and I multiples
    of the scheme's group (of 32 per channel), scaled by a drawn magnitude; sometimes a row
    of zeros (a zero scale) and one large outlier."""
    step = scheme.group_size or 32
    e = draw(st.integers(1, max_experts))
    h = step * draw(st.integers(1, max_groups))
    i = step * draw(st.integers(1, max_groups))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 30.0]))
    w13 = torch.randn(e, 2 * i, h, generator=g) * scale
    w2 = torch.randn(e, h, i, generator=g) * scale
    if draw(st.booleans()):
        w13[0, 0] = 0.0
    if draw(st.booleans()):
        w2[-1, -1, 0] = 20 * scale
    return w13, w2
