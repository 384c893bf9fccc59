"""One rank's facts about one of the doctor's windows, as a typed record.

Each rank closes a window with a :class:`RankWindow`: the stage row (:data:`~lightning_accel.core.breakdown.ROW_FIELDS`:
wall time, seconds per measured stage, samples, batches), the utilisation sampled at the window's edge
(:data:`UTIL_FIELDS`), the DDP comm-hook passes counted in it, and its batch-time summary
(:data:`~lightning_accel.core.variability.VARIABILITY_FIELDS`). The ranks exchange them in one collective as flat
float vectors (:meth:`RankWindow.to_floats` / :meth:`RankWindow.from_floats`); nothing else reads a value by its
position. NaN marks what a rank does not know (a utilisation it cannot sample) or could not measure (the whole row).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_accel.core.breakdown import ROW_FIELDS
from lightning_accel.core.variability import VARIABILITY_FIELDS

__all__ = ["UTIL_FIELDS", "RankWindow"]

#: Utilisation fields sampled when a window closes (NaN where a rank has no value).
UTIL_FIELDS: tuple[str, ...] = (
    "cpu_process_pct",
    "cpu_workers_pct",
    "gpu_util_pct",
    "gpu_mem_used_frac",
    "gpu_sm_clock_mhz",
    "memory_peak_frac",
)


@dataclass(frozen=True)
class RankWindow:
    """One rank's window.

    Attributes:
        stages: :data:`~lightning_accel.core.breakdown.ROW_FIELDS` -> value (seconds, samples, batches).
        utilisation: :data:`UTIL_FIELDS` -> value, NaN where unknown.
        comm_passes: DDP comm-hook calls timed in the window.
        variability: :data:`~lightning_accel.core.variability.VARIABILITY_FIELDS` -> value (NaN: no batch times).
    """

    stages: Mapping[str, float]
    utilisation: Mapping[str, float]
    comm_passes: float
    variability: Mapping[str, float]

    #: length of the flat vector a rank sends
    SIZE = len(ROW_FIELDS) + len(UTIL_FIELDS) + 1 + len(VARIABILITY_FIELDS)

    @classmethod
    def unmeasured(cls) -> RankWindow:
        """The row of a rank that could not measure the window (it still joins the collective)."""
        return cls.from_floats([math.nan] * cls.SIZE)

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankWindow:
        """The record from the vector :meth:`to_floats` made (on any rank)."""
        if len(values) != cls.SIZE:
            raise ValueError(f"a window row has {cls.SIZE} values, got {len(values)}")
        it = iter(float(v) for v in values)
        stages = {f: next(it) for f in ROW_FIELDS}
        utilisation = {f: next(it) for f in UTIL_FIELDS}
        passes = next(it)
        return cls(stages, utilisation, passes, {f: next(it) for f in VARIABILITY_FIELDS})

    def to_floats(self) -> list[float]:
        """The flat vector exchanged across ranks: stages, utilisation, passes, variability, in field order."""
        return (
            [float(self.stages[f]) for f in ROW_FIELDS]
            + [float(self.utilisation[f]) for f in UTIL_FIELDS]
            + [float(self.comm_passes)]
            + [float(self.variability[f]) for f in VARIABILITY_FIELDS]
        )

    @property
    def measured(self) -> bool:
        """Whether the rank measured the window (every stage value finite)."""
        return all(math.isfinite(v) for v in self.stages.values())

    def stage_row(self) -> list[float]:
        """The stage values in :data:`~lightning_accel.core.breakdown.ROW_FIELDS` order (``Breakdown.add``)."""
        return [float(self.stages[f]) for f in ROW_FIELDS]

    def variability_row(self) -> list[float] | None:
        """The batch-time summary in :data:`~lightning_accel.core.variability.VARIABILITY_FIELDS` order, or
        ``None`` when the window had no batch times."""
        row = [float(self.variability[f]) for f in VARIABILITY_FIELDS]
        return row if all(math.isfinite(v) for v in row) else None
