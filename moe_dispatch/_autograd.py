"""Calls that autograd would record: exact gradients, or a backward that says why not.

Why: a fused kernel (zentorch's op, vLLM's, the native one) returns a tensor autograd knows
nothing of. Where the layer's output is added to a residual, as in every transformer block,
``loss.backward()`` then runs, and the experts' share of every gradient is silently zero.
So a call that needs gradients (grad mode on, and the hidden states, the router weights or
a canonical weight requires them) runs on the Python path and:
- on a backend whose spec says ``differentiable`` (its ``apply`` is torch ops on the
  caller's canonical tensors: the torch loop), autograd records it as it is;
- on any other, runs under ``no_grad`` and gets a backward node that raises
  :class:`NotDifferentiableError`, naming the backend and the ways out. The forward is
  unchanged, so a model called for inference without ``torch.no_grad()`` still works.
Native entries decline such calls (a thread-local read in the toolkit's header), so under
``no_grad`` or ``inference_mode`` nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ._errors import NotDifferentiableError
from ._plan import ExecutionPlan

grad_enabled = torch.is_grad_enabled


def wants_grad(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
               weights: Callable[[], Iterable[torch.Tensor]]) -> bool:
    """Whether autograd would record this call (the caller checked the types); ``weights``
    is asked last, only when the inputs need no gradient."""
    return grad_enabled() and (hidden_states.requires_grad or topk_weights.requires_grad
                                or any(w.requires_grad for w in weights()))


def run_recorded(plan_of: Callable[[], ExecutionPlan], run_checked: Callable[..., torch.Tensor],
                 hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """A call that needs gradients, through the layer's checked path ``run_checked``;
    ``plan_of()``: the layer's plan now (a run-time fallback swaps it)."""
    tokens = hidden_states.shape[0] if hidden_states.ndim == 2 else 1

    def differentiable() -> bool:
        return plan_of().route_for(max(tokens, 1)).record.spec.differentiable

    if differentiable():
        out = run_checked(hidden_states, topk_weights, topk_ids)
        # A run-time fallback runs the new plan through the layer's Python path, and so
        # through this function again; checking the route once more costs nothing and keeps
        # a graph that a non-differentiable route made from being trusted.
        if tokens == 0 or (out.requires_grad and differentiable()):
            return out
        out = out.detach()
    else:
        with torch.no_grad():
            out = run_checked(hidden_states, topk_weights, topk_ids)
    if tokens == 0 or torch._C._get_tracing_state():
        # Nothing to differentiate; a trace records torch ops only (and must stay savable).
        return out
    # The route that ran (a fallback may have replaced the one asked).
    route = plan_of().route_for(tokens)
    return forward_only(out, f"an MoELayer call that ran on backend {route.name!r}", hidden_states,
                        topk_weights, plan_of().canonical.live())


def forward_only(out: torch.Tensor, backend: str, hidden_states: torch.Tensor,
                 topk_weights: torch.Tensor, weights: Iterable[torch.Tensor], *,
                 why: str = "", way_out: str = "") -> torch.Tensor:
    """``out`` (computed without autograd) joined to the graph of the call's inputs by a
    node whose backward raises, naming ``backend``, ``why`` it has no gradient and the
    ``way_out`` (by default: a fused kernel, and the torch loop)."""
    needing = [t for t in (hidden_states, topk_weights, *weights) if t.requires_grad]
    message = (
        f"backward through {backend}: {why or 'its kernel computes the forward only'}, so no "
        "gradient would reach the hidden states, the router weights or the expert weights. "
        "For inference call the model under torch.no_grad() or torch.inference_mode(); "
        + (way_out or "to train through the experts, force backend='torch' (its per-expert "
           "loop is differentiable) and run the layer eagerly"))
    return _ForwardOnly.apply(message, out, *needing)


class _ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, message: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        # A new tensor object (autograd attaches this node to it), not a view: the caller may
        # write the output in place (out += shared_expert(x)).
        return out.detach()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> None:
        raise NotDifferentiableError(ctx.message)
