"""The layer configuration: a frozen value object, validated at the boundary."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from ._errors import InvalidArgumentError, InvalidTypeError
from ._quant import QuantScheme


class Activation(str, enum.Enum):
    """Gated activations, named by their exact math (see docs/architecture.md)."""

    SILU = "silu"  # silu(gate) * up, gate = h[:I], up = h[I:]
    GELU = "gelu"  # erf GELU(gate) * up
    GELU_TANH = "gelu_tanh"  # tanh-approximated GELU(gate) * up
    SWIGLUOAI = "swigluoai"  # gpt-oss clamped SwiGLU, gate/up interleaved

    def __str__(self) -> str:
        return self.value


SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32, torch.float16)
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16}


def to_activation(value: Any) -> Activation:
    """Convert a string or :class:`Activation` to an :class:`Activation`, or raise naming the field."""
    if isinstance(value, Activation):
        return value
    if isinstance(value, str):
        try:
            return Activation(value)
        except ValueError:
            pass
    raise InvalidArgumentError(
        "activation", value, "one of " + ", ".join(repr(a.value) for a in Activation))


def to_dtype(value: Any) -> torch.dtype:
    """Convert a ``torch.dtype`` or a dtype name (``"bf16"``, ``"float32"``...) to a dtype."""
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        value = _DTYPE_NAMES[value.lower()]
    if isinstance(value, torch.dtype) and value in SUPPORTED_DTYPES:
        return value
    raise InvalidArgumentError(
        "dtype", value, "torch.bfloat16, torch.float32 or torch.float16")


PLACEMENTS = ("contiguous", "round_robin")


def expert_placement(num_experts: int, ep_size: int, placement: str) -> list[tuple[int, ...]]:
    """The global expert ids of every rank."""
    if placement == "round_robin":
        return [tuple(range(r, num_experts, ep_size)) for r in range(ep_size)]
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (1 if r < extra else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # bool is an int subclass; True experts is a bug, not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(attribute.name, value, "a positive int")
    if value <= 0:
        raise InvalidArgumentError(attribute.name, value, "a positive int (> 0)")


def _strict_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidTypeError(attribute.name, value, "True or False")


@attrs.frozen(slots=True, cache_hash=False)
class MoEConfig:
    """What a MoE layer computes, before any weight exists.

    Frozen and hashable: it keys the resolution cache. Every field is validated on
    construction; a bad value raises :class:`~moe_dispatch.InvalidArgumentError` or
    :class:`~moe_dispatch.InvalidTypeError` naming the field.
    """

    num_experts: int = attrs.field(validator=_positive_int)
    top_k: int = attrs.field(validator=_positive_int)
    hidden_size: int = attrs.field(validator=_positive_int)
    intermediate_size: int = attrs.field(validator=_positive_int)
    activation: Activation = attrs.field(default=Activation.SILU, converter=to_activation)
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=to_dtype)
    has_bias: bool = attrs.field(default=False, validator=_strict_bool)
    apply_router_weight_on_input: bool = attrs.field(default=False, validator=_strict_bool)
    # Expert parallelism: num_experts is the global count; this rank holds a subset.
    ep_size: int = attrs.field(default=1, validator=_positive_int)
    ep_rank: int = attrs.field(default=0)
    placement: str = attrs.field(default="contiguous")
    # Quantized expert weights (docs/quantization.md); None: float weights of ``dtype``.
    # ``dtype`` stays the activations' (and biases') dtype either way.
    weight_scheme: QuantScheme | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.ep_rank, int) or isinstance(self.ep_rank, bool) or not (
                0 <= self.ep_rank < self.ep_size):
            raise InvalidArgumentError("ep_rank", self.ep_rank, f"an int in [0, ep_size={self.ep_size})")
        if self.ep_size > self.num_experts:
            raise InvalidArgumentError("ep_size", self.ep_size,
                                       f"<= num_experts ({self.num_experts}): every rank holds an expert")
        if self.placement not in PLACEMENTS:
            raise InvalidArgumentError("placement", self.placement, f"one of {PLACEMENTS}")
        if self.top_k > self.num_experts:
            raise InvalidArgumentError(
                "top_k", self.top_k, f"1 <= top_k <= num_experts ({self.num_experts})")
        scheme = self.weight_scheme
        if scheme is not None:
            if not isinstance(scheme, QuantScheme):
                raise InvalidTypeError("weight_scheme", scheme, "a moe_dispatch.QuantScheme or None")
            g = scheme.group_size
            if g is not None and (self.hidden_size % g or self.intermediate_size % g):
                raise InvalidArgumentError(
                    "weight_scheme", scheme.describe(), f"a group size that divides hidden_size="
                    f"{self.hidden_size} and intermediate_size={self.intermediate_size} (the "
                    "groups run along each projection's input)")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise InvalidArgumentError(
                "apply_router_weight_on_input", True,
                f"False when top_k > 1 (top_k={self.top_k}): scaling the input by one "
                "router weight is only defined for top_k == 1")

    @property
    def weight_format(self) -> str:
        """"float", or the scheme's kind ("int8", "int4"): what ``BackendSpec.weights`` lists."""
        return "float" if self.weight_scheme is None else self.weight_scheme.kind

    # -- expert parallelism ------------------------------------------------------------
    @property
    def is_expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def local_expert_ids(self) -> tuple[int, ...]:
        """Global ids of this rank's experts, in local order.

        ``contiguous``: rank r holds a block; the first ``E % ep_size`` ranks hold one more.
        ``round_robin``: rank r holds experts r, r + ep_size, r + 2 ep_size, ...
        """
        return expert_placement(self.num_experts, self.ep_size, self.placement)[self.ep_rank]

    @property
    def num_local_experts(self) -> int:
        return len(self.local_expert_ids)

    def expert_map(self) -> torch.Tensor:
        """int64 ``[E]``: global id -> local index on this rank, or -1 (vLLM's expert_map)."""
        out = torch.full((self.num_experts,), -1, dtype=torch.int64)
        out[list(self.local_expert_ids)] = torch.arange(self.num_local_experts)
        return out

    def local_config(self) -> "MoEConfig":
        """What this rank computes: its experts, one (token, slot) pair per row (top_k=1)."""
        return MoEConfig(self.num_local_experts, 1, self.hidden_size, self.intermediate_size,
                         activation=self.activation, dtype=self.dtype, has_bias=self.has_bias,
                         apply_router_weight_on_input=self.apply_router_weight_on_input,
                         weight_scheme=self.weight_scheme)

    # Shapes of the canonical weight layout (nn.Linear row-major); local experts only.
    @property
    def w13_shape(self) -> tuple[int, int, int]:
        return (self.num_local_experts, 2 * self.intermediate_size, self.hidden_size)

    @property
    def w2_shape(self) -> tuple[int, int, int]:
        return (self.num_local_experts, self.hidden_size, self.intermediate_size)

    @property
    def w13_bias_shape(self) -> tuple[int, int]:
        return (self.num_local_experts, 2 * self.intermediate_size)

    @property
    def w2_bias_shape(self) -> tuple[int, int]:
        return (self.num_local_experts, self.hidden_size)

    def describe(self) -> str:
        """A one-line summary used in logs and explanations."""
        flags = []
        if self.weight_scheme is not None:
            flags.append(f"{self.weight_scheme.describe()} weights")
        if self.has_bias:
            flags.append("bias")
        if self.apply_router_weight_on_input:
            flags.append("router-weight-on-input")
        if self.is_expert_parallel:
            flags.append(f"ep rank {self.ep_rank}/{self.ep_size} {self.placement}")
        extra = (", " + ", ".join(flags)) if flags else ""
        return (f"E={self.num_experts} top_k={self.top_k} H={self.hidden_size} "
                f"I={self.intermediate_size} {self.activation.value} "
                f"{dtype_name(self.dtype)}{extra}")
