"""vLLM plugin: vLLM's CPU MoE layers run their experts through moe-dispatch.

Installed with moe-dispatch (``pip install "moe-dispatch[vllm]"``), found by vLLM through the
entry point group ``vllm.general_plugins`` in every process it starts. For each
unquantized MoE layer on the CPU, after vLLM has loaded the weights and before it prepacks
them, a :class:`moe_dispatch.MoELayer` is built from the layer's parameters (read, never
modified) and runs the experts on vLLM's own routing. One INFO line per distinct layer
shape says which backend runs which token counts and why the others do not. A layer the
plugin cannot serve exactly (quantized experts, expert parallelism, an activation or
swigluoai constant it does not have) stays on vLLM's own path, with the reason logged.
After a weight update (``reload_weights``) a served layer is rebuilt from the new values.

Environment: ``MOE_DISPATCH_VLLM=0`` turns the plugin off (vLLM's path everywhere); the
layers honour moe-dispatch's own variables (``MOE_DISPATCH_POLICY``,
``MOE_DISPATCH_BACKEND``, ``MOE_DISPATCH_DISABLE``...). See docs/vllm.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .._resolver import forced_name
from ..kernels._native import switched_off

ENV = "MOE_DISPATCH_VLLM"
LOGGER_NAME = "vllm.moe_dispatch"  # under "vllm": vLLM's handlers and levels apply
# MoELayer keyword arguments for the layers the plugin builds (set before the engine starts;
# the engine's worker processes inherit only what the environment says).
LAYER_OPTIONS: dict[str, Any] = {}
EXCLUDE_ENV = "MOE_DISPATCH_VLLM_EXCLUDE"
# The host name backends give in BackendSpec.avoid_hosts to be left out of the plugin's
# layers by default: for what they do to the engine around them, which a layer's own tuning
# cannot see (routed inside vLLM's CPU worker, one backend slowed the whole engine, the other
# kernels' calls included: docs/vllm.md). EXCLUDE_ENV (a comma list; empty: none) replaces
# that default. A forced backend (MOE_DISPATCH_BACKEND) is never left out.
HOST = "vllm"


def default_exclude() -> tuple[str, ...]:
    """The registered backends that declare they avoid this host, in priority order."""
    from .._registry import get_registry
    return tuple(r.name for r in get_registry().snapshot().records if HOST in r.spec.avoid_hosts)


def layer_options() -> dict[str, Any]:
    """The MoELayer keyword arguments of the plugin's layers: LAYER_OPTIONS, plus the
    backends left out (EXCLUDE_ENV, by default :func:`default_exclude`) when none is forced."""
    options = dict(LAYER_OPTIONS)
    if options.get("backend") or forced_name(None):  # the resolver's reading of the variable
        return options
    listed = os.environ.get(EXCLUDE_ENV)
    names = (default_exclude() if listed is None
             else tuple(n.strip() for n in listed.split(",") if n.strip()))
    if names:
        options["exclude"] = tuple(options.get("exclude", ())) + names
    return options


def enabled() -> bool:
    """Whether the plugin is on (``MOE_DISPATCH_VLLM`` is unset or not 0/off/false/no)."""
    return not switched_off(ENV)


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
        return init_logger(LOGGER_NAME)
    except Exception:  # vLLM's logger module moved: a plain logger under the same name
        return logging.getLogger(LOGGER_NAME)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; never raises)."""
    logger = _logger()
    if not enabled():
        logger.info("moe-dispatch: plugin off (%s=%s); vLLM's MoE path runs", ENV,
                    os.environ.get(ENV))
        return
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as um
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from ._seam import QUANTIZED, install
        quantized = [getattr(cpu_moe, n) for n in QUANTIZED if hasattr(cpu_moe, n)]
        install(cpu_moe.CPUUnquantizedExperts, quantized, layer_options, logger,
                um.UnquantizedFusedMoEMethod)
    except Exception as exc:  # a failing plugin never takes vLLM down
        logger.warning("moe-dispatch: plugin not installed (%s: %s); vLLM's MoE path runs",
                       type(exc).__name__, exc)


__all__ = ["ENV", "EXCLUDE_ENV", "HOST", "LAYER_OPTIONS", "LOGGER_NAME", "default_exclude", "enabled",
           "layer_options", "register"]
