"""Reading sizes off a batch of any structure Lightning supports (tensors, tuples, lists, dicts, dataclasses)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "samples_in_batch", "tokens_in_batch"]


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``batch``, depth first, in order; non-tensor leaves are skipped."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from iter_tensors(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name))


def samples_in_batch(batch: Any) -> int:
    """The batch size: the length of the first tensor with a batch dimension (0 if there is none)."""
    for tensor in iter_tensors(batch):
        if tensor.ndim > 0:
            return int(tensor.shape[0])
    return 0


def tokens_in_batch(batch: Any) -> int | None:
    """Tokens in a language-model batch: the first integer tensor shaped ``(batch, seq)``; ``None`` otherwise."""
    for tensor in iter_tensors(batch):
        if tensor.ndim == 2 and not tensor.is_floating_point() and not tensor.is_complex() \
                and tensor.dtype != torch.bool:
            return int(tensor.shape[0] * tensor.shape[1])
    return None
