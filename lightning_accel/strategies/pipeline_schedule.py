"""The schedule of a pipeline-parallel run: this rank's ``torch.distributed.pipelining`` stages and schedule, one step
run over the batch cut into micro-batches, and the errors a step raises named by rank and stage.
See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_accel.core.pipeline_plan import SCHEDULES, StagePlan
from lightning_accel.strategies.pipeline_timing import StageTimer

__all__ = ["ScheduleRunner", "on_cleared_grads"]

_T = TypeVar("_T")


class ScheduleRunner:
    """This rank's stages and schedule (after :meth:`build`), and :meth:`run`: one step of it.

    Args:
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved_1f1b"``.
        timeout: the pipeline groups' timeout, named when a peer stops answering.
    """

    def __init__(self, schedule: str, timeout: timedelta | None = None) -> None:
        self.name = schedule
        self.timeout = timeout
        #: each micro-batch's loss is divided by it (micro-batches × accumulated batches): Lightning's loss scale
        self.loss_divisor = 1.0
        self._stages: list[Any] = []
        self._schedule: Any = None
        self._rank = 0  # this process's global rank, for the errors
        self._num_stages: int | None = None
        self._group: Any = None
        self._device = torch.device("cpu")
        self._last_rank = 0  # the global rank of the last stage, whose losses every rank receives
        self._broadcast = False
        self._loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def build(
        self,
        modules: Sequence[nn.Module],
        plan: StagePlan,
        *,
        pipeline_rank: int,
        pipeline_ranks: list[int],
        rank: int,
        device: torch.device,
        group: Any,
        microbatches: int,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        timer: StageTimer,
    ) -> None:
        """The ``PipelineStage`` of each of this rank's stage ``modules`` (timed by ``timer``) and the schedule over
        them; ``loss`` is one micro-batch's (a mean), ``pipeline_ranks`` the global ranks of this pipeline."""
        from torch.distributed import pipelining

        self._stages = []
        for s, mod in zip(plan.stages_of(pipeline_rank), modules):
            stage = pipelining.PipelineStage(mod, s, plan.num_stages, device, group=group)
            timer.wrap(stage)
            self._stages.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.name][0])
        multi = SCHEDULES[self.name][1]
        self._rank, self._num_stages, self._group, self._loss = rank, plan.num_stages, group, loss
        self._device = device
        self._last_rank = pipeline_ranks[plan.ranks[-1]]
        self._broadcast = len(pipeline_ranks) > 1
        self._schedule = cls(
            self._stages if multi else self._stages[0],
            n_microbatches=microbatches,
            loss_fn=self._loss_fn,
            scale_grads=False,
        )

    @property
    def built(self) -> bool:
        return self._schedule is not None

    def clear(self) -> None:
        self._schedule = None
        self._stages = []

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self._stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self._stages)

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(output, target) / self.loss_divisor

    @contextmanager
    def unscaled(self) -> Iterator[None]:
        """Steps run inside compute the plain mean loss (divisor 1): validation and the first-batch check."""
        divisor, self.loss_divisor = self.loss_divisor, 1.0
        try:
            yield
        finally:
            self.loss_divisor = divisor

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> torch.Tensor:
        """One step (``train``: forward and backward; else forward only); the mean loss over the micro-batches (times
        the divisor), on every rank of the pipeline."""
        import torch.distributed as dist

        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.has_last else {}
        try:
            if train:
                self._schedule.step(*args, **kwargs)
            else:
                self._schedule.eval(*args, **kwargs)
        except Exception as err:
            stages = [s.stage_index for s in self._stages]
            where = (
                f"pipeline rank {self._rank} (stage {', '.join(map(str, stages))} of "
                f"{self._num_stages if self._num_stages is not None else '?'})"
            )
            if _is_peer_failure(err):
                raise RuntimeError(
                    f"{where}: the {self.name} schedule failed, a peer stage died or stopped "
                    f"answering (timeout {self.timeout}): {err}"
                ) from err
            # this rank's own error (the user's layer, a shape, memory): the original exception, its type and
            # message first, with where it was raised added
            note = f"raised on {where} inside the {self.name} schedule"
            if hasattr(err, "add_note"):
                err.add_note(note)
                raise
            raise RuntimeError(f"{err} ({note})") from err
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean() * self.loss_divisor
        else:
            loss = torch.zeros((), device=self._device)
        if self._broadcast:
            dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss

    def discarded_step(self, params: list[nn.Parameter], inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The loss of one whole schedule step (divisor 1), its gradients discarded: the first-batch check's, which
        also sets up the schedule's buffers."""
        with self.unscaled():
            loss, _ = on_cleared_grads(params, lambda: self.run(inputs, targets, train=True))
        return float(loss)


def on_cleared_grads(params: list[nn.Parameter], step: Callable[[], _T]) -> tuple[_T, dict[nn.Parameter, torch.Tensor]]:
    """Run ``step`` with ``params``' gradients cleared; put the earlier gradients back and return what ``step``
    returned with the gradients it made."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        out = step()
        return out, {p: p.grad for p in params if p.grad is not None}
    finally:
        for p, grad in zip(params, earlier):
            p.grad = grad


def _is_peer_failure(err: BaseException) -> bool:
    """Whether a schedule error comes from the communication with another stage (a timeout, a closed connection)
    rather than from this rank's own computation."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return any(
        s in text
        for s in (
            "timed out",
            "timeout",
            "connection closed",
            "connection reset",
            "broken pipe",
            "gloo",
            "nccl",
            "peer",
        )
    )
