"""moe-dispatch: pick and run the fastest correct MoE kernel on this CPU.

The public facade. Everything documented lives here; the underscore modules behind it
are private and may move.
"""

from __future__ import annotations

from typing import Any

from ._capabilities import Capabilities
from ._config import Activation, MoEConfig
from ._decision import Decision, accept, reject
from ._errors import (BackendRejectedError, InvalidArgumentError, InvalidTypeError,
                      KernelError, LayerStateError, MoEDispatchError, NoBackendError,
                      NotDifferentiableError, PluginError, UnknownBackendError, WeightsModifiedError)
from ._compile import moe_experts
from ._expert_parallel import ExpertParallelLayer
from ._layer import MoELayer
from ._plan import Demotion, ExecutionPlan, Route
from ._quant import QuantizedExperts, QuantizedTensor, QuantScheme, quantize_experts
from ._gguf import experts_from_gguf
from ._compressed import experts_from_compressed_tensors
from ._registry import PluginFailure, Registry, get_registry, use_registry
from ._resolution import Candidate, Resolution, Status
from ._resolver import call_check, clear_cache, explain, resolve
from ._spec import (ENTRY_POINT_GROUP, Backend, BackendBase, BackendSpec, FastGuard,
                    LayerWeights, hookimpl, hookspec)
from .routing import select_experts
from . import kernels

__version__ = "0.1.0"


def available_backends() -> list[str]:
    """Registered backend names in priority order (highest first)."""
    return get_registry().snapshot().names()


def plugin_failures() -> list[PluginFailure]:
    """Plugins that failed to load or were excluded, with the reason."""
    return list(get_registry().snapshot().failures)


def register(plugin: Any, name: str | None = None) -> str:
    """Register a backend plugin (a module or object with ``@hookimpl``), or a BackendSpec."""
    return get_registry().register(plugin, name)


def unregister(name: str) -> None:
    """Unregister a plugin by its name, or the plugin that provides backend ``name``."""
    get_registry().unregister(name)


def reload_plugins() -> None:
    """Discover entry-point plugins again (re-reads MOE_DISPATCH_DISABLE/_PLUGINS)."""
    get_registry().reload()


__all__ = [
    "Activation", "Backend", "BackendBase", "BackendRejectedError", "BackendSpec", "Candidate",
    "Capabilities", "Decision", "Demotion", "ENTRY_POINT_GROUP", "ExecutionPlan",
    "ExpertParallelLayer", "FastGuard", "InvalidArgumentError", "InvalidTypeError", "KernelError",
    "LayerStateError", "LayerWeights", "MoEConfig", "MoEDispatchError", "MoELayer",
    "NoBackendError", "NotDifferentiableError", "PluginError", "PluginFailure", "QuantScheme", "QuantizedExperts",
    "QuantizedTensor", "Registry", "Resolution", "Route", "Status",
    "UnknownBackendError", "WeightsModifiedError", "accept", "available_backends", "call_check",
    "clear_cache", "experts_from_compressed_tensors", "experts_from_gguf", "explain", "hookimpl", "hookspec", "kernels", "moe_experts", "plugin_failures",
    "quantize_experts", "register", "reject", "reload_plugins", "resolve", "select_experts", "unregister", "use_registry",
]
