"""Calls that autograd would record: exact gradients, or a backward that says why not.

Why: a fused kernel returns a tensor autograd knows nothing of. Where the layer's output is added to a residual, as in every transformer block,
``loss.backward()`` then runs, and the experts' share of every gradient is silently zero.
So a call that needs gradients (grad mode on, and the hidden states, the router weights or
a canonical weight requires them) runs on the Python path and:
- on a backend whose spec says ``differentiable`` (its ``apply`` is torch ops on the
  caller's canonical tensors), autograd records it as it is;
- on any other, runs under ``no_grad`` and gets a backward node that raises
  :class:`NotDifferentiableError`, naming the backend and the ways out (the differentiable
  backends that accept the layer, read from its resolution). The forward is
  unchanged, so a model called for inference without ``torch.no_grad()`` still works.
Native entries decline such calls (a thread-local read in the toolkit's header), so under
``no_grad`` or ``inference_mode`` nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ._errors import NotDifferentiableError
from ._plan import ExecutionPlan
from ._resolution import Resolution, Status

grad_enabled = torch.is_grad_enabled


def wants_grad(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               weights: Callable[[], Iterable[torch.Tensor]]) -> bool:
    """Whether autograd would record this call when :func:`grad_enabled` (the caller asks
    that first, and checked the types); ``weights`` is asked last, only when the inputs need
    no gradient."""
    return (hidden_states.requires_grad or topk_weights.requires_grad
            or any(w.requires_grad for w in weights()))


def run_recorded(plan_of: Callable[[], ExecutionPlan], run_checked: Callable[..., torch.Tensor],
                 hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """A call that needs gradients, through the layer's checked path ``run_checked``;
    ``plan_of()``: the layer's plan now (a run-time fallback swaps it, and runs the new plan
    through the layer's Python path, so through this function again)."""
    tokens = hidden_states.shape[0] if hidden_states.ndim == 2 else 1
    if plan_of().route_for(max(tokens, 1)).record.spec.differentiable:
        out = run_checked(hidden_states, topk_weights, topk_ids)
        if out.requires_grad or tokens == 0:
            return out
    else:
        with torch.no_grad():
            out = run_checked(hidden_states, topk_weights, topk_ids)
    if tokens == 0 or torch._C._get_tracing_state():
        # Nothing to differentiate; a trace records torch ops only (and must stay savable).
        return out
    plan = plan_of()
    return forward_only(out, f"an MoELayer call that ran on backend {plan.route_for(tokens).name!r}",
                        hidden_states, topk_weights, plan.canonical.live(),
                        way_out=lambda: _differentiable_way_out(plan.resolution))


def _differentiable_way_out(resolution: Resolution) -> str:
    """How to train through this layer's experts: the backends that accept it and whose spec
    says ``differentiable``."""
    accepted = (Status.CHOSEN, Status.STANDBY, Status.NOT_FORCED)
    names = [c.name for c in resolution.candidates if c.status in accepted
             and (rec := resolution.record(c.name)) is not None and rec.spec.differentiable]
    if not names:
        return "no backend that accepts this layer is differentiable (BackendSpec.differentiable)"
    return ("to train through the experts, force " + " or ".join(f"backend={n!r}" for n in names)
            + " (differentiable: torch ops on the caller's weights)")


def forward_only(out: torch.Tensor, what: str, hidden_states: torch.Tensor,
                 topk_weights: torch.Tensor, weights: Iterable[torch.Tensor], *,
                 why: str = "its kernel computes the forward only",
                 way_out: str | Callable[[], str]) -> torch.Tensor:
    """``out`` (computed without autograd) joined to the graph of the call's inputs by a
    node whose backward raises :meth:`NotDifferentiableError.through` ``what`` (the message,
    a callable ``way_out`` included, is built then: the forward pays for none of it)."""
    needing = [t for t in (hidden_states, topk_weights, *weights) if t.requires_grad]
    def error() -> NotDifferentiableError:
        return NotDifferentiableError.through(what, why, way_out if isinstance(way_out, str)
                                              else way_out())

    return _ForwardOnly.apply(error, out, *needing)


class _ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, error: Callable[[], NotDifferentiableError], out: torch.Tensor,
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.error = error
        # A new tensor object (autograd attaches this node to it), not a view: the caller may
        # write the output in place (out += shared_expert(x)).
        return out.detach()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> None:
        raise ctx.error()
