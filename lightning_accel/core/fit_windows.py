"""FitWindows: the doctor's bookkeeping over one fit's windows, with no Lightning in sight.

:class:`~lightning_accel.callbacks.doctor.bottleneck_doctor.BottleneckDoctor` hands it each closed
:class:`~lightning_accel.core.stages.StageWindow` (:meth:`FitWindows.local_row` turns it into this rank's
:class:`~lightning_accel.core.window_row.RankWindow`) and every rank's gathered rows (:meth:`FitWindows.add`):
the step breakdown over windows and ranks, the utilisation per window, the variability rows per rank, the
communication passes and the timeline the report plots. :meth:`FitWindows.live_context` gives the rules what the
windows so far say; :func:`window_metrics` the ``doctor/`` keys one window logs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.core.breakdown import ROW_FIELDS, Breakdown, WindowBreakdown
from lightning_accel.core.rules import STAGES, RunContext
from lightning_accel.core.utilisation import reduce_utilisation
from lightning_accel.core.variability import VARIABILITY_FIELDS, summarise_window
from lightning_accel.core.window_row import UTIL_FIELDS, RankWindow

if TYPE_CHECKING:
    from lightning_accel.core.stages import StageWindow

__all__ = ["FitWindows", "window_metrics"]


class FitWindows:
    """Every window of one fit: the breakdown, utilisation, variability rows, communication passes, timeline."""

    def __init__(self) -> None:
        self.breakdown = Breakdown()
        self.train_wall = 0.0
        self.batch_sizes: list[int] = []
        self.util_sums: dict[str, list[float]] = {}
        self.var_rows: list[list[list[float]]] = []  # per rank, per window: VARIABILITY_FIELDS
        self.comm_passes = 0
        self.timeline: list[dict[str, Any]] = []

    def record_batch_size(self, n: int) -> None:
        """A measured batch's sample count (the first 1000 are kept: the median is the batch size the rules use)."""
        if len(self.batch_sizes) < 1000:
            self.batch_sizes.append(n)

    def local_row(
        self,
        window: StageWindow,
        comm_seconds: float,
        comm_passes: int,
        sample_utilisation: Callable[[], dict[str, float]],
        device: torch.device,
    ) -> RankWindow:
        """This rank's row of a closed window: its stage seconds (the exposed communication added), utilisation
        (``sample_utilisation()``, plus the CUDA peak memory fraction) and variability."""
        self.train_wall += window.wall
        seconds = {**window.seconds, "communication": window.seconds.get("communication", 0.0) + comm_seconds}
        values = {"wall": window.wall, **seconds, "samples": window.samples, "batches": window.batches}
        util = dict(sample_utilisation())
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            util["memory_peak_frac"] = torch.cuda.max_memory_allocated(device) / total
        variability = summarise_window(window.step_times, window.data_times, window.first_batch)
        return RankWindow(
            stages={f: float(values[f]) for f in ROW_FIELDS},
            utilisation={f: float(util.get(f, math.nan)) for f in UTIL_FIELDS},
            comm_passes=float(comm_passes),
            variability=dict(zip(VARIABILITY_FIELDS, variability)),
        )

    def add(self, rows: list[RankWindow]) -> tuple[WindowBreakdown, dict[str, float]] | None:
        """Add every rank's row of one window: its breakdown (``shares``, ``step_seconds``,
        ``per_rank_seconds``) and the utilisation reduced over the ranks that measured it; ``None`` when no rank
        measured it (or the breakdown leaves it out)."""
        while len(self.var_rows) < len(rows):
            self.var_rows.append([])
        for rank, r in enumerate(rows):
            variability = r.variability_row()
            if variability is not None:
                self.var_rows[rank].append(variability)
        measured = [r for r in rows if r.measured]
        if not measured:
            return None
        window = self.breakdown.add([r.stage_row() for r in rows])
        if window is None:
            return None
        util = reduce_utilisation(
            {f: [r.utilisation[f] for r in measured if math.isfinite(r.utilisation[f])] for f in UTIL_FIELDS}
        )
        for f, v in util.items():
            self.util_sums.setdefault(f, []).append(v)
        self.comm_passes += int(sum(r.comm_passes for r in measured if math.isfinite(r.comm_passes)))
        self.timeline.append(
            {
                "batch": self.breakdown.batches,
                "shares": window.shares,
                "step_seconds": window.step_seconds,
                "samples_per_sec": window.samples_per_sec,
            }
        )
        return window, util

    def live_context(self, ctx: RunContext) -> RunContext:
        """``ctx`` (changed in place and returned) with what the windows so far measured."""
        util = reduce_utilisation(self.util_sums)
        ctx.gpu_utilisation = util["gpu_util_pct"] / 100.0 if "gpu_util_pct" in util else None
        ctx.memory_peak_fraction = util.get("memory_peak_frac")
        ctx.batch_size = int(statistics.median(self.batch_sizes)) if self.batch_sizes else None
        ctx.communication_measured = self.comm_passes > 0
        return ctx


def window_metrics(shares: dict[str, float], step_seconds: float, util: dict[str, float]) -> dict[str, float]:
    """The ``doctor/`` keys of one window (the table in the doctor's docstring)."""
    values = {f"doctor/share_{s}": shares[s] for s in STAGES}
    values["doctor/data_wait_pct"] = 100.0 * shares["data"]
    values["doctor/step_ms"] = 1000.0 * step_seconds
    for key in ("cpu_process_pct", "cpu_workers_pct", "gpu_util_pct"):
        if key in util:
            values[f"doctor/{key}"] = util[key]
    if "memory_peak_frac" in util:
        values["doctor/memory_peak_pct"] = 100.0 * util["memory_peak_frac"]
    return values
