"""The stage state machine: training-loop events + a clock → seconds per stage per window, with pauses.

No Lightning here: :class:`~lightning_accel.callbacks.doctor.bottleneck_doctor.BottleneckDoctor` feeds it from its
hooks, and any other step loop drives it with the same calls. The usage and the semantics of its calls:
``docs/measuring/doctor.md``, "Without a Trainer" and "The core, module by module".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_accel._checks import check_int
from lightning_accel.core.breakdown import MEASURED_STAGES, split_seconds
from lightning_accel.core.findings import STAGES
from lightning_accel.core.timing import StageTimer

__all__ = ["StageMachine", "StageWindow"]

_KNOWN = frozenset(MEASURED_STAGES) - {"communication"}


@dataclass(frozen=True)
class StageWindow:
    """One closed window of one process (the Autopilot's measuring window is another class).

    Attributes:
        wall: host seconds of the window's batches (pauses excluded).
        seconds: seconds per measured stage (``data``, ``transfer``, ``forward``, ``backward``, ``optimizer``,
            ``communication``); ``backward`` still contains the exposed ``communication`` (see
            :func:`~lightning_accel.core.breakdown.split_seconds`).
        batches: batches measured.
        samples: samples in those batches.
        step_times: host seconds of each batch, in order.
        data_times: host seconds of each batch's data wait, in order.
        first_batch: index (since the start, warm-up included) of the window's first batch.
    """

    wall: float
    seconds: dict[str, float]
    batches: int
    samples: float
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    first_batch: int = 0

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage of :data:`~lightning_accel.core.rules.STAGES` (``other`` = unaccounted wall time)."""
        return split_seconds(self.wall, self.seconds)

    def shares(self) -> dict[str, float]:
        """Stage → fraction of the window's time (sums to 1; the input of :func:`~lightning_accel.core.rules.
        diagnose`). All zeros for an empty window."""
        split = self.stage_seconds()
        total = sum(split.values())
        if self.batches == 0 or total <= 0:
            return dict.fromkeys(STAGES, 0.0)
        return {s: split[s] / total for s in STAGES}


class StageMachine:
    """Training-loop events → seconds per stage, window by window (docs/measuring/doctor.md, The stage machine).

    Args:
        clock: host clock in seconds (``time.perf_counter``; a fake one in tests).
        warmup_batches: batches at the start that are not measured.
        device: the device the step runs on (CUDA → device stages timed with CUDA events).
        timer: a :class:`~lightning_accel.core.timing.StageTimer` to use instead of a new one.
        ranges: a :class:`~lightning_accel.core.nvtx.StageRanges` to emit every stage as an NVTX range from the
            switch below (None: no NVTX, no cost but one test per switch).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        warmup_batches: int = 0,
        device: Any = None,
        timer: StageTimer | None = None,
        ranges: Any = None,
    ) -> None:
        check_int("StageMachine", "warmup_batches", warmup_batches, minimum=0, unit="batches")
        self.clock = clock
        self.timer = timer if timer is not None else StageTimer(device, clock=clock)
        self.ranges = ranges
        self.warmup_batches = warmup_batches
        #: the open stage, or ``None``
        self.stage: str | None = None
        #: the loop asked for a batch that has not arrived yet
        self.awaiting_batch = False
        #: batches ended since the start (warm-up included)
        self.batches_seen = 0
        #: the warm-up is over and windows are being measured
        self.measuring = False
        self.window_batches = 0
        self.window_samples = 0.0
        self._window_start = 0.0
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._resume_stage: str | None = None
        self._batch_start = 0.0
        self._batch_paused = 0.0
        self._data_start: float | None = None
        self._data_seconds = 0.0  # window total
        self._data_time = 0.0  # the current batch's
        self._extra: dict[str, float] = {}
        self._pause_depth = 0
        # Off CUDA every stage is a host interval: timed here from the one clock reading per switch, without the
        # timer's own reading (the doctor's hot path).
        self._host = self.timer.device.type != "cuda"
        self._host_seconds: dict[str, float] = {}
        self._stage_start = 0.0
        self._step_times: list[float] = []
        self._data_times: list[float] = []
        self._first_batch = 0
        self._held_at: float | None = None
        if warmup_batches == 0:
            self._start_measuring()

    # ------------------------------------------------------------------ events
    def batch_requested(self) -> None:
        """The loop asks for the next batch: the data wait opens (closing the open stage)."""
        self._switch("data")
        self.awaiting_batch = True

    def batch_arrived(self) -> None:
        """The batch is there: the data wait closes and no stage is open."""
        self._switch(None)

    def stage_start(self, stage: str) -> None:
        """Open ``stage`` (closing the open one; closes the data wait when the batch was awaited)."""
        if stage not in _KNOWN:
            raise ValueError(
                f"StageMachine.stage_start({stage!r}): use one of {sorted(_KNOWN)} ('communication' "
                "is timed by a comm hook and added with add_seconds, 'other' is derived)"
            )
        self._switch(stage)

    def stage_end(self, stage: str | None = None) -> None:
        """Close the open stage (only if it is ``stage``, when one is given)."""
        if stage is None or stage == self.stage:
            self._switch(None)

    def add_seconds(self, stage: str, seconds: float) -> None:
        """Add seconds measured elsewhere (e.g. the exposed all-reduce from a comm hook) to the current window."""
        if stage not in MEASURED_STAGES:
            raise ValueError(f"StageMachine.add_seconds({stage!r}): use one of {list(MEASURED_STAGES)}")
        self._extra[stage] = self._extra.get(stage, 0.0) + float(seconds)

    def step_end(self, samples: float = 0.0) -> None:
        """The batch is done: close the open stage, count the batch (and its samples) in the window."""
        now = self._switch(None)
        self.batches_seen += 1
        if self._held_at is not None:
            return
        if self.measuring:
            self.window_batches += 1
            self.window_samples += samples
            self._step_times.append(now - self._batch_start - self._batch_paused)
            self._data_times.append(self._data_time)
        elif self.batches_seen >= self.warmup_batches:
            self._start_measuring(now)
        self._batch_start, self._batch_paused, self._data_time = now, 0.0, 0.0

    def pause(self) -> None:
        """Take time out of the window (validation, a checkpoint save, the gap between epochs). Pauses nest: the
        clock runs again at the :meth:`resume` that matches the first pause."""
        self._pause_depth += 1
        if self._paused_at is not None:
            return
        self._resume_stage = self.stage
        self._paused_at = self._switch(None)

    def resume(self) -> None:
        """End a pause: the stage that was open continues (a resume without a pause is ignored)."""
        if self._paused_at is None:
            return
        self._pause_depth = max(0, self._pause_depth - 1)
        if self._pause_depth:
            return
        gap = self.clock() - self._paused_at
        self._paused_at = None
        if self._held_at is None:  # a pause inside a held stretch is already out of the window
            self._paused_total += gap
            self._batch_paused += gap
        stage, self._resume_stage = self._resume_stage, None
        if stage is not None:
            awaiting = stage == "data"
            self._switch(stage)
            self.awaiting_batch = awaiting

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    @property
    def held(self) -> bool:
        return self._held_at is not None

    def hold(self) -> None:
        """Leave the batches from now until :meth:`release` out of every window: neither their time nor their
        count (stages still switch, untimed). Call it between batches (after :meth:`step_end`), not in a pause."""
        if self._held_at is not None:
            return
        if self._paused_at is not None:
            raise RuntimeError("StageMachine.hold() inside a pause: hold between batches, after step_end()")
        self._held_at = self._switch(None)

    def release(self) -> None:
        """End a :meth:`hold`: the window goes on from now, as if the held batches had not run (call it after the
        last held batch's :meth:`step_end`; a pause still open continues from here)."""
        if self._held_at is None:
            return
        now = self._switch(None)
        self._paused_total += now - self._held_at
        self._held_at = None
        if self._paused_at is not None:
            self._paused_at = now
        self._batch_start, self._batch_paused, self._data_time = now, 0.0, 0.0

    def cancel(self) -> None:
        """Drop the open stage (an exception inside a step)."""
        self.timer.cancel()
        if self.ranges is not None:
            self.ranges.close_all()
        self.stage, self._data_start, self.awaiting_batch = None, None, False

    # ------------------------------------------------------------------ windows
    def finish(self) -> StageWindow | None:
        """The loop is done: drop the open stage and close the window at the end of the last batch (what came
        after it, a data wait for a batch that never came, pauses, is in no window). ``None`` when the window has
        no batch."""
        self.cancel()
        if not self.measuring or self.window_batches == 0:
            return None
        self._paused_total -= self._batch_paused
        self._data_seconds -= self._data_time
        return self.close_window(at=self._batch_start)

    def close_window(self, *, at: float | None = None) -> StageWindow:
        """Close the window and start the next one where this one's wall time was read (a data wait in progress
        counts up to now here and goes on in the next window). On CUDA this is the one synchronisation per
        window. Seconds are per measured stage; the warm-up is never in a window.

        Args:
            at: the clock reading where the window ends (default: now, or the start of the pause in progress).
        """
        now = at if at is not None else self._paused_at if self._paused_at is not None else self.clock()
        if self._data_start is not None:
            self._data_seconds += now - self._data_start
            self._data_time += now - self._data_start
            self._data_start = now
        seconds = self.timer.flush()
        for stage, value in self._host_seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
        if self.stage is not None and self.stage != "data" and self._host and self._paused_at is None:
            # a stage open across the edge: its part up to now is this window's
            seconds[self.stage] = seconds.get(self.stage, 0.0) + now - self._stage_start
            self._stage_start = now
        self._host_seconds = {}
        for stage, value in self._extra.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
        seconds["data"] = self._data_seconds
        window = StageWindow(
            wall=max(0.0, now - self._window_start - self._paused_total),
            seconds={s: float(seconds.get(s, 0.0)) for s in MEASURED_STAGES},
            batches=self.window_batches,
            samples=self.window_samples,
            step_times=self._step_times,
            data_times=self._data_times,
            first_batch=self._first_batch,
        )
        self._window_start, self._paused_total = now, 0.0
        self.window_batches, self.window_samples = 0, 0.0
        self._step_times, self._data_times = [], []
        self._extra, self._data_seconds = {}, 0.0
        self._first_batch = self.batches_seen
        return window

    def _start_measuring(self, now: float | None = None) -> None:
        self.measuring = True
        self.timer.flush()  # drop the warm-up batches' times
        now = self.clock() if now is None else now
        self._window_start, self._paused_total = now, 0.0
        self._batch_start, self._batch_paused = now, 0.0
        self._extra, self._data_seconds, self._data_time = {}, 0.0, 0.0
        self._host_seconds = {}
        if self._data_start is not None:
            self._data_start = now
        self._first_batch = self.batches_seen

    def _switch(self, stage: str | None) -> float:
        """Close the open stage, open ``stage``; returns the clock reading. ``data`` is timed here on the host
        clock (one reading per switch); the other stages by the timer (CUDA events on a GPU)."""
        now = self.clock()
        old = self.stage
        if self._held_at is not None:
            self.awaiting_batch = False
            self.stage = stage
            return now
        if old == "data":
            if self._data_start is not None:
                wait = now - self._data_start
                self._data_seconds += wait
                self._data_time += wait
                self._data_start = None
        elif old is not None:
            if self._host:
                self._host_seconds[old] = self._host_seconds.get(old, 0.0) + now - self._stage_start
            else:
                self.timer.stop(old)
        self.awaiting_batch = False
        self.stage = stage
        if self.ranges is not None:  # the one place NVTX stage ranges are emitted (core/nvtx.py)
            self.ranges.switch(old, stage)
        if stage == "data":
            self._data_start = now
        elif stage is not None:
            if self._host:
                self._stage_start = now
            else:
                self.timer.start(stage)
        return now
