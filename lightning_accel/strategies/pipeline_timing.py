"""Stage timing of a pipeline-parallel run: each step's wall time and the time this rank's stages computed, whose
ratio is the measured bubble. See docs/techniques/pipeline.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_accel.core.pipeline_plan import bubble_fraction

__all__ = ["PipelineStats", "StageTimer"]


@dataclass
class PipelineStats:
    """Per-step timing of this rank: wall time of the schedule and the time its stages computed (seconds).

    On CUDA both are timed with CUDA events (host clocks would time kernel launches, not the kernels), recorded on
    the stream and read only when asked for (:meth:`bubble`): no synchronisation per step. On CPU, ``perf_counter``.
    ``timed`` is False when none of the stage methods the compute timer wraps exists (a torch that renamed them):
    the bubble is then not reported rather than read as 100 %.
    """

    step_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    pipeline_ranks: int = 1
    microbatches: int = 1
    stages_per_rank: int = 1
    timed: bool = True
    #: CUDA steps not read yet: (start event, end event, [(chunk start, chunk end), ...])
    pending: list[tuple[Any, Any, list[tuple[Any, Any]]]] = field(default_factory=list)

    def resolve(self) -> None:
        """Read the CUDA events of the steps recorded so far into ``step_s`` / ``compute_s`` (waits for the last)."""
        for start, end, chunks in self.pending:
            end.synchronize()
            self.step_s.append(start.elapsed_time(end) / 1e3)
            self.compute_s.append(sum(s.elapsed_time(e) for s, e in chunks) / 1e3)
        self.pending.clear()

    @property
    def expected_bubble(self) -> float:
        return bubble_fraction(self.pipeline_ranks, self.microbatches, self.stages_per_rank)

    def bubble(self, skip: int = 1) -> float | None:
        """The measured idle share of the steps after ``skip`` warm-up steps: 1 - compute / wall; ``None`` when it
        was not measured (no step, or the compute timer's hooks never ran: no compute is not a 100 % bubble)."""
        self.resolve()
        step, comp = self.step_s[skip:], self.compute_s[skip:]
        if not self.timed or not step or sum(step) <= 0 or sum(comp) <= 0:
            return None
        return max(0.0, 1.0 - sum(comp) / sum(step))


class StageTimer:
    """Times the steps of the schedule and the compute of this rank's stages into :attr:`stats`.

    :meth:`wrap` makes a ``PipelineStage``'s per-micro-batch entry points add their time to the running step;
    :meth:`step` times one step around the schedule.
    """

    def __init__(self) -> None:
        self.stats = PipelineStats()
        self._compute = 0.0  # CPU: this step's compute seconds so far
        self._chunk_events: list[tuple[Any, Any]] | None = None  # CUDA: this step's compute events

    def reset(self, *, pipeline_ranks: int, microbatches: int, stages_per_rank: int) -> None:
        """Fresh statistics for a new split."""
        self.stats = PipelineStats(
            pipeline_ranks=pipeline_ranks, microbatches=microbatches, stages_per_rank=stages_per_rank
        )

    def wrap(self, stage: Any) -> None:
        """Add the stage's forward and backward compute times to the step's (torch 2.13: ``forward_one_chunk`` /
        ``backward_one_chunk`` are the stage's per-micro-batch entry points)."""
        wrapped = 0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name, None)
            if inner is None:
                continue
            wrapped += 1

            def timed(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
                if self._chunk_events is not None:  # CUDA: events on the stream, read after the step
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    try:
                        return _inner(*args, **kwargs)
                    finally:
                        end.record()
                        self._chunk_events.append((begin, end))
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    self._compute += time.perf_counter() - start

            setattr(stage, name, timed)
        if wrapped == 0:
            self.stats.timed = False
            rank_zero_info(
                "pp: this torch's PipelineStage has none of forward_one_chunk / backward_one_chunk: "
                "the pipeline bubble is not measured"
            )

    @contextmanager
    def step(self, device: torch.device) -> Iterator[None]:
        """Time the schedule's step run inside: CUDA events on ``device``'s stream, or the host clock."""
        self._compute = 0.0
        if device.type == "cuda":
            self._chunk_events = []
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self.stats.pending.append((begin, end, self._chunk_events))
            self._chunk_events = None
        else:
            start = time.perf_counter()
            yield
            self.stats.step_s.append(time.perf_counter() - start)
            self.stats.compute_s.append(self._compute)

    def bubble_per_rank(self, skip: int, world_size: int) -> list[float | None]:
        """Every rank's measured bubble (a collective: call it on all ranks)."""
        import torch.distributed as dist

        mine = self.stats.bubble(skip)
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        return gathered
