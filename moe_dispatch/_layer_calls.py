"""How MoELayer runs a call: its ``__call__`` fast path, ``forward``, ``run``, the checked
Python path and the fallback when a kernel fails (a backend is demoted for the layer and a
new plan without it is swapped in). A base class of :class:`~moe_dispatch.MoELayer`, apart
from its building half (``_layer``) because every line here runs on every call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ._autograd import grad_enabled as _grad_enabled, run_recorded, wants_grad
from ._compile import keep_for_trace
from ._config import MoEConfig
from ._fastpath import COMPILER as _COMPILER, FLOAT_DTYPES as _FLOAT_DTYPES
from ._fastpath import GLOBAL_HOOKS as _GLOBAL_HOOKS, ID_DTYPES as _ID_DTYPES, TENSOR as _Tensor
from ._fastpath import dynamo_compiling as _dynamo_compiling, is_compiling as _is_compiling
from ._fastpath import tracing_state as _tracing_state
from ._errors import InvalidArgumentError, KernelError, LayerStateError, MoEDispatchError
from ._options import LayerOptions
from ._plan import Demotion, ExecutionPlan, Route, bad_output, good_output
from ._resolution import Resolution
from ._spec import BackendRecord, storage_id
from ._validation import check_forward
from .kernels import id_range, version_of


log = logging.getLogger("moe_dispatch")


class LayerCalls(torch.nn.Module):
    """The call path of a layer whose ``_plan`` the building half sets (``MoELayer``)."""

    config: MoEConfig
    options: LayerOptions
    _plan: ExecutionPlan | None
    _handle: int
    _lock: threading.RLock
    _demotions: list[Demotion]
    _config_resolution: Resolution

    @staticmethod
    def plain_forward(cls: type) -> bool:
        """Whether ``cls`` runs calls as this class does: ``__call__``'s fast path skips
        ``forward()``, so a subclass that overrides ``forward`` or ``run`` (to add, say, a
        shared expert) takes ``nn.Module``'s path."""
        return cls.forward is LayerCalls.forward and cls.run is LayerCalls.run

    def _build_plan(self) -> ExecutionPlan:  # the building half's (MoELayer)
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ without its hook machinery when nothing needs it (measured: ~60 us
        # per call at E=64 H=2048 T=1, every line running cold after the kernel). Hooks, a
        # forward of a subclass or of the instance (accelerate's hooks replace it), compiled
        # modules and JIT or torch.compile tracing take the standard path.
        # Dynamo is asked first: it folds the call to True, so it never traces the rest.
        if _dynamo_compiling():
            return super().__call__(*args, **kwargs)
        # The instance dict, read once and indexed: every attribute read on an nn.Module goes
        # through its __getattr__ hook, which the interpreter cannot specialise (measured on
        # a Zen 4, cold, E=8 H=1024 int4 T=1: 2-3 us less per call than self.<name> reads).
        # compile() stores _compiled_call_impl in it; until then the class default is None.
        d = self.__dict__
        plan = d["_plan"]
        if (plan is None or not plan.watched or not d["_own_forward"] or "forward" in d
                or "run" in d or "_compiled_call_impl" in d
                or d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d["_backward_pre_hooks"] or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]
                or _GLOBAL_HOOKS[2] or _GLOBAL_HOOKS[3] or _COMPILER._is_compiling_flag):
            return super().__call__(*args, **kwargs)
        plain = len(args) == 3 and not kwargs
        pair = plan.single
        if pair is None and plain and plan.natives is not None:
            pair = plan.native_for(args[0])  # a bucket table's entries
        if plain and pair is not None:
            # run()'s native branch, inlined: every frame and lookup here runs cold at
            # decode. No tracing check first: entries decline inside torch.jit.trace (their
            # contract, which the conformance kit checks).
            try:
                out = pair[0](*args)
            except Exception as exc:
                return self._entry_failed(pair[1], exc, *args)
            if out is not None:
                return out
        return self._without_entry(*args, **kwargs)

    def _without_entry(self, *args: Any, **kwargs: Any) -> Any:
        # __call__'s end when no entry ran the call (also the C call slot's, _call_slot.cpp,
        # after an entry declined: it never asks an entry twice).
        if not _tracing_state():
            return self._run_python(*args, **kwargs)
        return super().__call__(*args, **kwargs)  # torch.jit.trace: nn.Module's path

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if _is_compiling():
            # One opaque custom op in the graph; its real kernel is run().
            return torch.ops.moe_dispatch.moe_forward(hidden_states, topk_weights, topk_ids,
                                                      self._handle)
        if _tracing_state():
            # torch.jit.trace records torch ops: a kernel outside the dispatcher would be
            # invisible to it (its output a constant), the routing by token count would be
            # frozen at the traced T, and a tracer error inside a backend would look like a
            # kernel failure. The trace records the layer's op instead, which runs the
            # layer (every check and route) when the trace runs, in this process: the trace
            # holds the handle only, so the layer is kept alive for it.
            keep_for_trace(self._handle, self)
            return torch.ops.moe_dispatch.moe_forward(hidden_states, topk_weights, topk_ids,
                                                      self._handle)
        return self.run(hidden_states, topk_weights, topk_ids)

    def run(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, native: bool = True) -> torch.Tensor:
        """The eager forward without ``nn.Module``'s machinery: through the native entry of
        the route for this token count when it has one (it declines, with None, anything it
        cannot prove plain), else, or with ``native=False``, the checked Python path."""
        plan = self._plan
        if native and plan is not None and plan.natives is not None:
            pair = plan.native_for(hidden_states)
            if pair is not None:
                try:
                    out = pair[0](hidden_states, topk_weights, topk_ids)
                except Exception as exc:
                    return self._entry_failed(pair[1], exc, hidden_states, topk_weights, topk_ids)
                if out is not None:
                    return out
        return self._run_python(hidden_states, topk_weights, topk_ids)

    def _entry_failed(self, route: Route, exc: Exception, hidden_states: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # The entry checked the inputs before the kernel ran, so this is the kernel's (or the
        # entry's) failure; re-check all the same: the caller's bad input must never demote
        # a backend.
        check_forward(self.config, hidden_states, topk_weights, topk_ids)
        return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)

    def _run_python(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
        # Short path: the same checks as _run_checked, in as little code as possible.
        # Measured here: right after a kernel has streamed its weights through the caches
        # (or after any idle pause), Python and torch's bindings run cold: ten attribute
        # reads and one empty_like cost 1.7 us warm and ~80 us then. What counts is how many
        # *distinct* torch entry points a call touches, so this path reads only tensor
        # attributes (shape, dtype, is_cpu, _version) and at most one tolist() (none when
        # the kernels reject bad ids themselves: BackendSpec.validates_ids). Any doubt: the
        # checked path, which raises the precise error.
        plan = self._plan
        if (_grad_enabled() and plan is not None and isinstance(hidden_states, _Tensor)
                and isinstance(topk_weights, _Tensor)
                and wants_grad(hidden_states, topk_weights, plan.canonical.live)):
            return run_recorded(self._current_plan, self._run_checked, hidden_states,
                                topk_weights, topk_ids)
        if plan is not None and plan.watched and type(hidden_states) is _Tensor \
                and type(topk_weights) is _Tensor and type(topk_ids) is _Tensor:
            shape = hidden_states.shape
            if (len(shape) == 2 and shape[1] == plan.hidden and shape[0]
                    and hidden_states.dtype is plan.dtype
                    and topk_weights.shape == topk_ids.shape == (shape[0], plan.top_k)
                    and topk_ids.dtype in _ID_DTYPES and topk_weights.dtype in _FLOAT_DTYPES
                    and hidden_states.is_cpu and topk_weights.is_cpu and topk_ids.is_cpu
                    and tuple(map(version_of, plan.watched)) == plan.versions
                    and tuple(map(storage_id, plan.watched)) == plan.storage_ids):
                if plan.check_ids:
                    lo, hi = id_range(topk_ids)
                    if lo < 0 or hi >= plan.experts:
                        return self._run_checked(hidden_states, topk_weights, topk_ids)
                route = plan.route if plan.table is None else plan.route_for(shape[0])
                try:
                    out = route.apply(route.state, hidden_states, topk_weights, topk_ids)
                except MoEDispatchError:
                    raise
                except Exception as exc:
                    # Maybe the caller's ids (unchecked above when the kernels check them):
                    # that raises the typed error here, and the backend is not blamed.
                    check_forward(self.config, hidden_states, topk_weights, topk_ids)
                    return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)
                if good_output(out, shape, plan.dtype):
                    return out
                return self._fall_back(route.record, bad_output(out, shape, plan.dtype),
                                       hidden_states, topk_weights, topk_ids)
        return self._run_checked(hidden_states, topk_weights, topk_ids)

    def _current_plan(self) -> ExecutionPlan:
        assert self._plan is not None
        return self._plan

    def _run_checked(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise LayerStateError("forward() called before prepare(): call "
                                  "load_weights(...) and prepare() first")
        tokens = check_forward(self.config, hidden_states, topk_weights, topk_ids)
        route = plan.route_for(max(tokens, 1))
        # A differentiable backend computes on the caller's tensors themselves (that is how
        # their gradients reach them), so it sees an in-place update, an optimizer's step
        # included; every other backend's state was built from the old values.
        plan.canonical.check_unmodified(route.name, live=route.record.spec.differentiable)
        if tokens == 0:
            return hidden_states.new_empty((0, self.config.hidden_size))
        try:
            out = route.apply(route.state, hidden_states, topk_weights, topk_ids)
        except MoEDispatchError:
            raise  # a typed input error from the backend, not a kernel failure
        except Exception as exc:
            return self._fall_back(route.record, exc, hidden_states, topk_weights, topk_ids)
        shape = (tokens, self.config.hidden_size)
        if good_output(out, shape, hidden_states.dtype):
            return out
        return self._fall_back(route.record, bad_output(out, shape, hidden_states.dtype),
                               hidden_states, topk_weights, topk_ids)

    def _fall_back(self, rec: BackendRecord, exc: Exception, hidden_states: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Demote ``rec`` for this layer, swap in a plan without it, and run that."""
        error = f"{type(exc).__name__}: {exc}"
        wrapped = [n for n, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights),
                                  ("topk_ids", topk_ids)) if _transformed(t)]
        if wrapped:
            # The kernels read memory: under torch.func's transforms (vmap, grad) or
            # functionalization they fail on the caller's tensors, not on their own faults,
            # and demoting them one after another would leave the layer with none.
            raise InvalidArgumentError(
                wrapped[0], "a tensor under a torch.func transform (vmap, grad) or "
                "functionalization", f"plain tensors: backend {rec.name!r} failed on it "
                f"({error}); call the layer outside the transform") from exc
        if self.options.strict:
            raise KernelError(f"backend {rec.name!r} failed at run time ({error}); strict "
                              "mode forbids a fallback") from exc
        if self._config_resolution.forced is not None:
            raise KernelError(f"forced backend {rec.name!r} failed at run time ({error}); a "
                              "forced backend never falls back") from exc
        with self._lock:
            plan = self._plan
            # Another thread may have demoted it already: then its new plan just runs.
            if plan is not None and any(r.name == rec.name for r in plan.routes()):
                if plan.canonical.get() is None:
                    raise KernelError(
                        f"backend {rec.name!r} failed at run time ({error}) and no fallback is "
                        "possible: the layer was built with keep_canonical=False and the "
                        "canonical weights are gone") from exc
                log.warning("moe-dispatch: backend %r failed at run time on %s (%s); it is "
                            "demoted for this layer and the next accepting backend takes over",
                            rec.name, self.config.describe(), error)
                self._demotions.append(Demotion(rec.name, error))
                try:
                    self._plan = self._build_plan()  # policy="fastest" is not re-tuned
                except MoEDispatchError as exc2:
                    self._plan = None
                    raise KernelError(f"backend {rec.name!r} failed at run time ({error}) and no "
                                      f"fallback accepts this layer: {exc2}") from exc
        return self._run_python(hidden_states, topk_weights, topk_ids)


def _transformed(t: object) -> bool:
    """Whether ``t`` is a tensor wrapped by torch.func (vmap, grad) or functionalization."""
    return isinstance(t, torch.Tensor) and (torch._C._functorch.is_functorch_wrapped_tensor(t)
                                            or torch._is_functional_tensor(t))

