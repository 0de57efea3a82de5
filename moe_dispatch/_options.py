"""A layer's options, from its arguments and the environment, validated once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import attrs

from ._capabilities import Capabilities
from ._errors import InvalidArgumentError, InvalidTypeError
from ._memory import check_copies_arg

POLICIES = ("auto", "priority", "fastest")
DEFAULT_POLICY = "auto"
# Per policy: (max_candidates, budget_s). "auto" is the default, so its first prepare() of a
# shape is bounded in time and memory (every candidate's prepared state exists while timing);
# "fastest" is asked for, and measures everything.
POLICY_DEFAULTS: dict[str, tuple[int | None, float]] = {"auto": (3, 20.0), "fastest": (None, 60.0)}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@attrs.frozen(slots=True)
class TuningOptions:
    """policy="auto" / "fastest": how many backends, up to which token count, within what
    budget, where the tuned table persists (None: the default file; False: nowhere), and
    whether buckets are probed (``adaptive``, "auto") or all measured ("fastest")."""

    max_candidates: int | None = POLICY_DEFAULTS[DEFAULT_POLICY][0]
    max_tokens: int = 512
    budget_s: float = POLICY_DEFAULTS[DEFAULT_POLICY][1]
    cache: str | Path | bool | None = None
    adaptive: bool = True
    max_weight_copies: float | None = None  # None: the format's default (_memory)


@attrs.frozen(slots=True)
class LayerOptions:
    """Everything a :class:`~moe_dispatch.MoELayer` was asked for besides its config."""

    backend: str | None = None
    exclude: tuple[str, ...] = ()
    capabilities: Capabilities | None = None
    strict: bool = False
    keep_canonical: bool = True
    policy: str = DEFAULT_POLICY
    tuning: TuningOptions = TuningOptions()

    @property
    def max_weight_copies(self) -> float | None:
        return self.tuning.max_weight_copies

    @classmethod
    def build(cls, *, backend: str | None, exclude: Iterable[str] | str,
              capabilities: Capabilities | None, strict: bool | None, keep_canonical: bool,
              policy: str | None, max_candidates: int | None, tune_max_tokens: int,
              tune_budget_s: float | None, tuning_cache: str | os.PathLike | bool | None,
              max_weight_copies: float | None = None) -> "LayerOptions":
        """Validate the arguments; env ``MOE_DISPATCH_STRICT`` / ``MOE_DISPATCH_POLICY``
        fill in what was not given."""
        if capabilities is not None and not isinstance(capabilities, Capabilities):
            raise InvalidTypeError("capabilities", capabilities, "a moe_dispatch.Capabilities or None")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidTypeError("strict", strict, "a bool, or None for env MOE_DISPATCH_STRICT")
        if not isinstance(keep_canonical, bool):
            raise InvalidTypeError("keep_canonical", keep_canonical, "a bool")
        policy = _policy(policy)
        if max_candidates is not None and not _positive_int(max_candidates):
            raise InvalidArgumentError("max_candidates", max_candidates, "a positive int or None")
        if not _positive_int(tune_max_tokens):
            raise InvalidArgumentError("tune_max_tokens", tune_max_tokens, "a positive int")
        if tune_budget_s is not None and (isinstance(tune_budget_s, bool) or not isinstance(
                tune_budget_s, (int, float)) or not tune_budget_s >= 0):
            raise InvalidArgumentError("tune_budget_s", tune_budget_s,
                                       "a number of seconds >= 0, or None for the policy's default")
        if not isinstance(tuning_cache, (bool, type(None), str, os.PathLike)):
            raise InvalidTypeError("tuning_cache", tuning_cache,
                                   "a path (str or os.PathLike), False (no cache) or None (the default file)")
        cands, budget = POLICY_DEFAULTS.get(policy, (None, 0.0))
        cache = tuning_cache if isinstance(tuning_cache, (bool, type(None))) else Path(tuning_cache)
        return cls(backend=backend, exclude=_exclude(exclude), capabilities=capabilities,
                   strict=env_flag("MOE_DISPATCH_STRICT") if strict is None else strict,
                   keep_canonical=keep_canonical, policy=policy,
                   tuning=TuningOptions(
                       max_candidates if max_candidates is not None else cands, tune_max_tokens,
                       float(budget if tune_budget_s is None else tune_budget_s), cache,
                       adaptive=policy != "fastest",
                       max_weight_copies=check_copies_arg(max_weight_copies)))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _policy(policy: object) -> str:
    """The ``policy`` argument as given, else env ``MOE_DISPATCH_POLICY`` (case and spaces
    ignored; blank is unset), else the default."""
    if policy is None:
        raw = os.environ.get("MOE_DISPATCH_POLICY", "")
        env = raw.strip().lower()
        if env and env not in POLICIES:
            raise InvalidArgumentError("MOE_DISPATCH_POLICY", raw, f"one of {POLICIES}, or unset")
        return env or DEFAULT_POLICY
    if not isinstance(policy, str):
        raise InvalidTypeError("policy", policy, f"one of {POLICIES} or None")
    if policy not in POLICIES:
        raise InvalidArgumentError("policy", policy, f"one of {POLICIES}")
    return policy


def _exclude(exclude: Iterable[str] | str) -> tuple[str, ...]:
    """A backend name or an iterable of them, as ``resolve`` takes ``exclude``."""
    if isinstance(exclude, str):
        return (exclude,)
    try:
        names: tuple[str, ...] | None = tuple(exclude)
    except TypeError:  # not iterable
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise InvalidTypeError("exclude", exclude, "a backend name (str) or an iterable of them")
    return names
