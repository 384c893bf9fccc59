"""Stage breakdown over windows and ranks: seconds per stage → shares of the step time that sum to 1.

Each rank measures, per window (a run of consecutive training batches), its wall time and the seconds of each
measured stage; the ranks' rows are gathered once per window and added here. See docs/measuring/doctor.md (The
stages), which says how the shares are weighed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lightning_accel.core.findings import STAGES

__all__ = ["MEASURED_STAGES", "ROW_FIELDS", "Breakdown", "WindowBreakdown", "split_seconds"]

#: Stages timed directly; ``other`` is derived.
MEASURED_STAGES: tuple[str, ...] = ("data", "transfer", "forward", "backward", "optimizer", "communication")
#: Layout of one rank's row for a window, as gathered across ranks.
ROW_FIELDS: tuple[str, ...] = ("wall", *MEASURED_STAGES, "samples", "batches")


def split_seconds(wall: float, measured: Mapping[str, float]) -> dict[str, float]:
    """One rank's window: seconds per stage for every stage of ``STAGES`` (docs/measuring/doctor.md, The stages).

    Args:
        wall: host wall time of the window's batches, seconds.
        measured: seconds per measured stage; ``backward`` includes the exposed ``communication``.
    """
    if wall < 0:
        raise ValueError(f"wall time must be >= 0, got {wall}")
    out = {s: max(0.0, float(measured.get(s, 0.0))) for s in MEASURED_STAGES}
    out["backward"] = max(0.0, out["backward"] - out["communication"])
    out["other"] = max(0.0, wall - sum(out.values()))
    return {s: out[s] for s in STAGES}


@dataclass(frozen=True)
class WindowBreakdown:
    """One window over all ranks.

    Attributes:
        shares: stage → fraction of the window's time (sums to 1).
        stage_seconds: stage → mean seconds per batch (per device).
        step_seconds: mean time of one batch (per device).
        samples_per_sec: global: sum over ranks of each rank's samples ÷ its wall time.
        batches: batches per device in the window.
        per_rank_shares: one ``shares`` dict per rank that measured (to spot a straggler).
        per_rank_seconds: stage → mean seconds per batch, per global rank (``None`` for a rank that could not
            measure this window); the input of :func:`~lightning_accel.core.ranks.find_stragglers`.
    """

    shares: dict[str, float]
    stage_seconds: dict[str, float]
    step_seconds: float
    samples_per_sec: float
    batches: int
    per_rank_shares: list[dict[str, float]]
    per_rank_seconds: list[dict[str, float] | None] = field(default_factory=list)


@dataclass
class Breakdown:
    """Adds windows (rows of :data:`ROW_FIELDS`, one per rank) and keeps time-weighted totals."""

    windows: list[WindowBreakdown] = field(default_factory=list)
    _seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    _batches: float = 0.0  # summed over ranks
    _rank_batches: int = 0  # per device
    _per_rank: list[dict[str, float]] = field(default_factory=list)  # seconds per stage, per rank
    _per_rank_batches: list[float] = field(default_factory=list)

    def add(self, rows: Sequence[Sequence[float]]) -> WindowBreakdown | None:
        """Add one window (``rows[r]`` = rank ``r``'s values in :data:`ROW_FIELDS` order; extra columns are
        ignored; a row with a non-finite value is a rank that could not measure and is left out). Returns ``None``
        when no rank measured a batch."""
        if not rows:
            raise ValueError("a window needs at least one rank's row")
        n = len(ROW_FIELDS)
        for r, row in enumerate(rows):
            if len(row) < n:
                raise ValueError(f"rank {r}: row has {len(row)} values, expected {n} ({', '.join(ROW_FIELDS)})")
        per_rank = []
        per_rank_seconds: list[dict[str, float] | None] = [None] * len(rows)
        totals = dict.fromkeys(STAGES, 0.0)
        batches = samples_rate = 0.0
        while len(self._per_rank) < len(rows):
            self._per_rank.append(dict.fromkeys(STAGES, 0.0))
            self._per_rank_batches.append(0.0)
        for rank, row in enumerate(rows):
            values = dict(zip(ROW_FIELDS, (float(v) for v in row[:n])))
            if not all(math.isfinite(v) for v in values.values()) or values["batches"] <= 0:
                continue
            split = split_seconds(values["wall"], values)
            for s in STAGES:
                self._per_rank[rank][s] += split[s]
            self._per_rank_batches[rank] += values["batches"]
            per_rank_seconds[rank] = {s: split[s] / values["batches"] for s in STAGES}
            total = sum(split.values())
            per_rank.append({s: (split[s] / total if total > 0 else 0.0) for s in STAGES})
            for s in STAGES:
                totals[s] += split[s]
            batches += values["batches"]
            if values["wall"] > 0:
                samples_rate += values["samples"] / values["wall"]
        if not per_rank or batches <= 0:
            return None
        grand = sum(totals.values())
        if grand <= 0:
            return None
        window = WindowBreakdown(
            shares={s: totals[s] / grand for s in STAGES},
            stage_seconds={s: totals[s] / batches for s in STAGES},
            step_seconds=grand / batches,
            samples_per_sec=samples_rate,
            batches=int(round(batches / len(per_rank))),
            per_rank_shares=per_rank,
            per_rank_seconds=per_rank_seconds,
        )
        self.windows.append(window)
        for s in STAGES:
            self._seconds[s] += totals[s]
        self._batches += batches
        self._rank_batches += window.batches
        return window

    @property
    def batches(self) -> int:
        """Batches measured per device."""
        return self._rank_batches

    def shares(self) -> dict[str, float] | None:
        """Time-weighted shares over all windows, or ``None`` before the first window."""
        grand = sum(self._seconds.values())
        if not self.windows or grand <= 0:
            return None
        return {s: self._seconds[s] / grand for s in STAGES}

    def rank_shares(self) -> list[dict[str, float]]:
        """Time-weighted shares of each rank on its own (to spot a straggler); empty before the first window."""
        out = []
        for seconds in self._per_rank:
            total = sum(seconds.values())
            out.append({s: (seconds[s] / total if total > 0 else 0.0) for s in STAGES})
        return out if self.windows else []

    def rank_stage_seconds(self) -> list[dict[str, float]]:
        """Mean seconds per batch and stage of each rank on its own (index = global rank; zeros for a rank that
        never measured); empty before the first window."""
        if not self.windows:
            return []
        return [
            {s: (seconds[s] / n if n > 0 else 0.0) for s in STAGES}
            for seconds, n in zip(self._per_rank, self._per_rank_batches)
        ]

    def stage_seconds(self) -> dict[str, float] | None:
        """Mean seconds per batch and device, per stage."""
        if self._batches <= 0:
            return None
        return {s: self._seconds[s] / self._batches for s in STAGES}

    def step_seconds(self) -> float | None:
        if self._batches <= 0:
            return None
        return sum(self._seconds.values()) / self._batches

    def samples_per_sec(self) -> float | None:
        """Global throughput, time-weighted over windows."""
        if not self.windows:
            return None
        weights = [w.step_seconds * w.batches for w in self.windows]
        if sum(weights) <= 0:
            return None
        return sum(w.samples_per_sec * wt for w, wt in zip(self.windows, weights)) / sum(weights)
