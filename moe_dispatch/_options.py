"""A layer's options, from its arguments and the environment, validated once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import attrs

from ._capabilities import Capabilities
from ._errors import InvalidArgumentError, InvalidTypeError

POLICIES = ("priority", "fastest")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@attrs.frozen(slots=True)
class TuningOptions:
    """policy="fastest": how many backends, up to which token count, within what budget,
    and where the tuned table persists (None: the default file; False: nowhere)."""

    max_candidates: int | None = None
    max_tokens: int = 512
    budget_s: float = 60.0
    cache: str | Path | bool | None = None


@attrs.frozen(slots=True)
class LayerOptions:
    """Everything a :class:`~moe_dispatch.MoELayer` was asked for besides its config."""

    backend: str | None = None
    exclude: tuple[str, ...] = ()
    capabilities: Capabilities | None = None
    strict: bool = False
    keep_canonical: bool = True
    policy: str = "priority"
    tuning: TuningOptions = TuningOptions()

    @classmethod
    def build(cls, *, backend: str | None, exclude: Iterable[str] | str,
              capabilities: Capabilities | None, strict: bool | None, keep_canonical: bool,
              policy: str | None, max_candidates: int | None, tune_max_tokens: int,
              tune_budget_s: float, tuning_cache: str | os.PathLike | bool | None) -> "LayerOptions":
        """Validate the arguments; env ``MOE_DISPATCH_STRICT`` / ``MOE_DISPATCH_POLICY``
        fill in what was not given."""
        if capabilities is not None and not isinstance(capabilities, Capabilities):
            raise InvalidTypeError("capabilities", capabilities, "a moe_dispatch.Capabilities or None")
        policy = policy if policy is not None else (os.environ.get("MOE_DISPATCH_POLICY") or "priority")
        if policy not in POLICIES:
            raise InvalidArgumentError("policy", policy, f"one of {POLICIES}")
        if max_candidates is not None and (not isinstance(max_candidates, int) or max_candidates < 1):
            raise InvalidArgumentError("max_candidates", max_candidates, "a positive int or None")
        if not isinstance(tune_max_tokens, int) or tune_max_tokens < 1:
            raise InvalidArgumentError("tune_max_tokens", tune_max_tokens, "a positive int")
        cache = tuning_cache if isinstance(tuning_cache, (bool, type(None))) else Path(tuning_cache)
        return cls(backend=backend, exclude=(exclude,) if isinstance(exclude, str) else tuple(exclude),
                   capabilities=capabilities,
                   strict=env_flag("MOE_DISPATCH_STRICT") if strict is None else bool(strict),
                   keep_canonical=bool(keep_canonical), policy=policy,
                   tuning=TuningOptions(max_candidates, tune_max_tokens, float(tune_budget_s), cache))
