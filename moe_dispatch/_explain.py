"""Rendering a resolution as the human-readable ``explain`` table."""

from __future__ import annotations

from typing import Any

# Rendering imports nothing it renders: Resolution.explain() calls format_table, so an import
# of _resolution here would be a cycle. ``res`` is a Resolution, ``plan`` an ExecutionPlan.

# Status values (Status is a str enum: its members compare equal to these).
_STANDBY, _NOT_FORCED, _CHOSEN = "standby", "not forced", "chosen"


def _reason(res: Any, status: str, reason: str) -> str:
    if status == _STANDBY:
        return "accepted; a higher-priority backend was chosen" + (f" ({reason})" if reason else "")
    if status == _NOT_FORCED:
        return f"accepted; not the forced backend ({res.forced})"
    if status == _CHOSEN and not reason:
        return "accepted" + (" (forced)" if res.forced else "")
    return reason


def format_table(res: Any) -> str:
    """Order, backend, priority, result, reason; then notes, plugin failures, the choice."""
    caps = res.capabilities
    head = [f"moe-dispatch resolution ({res.stage} stage) for {res.config.describe()}",
            f"machine: {caps.fingerprint()}"]
    if res.forced:
        head.append(f"forced: {res.forced}")
    if res.excluded:
        head.append(f"excluded: {', '.join(sorted(res.excluded))}")
    rows = [("#", "backend", "priority", "result", "reason")]
    for i, c in enumerate(res.candidates, 1):
        rows.append((str(i), c.name, str(c.priority), str(c.status), _reason(res, c.status, c.reason)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    out = head + [""] + lines + list(res.notes)
    if res.failures:
        out += ["", "plugins that failed to load or were excluded:"]
        out += [f"  {f.plugin}: {f.error} [{f.source}]" for f in res.failures]
    if res.backend:
        out += ["", f"=> {res.backend}"]
    return "\n".join(out)


def explain_layer(res: Any, plan: Any) -> str:
    """A layer's explanation: its resolution, then how its plan runs (native entry, tuning)."""
    text = format_table(res)
    if plan is None:
        return text + "\n(config stage only: call prepare() for the layer-level decision)"
    natives = plan.natives
    if natives is not None:
        served = sorted({pair[1].name for pair in natives if pair is not None})
        text += (f"\nforward: plain calls take the native entry (fast_call) of {', '.join(served)}; "
                 "others the Python path")
    if plan.tuned:
        lines = ["", plan.tuning_note, "routed per token count (T <= bucket; larger T: the last row):"]
        for t, row in plan.tuned.items():
            times = ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(row["ms"].items(),
                                                                     key=lambda kv: kv[1]))
            lines.append(f"  T<={t:<5} {row['winner']:<12} {row['source']}"
                         + (f" ({times})" if times else ""))
        text += "\n".join(lines)
    return text
