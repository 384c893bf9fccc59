"""The ``(pipeline, data_parallel)`` mesh of a pipeline-parallel run: every rank's process groups.
See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

__all__ = ["PipelineGroups", "broadcast_weights", "make_groups"]


@dataclass
class PipelineGroups:
    """This rank's process groups.

    Attributes:
        pipeline: this replica's pipeline (the stages' sends and the loss broadcast).
        pipeline_ranks: the global ranks of that pipeline, by pipeline rank.
        data_parallel: this stage's replicas (None with one replica).
        tied: this replica's first and last stage, which sum the tied weights' gradients (None with one stage rank).
    """

    pipeline: Any
    pipeline_ranks: list[int]
    data_parallel: Any
    tied: Any


def make_groups(
    pipeline_ranks: int, replicas: int, pp_rank: int, dp_rank: int, *, timeout: timedelta | None
) -> PipelineGroups:
    """Every group of the mesh, consecutive global ranks being replicas of the same stage; this rank's returned."""
    import torch.distributed as dist

    pipeline = data_parallel = tied = None
    members: list[int] = []
    # every rank creates every group, in the same order (torch's new_group contract). Each group carries the
    # strategy's timeout: gloo's point-to-point waits keep the timeout their group was created with, so the
    # world group (created before the strategy, perhaps by an earlier fit) would not honour ``timeout``.
    for d in range(replicas):
        ranks = [r * replicas + d for r in range(pipeline_ranks)]
        group = dist.new_group(ranks, timeout=timeout)
        if d == dp_rank:
            pipeline, members = group, ranks
    for p in range(pipeline_ranks):
        ranks = [p * replicas + d for d in range(replicas)]
        group = dist.new_group(ranks, timeout=timeout) if replicas > 1 else None
        if p == pp_rank:
            data_parallel = group
    for d in range(replicas):
        ranks = [d, (pipeline_ranks - 1) * replicas + d]
        group = dist.new_group(ranks, timeout=timeout) if pipeline_ranks > 1 else None
        if d == dp_rank:
            tied = group
    return PipelineGroups(pipeline, members, data_parallel, tied)


def broadcast_weights(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, before the split (a collective)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
