"""Stage timing without a device synchronisation per step.

On CPU every stage is timed with ``time.perf_counter``. On CUDA, device stages (work the GPU does: transfer,
forward, backward, optimizer) are bracketed with CUDA events, which the GPU timestamps as it reaches them; the
events are read only when :meth:`StageTimer.flush` closes a window, with one ``synchronize`` on the last event.
Host stages (waiting for the data loader) are always timed on the host clock, because the wait happens there.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StageTimer"]


class StageTimer:
    """Accumulates seconds per named stage between flushes.

    Args:
        device: the device the step runs on. CUDA devices use CUDA events for device stages.
        clock: host clock (injectable for tests).

    Example::

        timer = StageTimer(torch.device("cpu"))
        timer.start("forward"); out = model(x); timer.stop("forward")
        seconds = timer.flush()  # {"forward": 0.012}
    """

    def __init__(self, device: torch.device | str | None = None, clock: Callable[[], float] = time.perf_counter):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._clock = clock
        self._host_open: dict[str, float] = {}
        self._device_open: dict[str, Any] = {}
        self._pending: list[tuple[str, Any, Any]] = []
        self._spare: list[Any] = []
        self._totals: defaultdict[str, float] = defaultdict(float)

    def _event(self) -> Any:
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def start(self, stage: str, *, host: bool = False) -> None:
        """Open ``stage``. ``host=True`` times it on the host clock even on CUDA (e.g. the data wait)."""
        if self._cuda and not host:
            event = self._event()
            event.record()
            self._device_open[stage] = event
        else:
            self._host_open[stage] = self._clock()

    def stop(self, stage: str) -> None:
        """Close ``stage``; a stage that was not opened is ignored (a hook that fired without its partner)."""
        if stage in self._host_open:
            self._totals[stage] += self._clock() - self._host_open.pop(stage)
        elif stage in self._device_open:
            end = self._event()
            end.record()
            self._pending.append((stage, self._device_open.pop(stage), end))

    def cancel(self) -> None:
        """Drop stages that are open (e.g. after an exception inside a step)."""
        self._host_open.clear()
        self._spare.extend(self._device_open.values())
        self._device_open.clear()

    def flush(self) -> dict[str, float]:
        """Seconds per stage since the last flush. Synchronises once on CUDA (on the last recorded event)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for stage, start, end in self._pending:
                self._totals[stage] += start.elapsed_time(end) / 1000.0
                self._spare.extend((start, end))
            self._pending.clear()
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals
