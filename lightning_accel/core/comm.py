"""Timing of DDP gradient communication through a comm-hook wrapper (framework-free: torch only).

:func:`timed_comm_hook` wraps a DDP comm hook so that :class:`CommRecorder` sees each bucket's launch and completion;
the exposed communication is the all-reduce time not hidden behind backward, read without a per-step
synchronisation. The formula, the clocks and the usage: ``docs/measuring/doctor.md``, "The core, module by module".
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CommRecorder", "timed_comm_hook"]

CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


class CommRecorder:
    """Collects launch/completion marks of bucket all-reduces and turns them into exposed seconds per backward.

    Args:
        cuda: mark with CUDA events instead of the host clock (a run whose gradients live on a GPU).
        clock: host clock (injectable for tests).
    """

    def __init__(self, *, cuda: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = cuda
        self._clock = clock
        self._lock = threading.Lock()  # completion callbacks can run on the backend's threads
        self._launches: list[Any] = []
        self._completions: list[Any] = []
        self._passes: list[tuple[Any, list[Any]]] = []  # (last launch, completions) per finished backward
        self._exposed = 0.0
        self._n_passes = 0
        #: bucket hooks run since construction (proof that the hook is installed and ran)
        self.buckets = 0
        #: a :class:`~lightning_accel.core.nvtx.StageRanges`: each bucket's exchange becomes a "communication"
        #: NVTX range from launch to completion (None: off)
        self.ranges: Any = None
        #: why recording stopped (an error inside our wrapper), or None: the all-reduces then run untimed
        self.failed: str | None = None

    def fail(self, err: BaseException) -> None:
        """Stop recording after an error of ours: the hook's all-reduces go on, untimed, and :meth:`flush` reports
        no measured pass, so no communication share is built on a partial record."""
        with self._lock:
            if self.failed is None:
                self.failed = f"{type(err).__name__}: {err}"
            self._launches, self._completions, self._passes = [], [], []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._clock()

    def launch(self) -> Any:
        """A bucket's all-reduce starts (called by the hook before it starts the collective); returns the handle
        of its NVTX range (None without ranges), for :meth:`complete`."""
        mark = self._mark()
        with self._lock:
            self._launches.append(mark)
            self.buckets += 1
        return self.ranges.start("communication") if self.ranges is not None else None

    def complete(self, handle: Any = None) -> None:
        """A bucket's all-reduce finished (called from the future's completion callback)."""
        if handle is not None:
            self.ranges.end(handle)
        mark = self._mark()
        with self._lock:
            self._completions.append(mark)

    def end_backward(self) -> None:
        """Close one backward pass (call after ``backward()`` returned; DDP has waited for all buckets)."""
        with self._lock:
            launches, completions = self._launches, self._completions
            self._launches, self._completions = [], []
        if not launches:
            return  # no all-reduce in this pass (e.g. gradient accumulation under no_sync)
        if self.cuda:
            self._passes.append((launches[-1], completions))
            return
        self._n_passes += 1
        if completions:
            self._exposed += max(0.0, max(completions) - launches[-1])

    def discard(self) -> None:
        """Forget the marks of an unfinished pass (an exception inside backward)."""
        with self._lock:
            self._launches, self._completions = [], []

    def flush(self) -> tuple[float, int]:
        """``(exposed seconds, backward passes with an all-reduce)`` since the last flush.

        On CUDA this waits for the recorded completion events (all but the last pass's are long complete).
        """
        if self.failed is not None:
            self._exposed, self._n_passes = 0.0, 0
            return 0.0, 0
        if self._passes:
            for _, completions in self._passes:  # complete already, except (at most) the last pass's: cheap
                for event in completions:
                    event.synchronize()
            for launch, completions in self._passes:
                if completions:
                    self._exposed += max(0.0, max(launch.elapsed_time(c) for c in completions) / 1000.0)
                self._n_passes += 1
            self._passes.clear()
        out = (self._exposed, self._n_passes)
        self._exposed, self._n_passes = 0.0, 0
        return out


def timed_comm_hook(hook: CommHook, recorder: CommRecorder) -> CommHook:
    """Wrap a DDP communication hook so that each bucket's launch and completion are recorded.

    The wrapped hook returns a future that resolves to the same tensor as ``hook``'s future, so it can stand in
    for ``hook`` in ``DistributedDataParallel.register_comm_hook`` (and be wrapped again).

    An error inside the recording (not inside ``hook``) stops it (:meth:`CommRecorder.fail`) and the bucket's
    all-reduce proceeds unchanged.

    Args:
        hook: ``hook(state, bucket) -> Future[Tensor]``, e.g. ``default_hooks.allreduce_hook``.
        recorder: where the marks go.
    """

    @functools.wraps(hook)
    def timed(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # Diagnostics never break training: an error in our recording (a mark, an NVTX range) stops the recording
        # and the user's hook runs as if unwrapped; the hook's own errors stay the user's.
        if recorder.failed is not None:
            return hook(state, bucket)
        try:
            handle = recorder.launch()
        except Exception as err:  # noqa: BLE001
            recorder.fail(err)
            return hook(state, bucket)
        fut = hook(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                recorder.complete(handle)
            except Exception as err:  # noqa: BLE001
                recorder.fail(err)
            return f.value()

        return fut.then(done)

    # functools.wraps keeps the hook's name and annotations: DDP validates both in register_comm_hook.
    return timed
