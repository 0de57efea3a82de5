"""Checks on expert ids that stay cheap at decode."""

from __future__ import annotations

import torch

# Up to this many ids, checks run in Python on ``tolist()``: measured here, a torch
# reduction or sort between two kernel calls costs 20-80 us (thread-pool wake-ups), a
# tolist() 2-3 us. Larger batches use one vectorised op, small next to their kernel.
SMALL_IDS = 256


def id_range(ids: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty ``[T, K]`` id tensor."""
    tokens, top_k = ids.shape  # not numel(): one torch entry point less on the forward path
    if tokens * top_k <= SMALL_IDS:
        rows = ids.tolist()
        return min(map(min, rows)), max(map(max, rows))  # map(): no Python frame per row
    lo, hi = torch.aminmax(ids)
    return int(lo), int(hi)


def check_id_range(ids: torch.Tensor, num_experts: int) -> None:
    """Raise ``IndexError`` naming the first bound broken if a non-empty ``[T, K]`` id tensor
    holds an id outside ``[0, num_experts)``: for a kernel that must never see one."""
    lo, hi = id_range(ids)
    if lo < 0 or hi >= num_experts:
        raise IndexError(f"topk_id value {lo if lo < 0 else hi} is outside [0, {num_experts})")


def ids_in_range(ids: torch.Tensor, num_experts: int) -> bool:
    """Whether every id of a ``[T, K]`` tensor lies in ``[0, num_experts)`` (True if empty)."""
    if ids.shape[0] == 0:
        return True
    lo, hi = id_range(ids)
    return lo >= 0 and hi < num_experts


def has_duplicate_in_row(ids: torch.Tensor) -> bool:
    """Whether any row of ``[T, K]`` ids repeats an id."""
    k = ids.shape[1]
    if k < 2:
        return False
    if ids.numel() <= SMALL_IDS:
        return any(len(set(row)) != k for row in ids.tolist())
    ordered = ids.sort(dim=1).values
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())
