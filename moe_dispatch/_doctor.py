"""``moe-dispatch doctor``: this machine, every backend as it describes itself, plugin
failures and the environment. Nothing here knows a backend by name: versions, status
lines, expected op schemas and env variables come from each backend's record."""

from __future__ import annotations

import json
import os
from typing import Any

from ._capabilities import Capabilities
from ._registry import get_registry
from ._spec import BackendRecord
from . import _call_slot
from .kernels import huge_pages_used, schema_arguments, schema_problem, thp_mode

FRAMEWORK_ENV = ("MOE_DISPATCH_BACKEND", "MOE_DISPATCH_DISABLE", "MOE_DISPATCH_PLUGINS",
                 "MOE_DISPATCH_STRICT", "MOE_DISPATCH_POLICY", "MOE_DISPATCH_TUNING_CACHE",
                 "MOE_DISPATCH_HUGE_PAGES", "OMP_NUM_THREADS")
ISA = ("avx2", "fma_f16c", "avx512", "avx512_bw_vl", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "mkldnn")


def env_vars(records: tuple[BackendRecord, ...]) -> tuple[str, ...]:
    """The framework's variables, then every backend's (``BackendSpec.env_vars``)."""
    declared = sorted({v for r in records for v in r.spec.env_vars} - set(FRAMEWORK_ENV))
    return FRAMEWORK_ENV + tuple(declared)


def backend_diagnostics(rec: BackendRecord) -> dict[str, str]:
    fn = getattr(rec.spec.backend, "diagnostics", None)
    if fn is None:
        return {}
    try:
        return {str(k): str(v) for k, v in dict(fn()).items()}
    except Exception as exc:  # a backend's status line never takes doctor down
        return {"diagnostics": f"failed: {type(exc).__name__}: {exc}"}


def _op_status(caps: Capabilities, name: str, expected: str) -> str:
    """The gates' policy (arguments by name and type), not string equality."""
    got = caps.op_schema(name)
    if got is None:
        return "missing"
    problem = schema_problem(got, schema_arguments(expected))
    return "ok" if problem is None else f"differs: {problem}"


def collect() -> dict[str, Any]:
    caps = Capabilities.detect()
    snap = get_registry().snapshot()
    return dict(
        cpu=dict(vendor=caps.cpu_vendor, model=caps.cpu_model, arch=caps.arch, family=caps.cpu_family,
                 model_id=caps.cpu_model_id, zen_generation=caps.zen_generation),
        isa={f: getattr(caps, f) for f in ISA}, threads=caps.threads, torch=caps.torch_version,
        huge_pages=dict(mode=thp_mode(), used=huge_pages_used()),
        call_slot=_call_slot.describe(),
        backends=[dict(name=r.name, priority=r.priority, source=r.source,
                       description=r.spec.description, version=r.spec.version,
                       diagnostics=backend_diagnostics(r),
                       ops={n: _op_status(caps, n, s) for n, s in r.spec.ops},
                       env_vars=list(r.spec.env_vars)) for r in snap.records],
        plugin_failures=[dict(plugin=f.plugin, source=f.source, error=f.error) for f in snap.failures],
        env={v: os.environ[v] for v in env_vars(snap.records) if v in os.environ},
        env_vars=list(env_vars(snap.records)))


def _pages_line(hp: dict[str, Any]) -> str:
    how = ("backends' prepacked weights are allocated with MADV_HUGEPAGE" if hp["used"] else
           "off (MOE_DISPATCH_HUGE_PAGES=0)" if hp["mode"] in ("always", "madvise") else
           "not offered by the OS")
    return f"memory    transparent huge pages: {hp['mode']}; {how}"


def render(data: dict[str, Any]) -> str:
    c = data["cpu"]
    out = [f"CPU       {c['vendor']} {c['model']} ({c['arch']}, family {c['family']}, model "
           f"{c['model_id']}, Zen generation {c['zen_generation'] or '-'})",
           "ISA       " + "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in data["isa"].items()),
           f"threads   {data['threads']}", f"torch     {data['torch']}", _pages_line(data["huge_pages"]),
           f"calls     MoELayer's C call slot: {data['call_slot']}", "backends (priority order):"]
    for b in data["backends"]:
        out.append(f"  {b['priority']:>5}  {b['name']:<14} {b['version'] or '-':<12} {b['source']}")
        for label, text in b["diagnostics"].items():
            out.append(f"{'':22}{label}: {text}")
        for name, status in b["ops"].items():
            out.append(f"{'':22}op {name}: {status}")
    if data["plugin_failures"]:
        out.append("plugins that failed to load:")
        out += [f"  {f['plugin']}: {f['error']} [{f['source']}]" for f in data["plugin_failures"]]
    out.append("environment:")
    out += [f"  {v}={data['env'][v]}" if v in data["env"] else f"  {v} (unset)" for v in data["env_vars"]]
    return "\n".join(out)


def main(as_json: bool) -> int:
    data = collect()
    print(json.dumps(data, indent=2) if as_json else render(data))
    return 0
