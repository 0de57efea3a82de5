"""Backend-owned weight copies and the version stamps that detect in-place updates."""

from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch

version_of = operator.attrgetter("_version")


def owned_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous copy the backend owns (None stays None): never a view of the caller's."""
    if t is None:
        return None
    return t.clone(memory_format=torch.contiguous_format)


def version_stamp(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The autograd version counters of ``tensors``: any in-place write bumps one."""
    return tuple(map(version_of, tensors))


def stamp_matches(tensors: Sequence[torch.Tensor], stamp: Sequence[int]) -> bool:
    """Whether none of ``tensors`` was written in place since ``stamp`` was taken."""
    return tuple(map(version_of, tensors)) == tuple(stamp)
