"""Router post-processing: logits to (topk_weights float32, topk_ids int32)."""

from __future__ import annotations

import torch

from ._errors import InvalidArgumentError, InvalidTypeError

SCORING = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   renormalize: bool = True, num_expert_group: int | None = None,
                   topk_group: int | None = None, correction_bias: torch.Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    - ``scoring``: ``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3, Llama-4).
    - ``num_expert_group``/``topk_group``: DeepSeek group-limited routing: only experts in
      the ``topk_group`` best groups are eligible. A group's score is its best expert's
      score, or the sum of its two best when a ``correction_bias`` is given (as V3 does).
    - ``correction_bias [E]``: added to the scores *for choosing only*; the returned
      weights are the unbiased scores.
    - ``renormalize``: divide the chosen weights by their sum.
    - ``routed_scaling_factor``: multiplies the final weights.

    NaN logits raise: they would route a token to arbitrary experts.
    """
    if not isinstance(router_logits, torch.Tensor):
        raise InvalidTypeError("router_logits", router_logits, "a torch.Tensor [T, E]")
    if router_logits.dim() != 2:
        raise InvalidArgumentError("router_logits", router_logits, "a 2-D tensor [T, E]")
    if not router_logits.is_floating_point():
        raise InvalidTypeError("router_logits", router_logits, "a floating-point dtype")
    num_tokens, num_experts = router_logits.shape
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise InvalidArgumentError("top_k", top_k, f"an int in [1, {num_experts}] (E)")
    if scoring not in SCORING:
        raise InvalidArgumentError("scoring", scoring, f"one of {SCORING}")
    if not isinstance(routed_scaling_factor, (int, float)) or isinstance(
            routed_scaling_factor, bool) or not routed_scaling_factor > 0:
        raise InvalidArgumentError("routed_scaling_factor", routed_scaling_factor,
                                   "a positive finite number")
    logits = router_logits.to(torch.float32)
    # The NaN check is a data-dependent branch: skipped while torch.compile traces.
    if num_tokens and not torch.compiler.is_compiling() and bool(torch.isnan(logits).any()):
        raise InvalidArgumentError("router_logits", "a tensor containing NaN",
                                   "finite logits (NaN would route tokens arbitrarily)")
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor) or correction_bias.shape != (num_experts,):
            raise InvalidArgumentError("correction_bias", correction_bias,
                                       f"a tensor of shape ({num_experts},) (E)")
        choice = scores + correction_bias.to(torch.float32)
    if num_expert_group is not None or topk_group is not None:
        choice = _group_limit(choice, top_k, num_expert_group, topk_group,
                              two_best=correction_bias is not None)
    _, ids = torch.topk(choice, top_k, dim=-1)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if routed_scaling_factor != 1.0:
        weights = weights * float(routed_scaling_factor)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _group_limit(choice: torch.Tensor, top_k: int, num_expert_group: int | None,
                 topk_group: int | None, *, two_best: bool) -> torch.Tensor:
    num_experts = choice.shape[1]
    if num_expert_group is None or topk_group is None:
        raise InvalidArgumentError(
            "topk_group" if topk_group is None else "num_expert_group", None,
            "num_expert_group and topk_group given together")
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(name, value, "a positive int")
    if num_experts % num_expert_group:
        raise InvalidArgumentError("num_expert_group", num_expert_group,
                                   f"a divisor of the expert count E={num_experts}")
    if topk_group > num_expert_group:
        raise InvalidArgumentError("topk_group", topk_group,
                                   f"<= num_expert_group ({num_expert_group})")
    per_group = num_experts // num_expert_group
    if topk_group * per_group < top_k:
        raise InvalidArgumentError(
            "topk_group", topk_group, f"large enough that topk_group * experts per group "
            f"({per_group}) >= top_k ({top_k})")
    grouped = choice.view(choice.shape[0], num_expert_group, per_group)
    if two_best and per_group >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    mask = mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
    return choice.masked_fill(~mask, float("-inf"))
