"""Utilisation sampled once per window: process and data-loader-worker CPU (psutil), GPU (NVML).

Nothing here runs per step. :class:`CpuUtilisation` differences the CPU times of this process and of its child
processes (the DataLoader workers) between two window edges; :class:`GpuUtilisation` reads NVML's utilisation
samples (the driver keeps a ring buffer of "fraction of time a kernel was running" samples) since the previous
window, falling back to the instantaneous reading when the samples API is unavailable.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "PEAK_FIELDS",
    "CpuUtilisation",
    "GpuUtilisation",
    "reduce_utilisation",
    "usable_cores_per_rank",
    "usable_cpu_count",
]


def usable_cpu_count() -> int:
    """CPU cores this process may run on (affinity-aware where the OS supports it): the one CPU count of the package
    (the doctor's facts, the DataLoader tuners, the DALI and memmap defaults)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS / Windows
        return os.cpu_count() or 1


def usable_cores_per_rank(local_ranks: int) -> int:
    """:func:`usable_cpu_count` divided among the ``local_ranks`` processes on this node (at least 1)."""
    return max(1, usable_cpu_count() // max(1, local_ranks))


#: utilisation fields whose reduction is the maximum (a peak), not the mean
PEAK_FIELDS = frozenset({"memory_peak_frac"})


def reduce_utilisation(columns: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """One value per utilisation field from many (ranks of a window, or windows of a fit): the maximum for a peak
    (:data:`PEAK_FIELDS`), the mean for the rest; a field without values is left out."""
    return {f: (max(v) if f in PEAK_FIELDS else statistics.fmean(v)) for f, v in columns.items() if len(v)}


class CpuUtilisation:
    """CPU used by this process and by its children (DataLoader workers), as % of one core, per window.

    Args:
        process: a ``psutil.Process`` (default: this process).
        clock: wall clock in seconds.
        track_workers: scan child processes (costs a walk of ``/proc``, milliseconds); turn off when the
            DataLoader has no workers (``cpu_workers_pct`` is then 0).
    """

    def __init__(
        self, process: Any = None, clock: Callable[[], float] = time.perf_counter, *, track_workers: bool = True
    ) -> None:
        import psutil

        self.track_workers = track_workers
        self._psutil = psutil
        self._proc = process or psutil.Process()
        # this process's own CPU time: time.process_time() (one clock_gettime, ~1 µs) instead of psutil's read of
        # /proc/self/stat (~100 µs, once per window in the doctor's flush)
        self._own = process is None
        self._clock = clock
        self._last_wall: float | None = None
        self._last_self = 0.0
        self._children: dict[int, tuple[float, float]] = {}  # pid -> (create time, cpu seconds at the last edge)

    def _self_seconds(self) -> float:
        if self._own:
            return time.process_time()
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def start(self) -> None:
        """Open a window."""
        self._last_wall = self._clock()
        self._last_self = self._self_seconds()
        self._children = {}
        self._scan_children()

    def _scan_children(self) -> float:
        """Worker CPU seconds since the last scan. A worker first seen now was born in this window, so all its CPU
        time counts; workers that exited between two scans are lost (the figure is a lower bound)."""
        used = 0.0
        seen: dict[int, tuple[float, float]] = {}
        if not self.track_workers:
            self._children = seen
            return used
        for child in self._proc.children(recursive=True):
            try:
                t = child.cpu_times()
                born = child.create_time()
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            now = t.user + t.system
            previous = self._children.get(child.pid)
            used += max(0.0, now - previous[1]) if previous is not None and previous[0] == born else now
            seen[child.pid] = (born, now)
        self._children = seen
        return used

    def sample(self) -> dict[str, float] | None:
        """Close the window: ``{"cpu_process_pct", "cpu_workers_pct"}`` (% of one core), or ``None`` if not started."""
        if self._last_wall is None:
            return None
        wall = self._clock() - self._last_wall
        own = self._self_seconds()
        workers = self._scan_children()
        out = None
        if wall > 0:
            out = {"cpu_process_pct": 100.0 * (own - self._last_self) / wall, "cpu_workers_pct": 100.0 * workers / wall}
        self._last_wall, self._last_self = self._clock(), own
        return out


class GpuUtilisation:
    """NVML utilisation of one GPU between window edges: SM busy fraction, memory in use, SM clock.

    Args:
        index: the CUDA device index (as NVML numbers devices; with ``CUDA_VISIBLE_DEVICES`` the caller maps it).
        nvml: the ``pynvml`` module (injectable for tests); imported through ``require`` otherwise.
    """

    def __init__(self, index: int, nvml: Any = None) -> None:
        if nvml is None:
            from lightning_accel._imports import require

            nvml = require("pynvml", "BottleneckDoctor GPU utilisation")
        self._nvml = nvml
        nvml.nvmlInit()
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._last_ts = 0

    def start(self) -> None:
        """Open a window: later samples count from now."""
        self._last_ts = self._latest_timestamp()

    def _samples(self) -> list[Any]:
        nvml = self._nvml
        kind = getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", None)
        if kind is None or not hasattr(nvml, "nvmlDeviceGetSamples"):
            return []
        try:
            _, samples = nvml.nvmlDeviceGetSamples(self._handle, kind, self._last_ts)
        except Exception:  # noqa: BLE001 - NVML_ERROR_NOT_FOUND when no sample is new, NOT_SUPPORTED on some boards
            return []
        return list(samples)

    def _latest_timestamp(self) -> int:
        samples = self._samples()
        return max((s.timeStamp for s in samples), default=self._last_ts)

    def sample(self) -> dict[str, float]:
        """Close the window: ``gpu_util_pct`` (mean of the window's samples), ``gpu_mem_used_frac``, ``gpu_sm_clock_mhz``."""
        nvml = self._nvml
        samples = [s for s in self._samples() if s.timeStamp > self._last_ts]
        if samples:
            self._last_ts = max(s.timeStamp for s in samples)
            util = sum(_sample_value(s) for s in samples) / len(samples)
        else:  # instantaneous: utilisation over the driver's last sample period
            util = float(nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        mem = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        out = {"gpu_util_pct": float(util), "gpu_mem_used_frac": float(mem.used) / float(mem.total)}
        try:
            out["gpu_sm_clock_mhz"] = float(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM))
        except Exception:  # noqa: BLE001 - clocks are not exposed on every board / vGPU
            pass
        return out


def _sample_value(sample: Any) -> float:
    value = sample.sampleValue
    for attr in ("uiVal", "ulVal", "ullVal", "dVal"):  # the union member NVML filled for utilisation samples
        v = getattr(value, attr, None)
        if v is not None:
            return float(v)
    return float(value)
