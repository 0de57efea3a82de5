"""Decision: a backend's answer to "can you run this?"."""

from __future__ import annotations

import attrs


def _reason_ok(instance: "Decision", attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"Decision.reason must be a str, got {type(value).__name__}")
    if not instance.accepted and not value.strip():
        raise ValueError("a rejecting Decision needs a non-empty reason a user can act on")


@attrs.frozen(slots=True)
class Decision:
    """``accepted`` plus a ``reason``; a rejection always carries a non-empty reason."""

    accepted: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    reason: str = attrs.field(default="", validator=_reason_ok)

    def __bool__(self) -> bool:
        return self.accepted


def accept(reason: str = "") -> Decision:
    """Accept, optionally saying why (shown by ``explain``)."""
    return Decision(True, reason)


def reject(reason: str) -> Decision:
    """Reject with a reason a user can act on."""
    return Decision(False, reason)
