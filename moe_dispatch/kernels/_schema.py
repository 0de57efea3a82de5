"""Op schema checks by argument names and types: the one policy every backend uses.

An op's schema string changes with its library's version. What a caller depends on is the
positional arguments it passes (name and type, in order) and that nothing new is required;
new optional arguments, renamed return annotations or alias marks are harmless.
"""

from __future__ import annotations

from typing import Sequence

import torch

Argument = tuple[str, str]  # (name, type as torch prints it: "Tensor", "Optional[Tensor]", "int")


def schema_arguments(schema: str) -> tuple[Argument, ...]:
    """The (name, type) of every argument of a schema string (raises ValueError if unparsable)."""
    try:
        parsed = torch._C.parse_schema(schema)
    except Exception as exc:
        raise ValueError(f"cannot parse the op schema {schema!r} ({exc})") from None
    return tuple((a.name, str(a.type)) for a in parsed.arguments)


def schema_problem(schema: str | None, expected: Sequence[Argument]) -> str | None:
    """None when ``schema`` starts with exactly the ``expected`` (name, type) arguments and
    has no further required ones; otherwise what differs, in words."""
    if schema is None:
        return "the op is not registered in this process"
    try:
        parsed = torch._C.parse_schema(schema)
    except Exception as exc:  # an unparsable schema is a mismatch, not a crash
        return f"cannot parse the op schema ({exc})"
    args = [(a.name, str(a.type)) for a in parsed.arguments]
    want = [tuple(a) for a in expected]
    if args[:len(want)] != want:
        fmt = lambda items: ", ".join(f"{t} {n}" for n, t in items)  # noqa: E731
        return f"expected arguments ({fmt(want)}), found ({fmt(args[:len(want)])})"
    extra = [a.name for a in parsed.arguments[len(want):] if not a.has_default_value()]
    if extra:
        return f"new required arguments {extra}"
    return None


def op_problem(capabilities: object, op: str, expected: Sequence[Argument], *, source: str = "",
               hint: str = "") -> str | None:
    """A gate's whole op check: None when ``capabilities.op_schema(op)`` exists and passes
    :func:`schema_problem`, else the rejection reason. ``source`` says where the op comes
    from (e.g. "torch 2.13.0"), ``hint`` how to get it when it is absent."""
    where = f" ({source})" if source else ""
    schema = capabilities.op_schema(op)  # type: ignore[attr-defined]
    if schema is None:
        return f"{op} is not registered in this process{where}" + (f"; {hint}" if hint else "")
    problem = schema_problem(schema, expected)
    if problem:
        return f"{op}{where} has a different signature than this backend was written for: {problem}"
    return None
