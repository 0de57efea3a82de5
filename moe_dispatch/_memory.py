"""How many copies of its weights a layer may hold: ``max_weight_copies``.

Each backend declares the copies a prepared state of it keeps (``BackendSpec.weight_copies``,
in the bytes of the layer's weight format: its private layout, and a kernel cache beside it
if it has one). A layer adds up the copies of the backends it prepares. For quantized
weights the default limit is one copy (``QUANTIZED_COPIES``, with room for a kernel's side
tables): memory is what quantizing is for, and a layer routed to two kernels, each with its
own copy, would hold as much as the float weights. Float weights have no limit by default.

The limit works in two places: the resolver leaves out every backend that alone holds more
(``over_budget``: never prepared, so never timed, and its caches never filled), and the
default routing keeps to a set of backends that together fit (``within_memory``).
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Callable, Mapping

from ._buckets import Timings, fastest_near
from ._config import MoEConfig
from ._errors import InvalidArgumentError
from ._spec import BackendRecord

QUANTIZED_COPIES = 1.1


def check_copies_arg(value: object) -> float | None:
    """A layer's ``max_weight_copies`` argument, validated: None or a number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidArgumentError("max_weight_copies", value, "a number of copies >= 0 "
                                   "(float('inf'): no limit), or None for the default")
    return float(value)


def weight_budget(config: MoEConfig, asked: float | None) -> float:
    """The layer's limit: ``asked``, else one copy for quantized weights and none for float."""
    if asked is not None:
        return float(asked)
    return QUANTIZED_COPIES if config.weight_scheme is not None else math.inf


def over_budget(rec: BackendRecord, config: MoEConfig, budget: float) -> str | None:
    """Why ``rec`` is left out under ``budget`` (None: it fits)."""
    copies = rec.spec.copies(config.weight_format)
    if copies <= budget:
        return None
    fmt = "float" if config.weight_scheme is None else config.weight_scheme.describe()
    return (f"holds {copies:g} copies of the {fmt} weights (its weight_copies), over the "
            f"layer's max_weight_copies={budget:g}")


def within_memory(table: dict[int, str], timings: Timings, sizes: list[int],
                  copies: Mapping[str, float], budget: float,
                  serves: Callable[[str, int], bool] | None = None) -> tuple[dict[int, str], str]:
    """``table`` if its backends together fit ``budget``; else the table over the set of
    candidates that fits and loses least to the unrestricted fastest (the sum over the
    measured buckets of log(set's best / best)), fewer copies on a tie; and a note. A
    bucket moved to another backend goes only to one that ``serves(name, T)`` (its
    ``max_tokens``)."""
    def ok(n: str, t: int) -> bool:
        return serves is None or serves(n, t)

    used = sorted(set(table.values()))
    if sum(copies[n] for n in used) <= budget or not timings:
        return table, ""
    names = sorted({n for row in timings.values() for n in row if n in copies})

    def loss(subset: tuple[str, ...]) -> float:
        total = 0.0
        for row in timings.values():
            mine = [row[n] for n in subset if n in row]
            total += math.log(min(mine) / min(row.values())) if mine else math.inf
        return total

    fits = [s for r in range(1, len(names) + 1) for s in combinations(names, r)
            if sum(copies[n] for n in s) <= budget]
    if not fits:
        return table, ""
    best = min(fits, key=lambda s: (loss(s), sum(copies[n] for n in s), s))
    out = {t: table[t] if table[t] in best else
           fastest_near(timings, sizes, t, lambda n, t=t: n in best and ok(n, t))
           or next((n for n in best if ok(n, t)), table[t]) for t in sizes}
    left = ", ".join(f"{n} ({copies[n]:g})" for n in used if n not in best)
    return out, (f"routed within max_weight_copies={budget:g}: {', '.join(best)} "
                 f"(the fastest per bucket, {' + '.join(used)}, would hold "
                 f"{sum(copies[n] for n in used):g} copies; left out: {left})")
