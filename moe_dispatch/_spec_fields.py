"""The validators and converters of :class:`~moe_dispatch.BackendSpec`'s fields: a plugin's
record is checked once, when the host collects it, and a bad field names itself."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import attrs

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]*$")


def normalize_name(name: str) -> str:
    """Backend names are case-insensitive; ``-`` and ``_`` are the same. Normalised once."""
    return name.strip().lower().replace("-", "_")


_REQUIRED_METHODS = ("supports_config", "supports_layer", "process_weights", "apply")


def check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"BackendSpec.name must be a str, got {type(value).__name__} {value!r}")
    if not _NAME_RE.match(value):
        raise ValueError(f"BackendSpec.name {value!r} must match {_NAME_RE.pattern} "
                         "after normalisation (lower case, '-' becomes '_')")


def normalize(value: Any) -> Any:
    return normalize_name(value) if isinstance(value, str) else value


def check_priority(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"BackendSpec.priority must be an int, got {type(value).__name__}")


def ops_converter(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(v)) for k, v in items))


def names_converter(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    return tuple(sorted({str(v) for v in value}))


WEIGHT_FORMATS = ("float", "int8", "int4")


def check_weights(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    unknown = [v for v in value if v not in WEIGHT_FORMATS]
    if unknown or not value:
        raise ValueError(f"BackendSpec.weights={list(value)}: expected a non-empty subset of "
                          f"{list(WEIGHT_FORMATS)}")


def limit_ok(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def per_format_converter(value: Any) -> Any:
    # A per-format mapping (max_tokens, weight_copies) becomes sorted (format, value) pairs:
    # hashable, like ``ops``; a single value stays as it is.
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), v) for k, v in value.items()))
    return value


def check_max_tokens(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, tuple):
        bad = [(f, v) for f, v in value if f not in WEIGHT_FORMATS or not limit_ok(v)]
        if bad:
            raise ValueError(f"BackendSpec.max_tokens={dict(value)!r}: expected formats of "
                             f"{list(WEIGHT_FORMATS)} mapped to a positive int or None")
    elif not limit_ok(value):
        raise ValueError(f"BackendSpec.max_tokens={value!r}: expected a positive int, None, or "
                         f"a mapping of weight formats ({', '.join(WEIGHT_FORMATS)}) to those")


def check_hosts(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    bad = [v for v in value if not _NAME_RE.match(v)]
    if bad:
        raise ValueError(f"BackendSpec.avoid_hosts={list(value)}: host names match "
                         f"{_NAME_RE.pattern} (e.g. 'vllm')")


def check_backend(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(value, m, None))]
    if missing:
        raise TypeError(f"BackendSpec.backend {type(value).__name__} lacks callable "
                        f"{', '.join(missing)}")


def copies_ok(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def check_copies(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, tuple):
        if all(f in WEIGHT_FORMATS and copies_ok(v) for f, v in value):
            return
    elif copies_ok(value):
        return
    raise ValueError(f"BackendSpec.weight_copies={value!r}: expected a number >= 0, or a "
                     f"mapping of weight formats ({', '.join(WEIGHT_FORMATS)}) to those")
