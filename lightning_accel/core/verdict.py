"""The doctor's verdict: measured windows, fit phases and smells → one
:class:`~lightning_accel.core.report.DoctorReport`.

Pure (no Lightning): the callback calls it at the end of ``fit``; any other loop that fed a
:class:`~lightning_accel.core.breakdown.Breakdown` (e.g. from :class:`~lightning_accel.core.stages.StageMachine`
windows) gets the same report, with the step rules, stragglers, variability and fit findings applied the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_accel.core.breakdown import Breakdown
from lightning_accel.core.phases import FitBreakdown, diagnose_fit
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import Diagnosis, RunContext, Thresholds, diagnose, holding_back
from lightning_accel.core.utilisation import reduce_utilisation
from lightning_accel.core.variability import merge_windows, variability_finding

__all__ = ["build_report"]


def build_report(breakdown: Breakdown, *, context: RunContext, thresholds: Thresholds, world_size: int = 1,
                 fit: FitBreakdown | None = None, smells: Diagnosis | None = None,
                 variability_rows: Sequence[Sequence[Sequence[float]]] = (),
                 utilisation: Mapping[str, Sequence[float]] | None = None, window: int | None = None,
                 timeline: Sequence[dict[str, Any]] = (), precision: Mapping[str, Any] | None = None,
                 notes: Sequence[str] = (), empty_note: str = "too little data to diagnose") -> DoctorReport:
    """The report of a run.

    Args:
        breakdown: the windows added so far (rows of every rank).
        context: run facts (``mfu`` is copied to the report).
        thresholds: where the rules fire.
        world_size: ranks; with more than one, per-rank shares/seconds are kept and the straggler rule runs.
        fit: the fit phases (:class:`~lightning_accel.core.phases.FitClock`), for ``fit`` and ``fit_findings``.
        smells: the :func:`~lightning_accel.core.smells.find_smells` result.
        variability_rows: per rank, its windows' :data:`~lightning_accel.core.variability.VARIABILITY_FIELDS` rows.
        utilisation: field → one value per window (``memory_peak_frac`` is reported as the max, the rest as means).
        window: batches per window (a note when fewer were measured).
        timeline / precision / notes: copied to the report.
        empty_note: the note when no window was measured.
    """
    notes = list(notes)
    report = DoctorReport(world_size=world_size, context=context, thresholds=vars(thresholds).copy(),
                          precision=dict(precision or {}), notes=notes, timeline=list(timeline),
                          windows=len(breakdown.windows), batches=breakdown.batches)
    if fit is not None:
        report.fit = fit.to_dict()
        report.fit_findings = diagnose_fit(fit, context, thresholds).findings
    if smells is not None:
        report.smells, report.smells_skipped = list(smells.findings), list(smells.skipped)
    shares = breakdown.shares()
    if shares is None:
        notes.append(empty_note)
        return report
    report.shares = shares
    report.stage_seconds = breakdown.stage_seconds() or {}
    rank_seconds = breakdown.rank_stage_seconds()
    if world_size > 1:
        report.rank_shares = breakdown.rank_shares()
        report.rank_stage_seconds = rank_seconds
    report.step_seconds = breakdown.step_seconds()
    report.samples_per_sec = breakdown.samples_per_sec()
    report.mfu = context.mfu
    report.utilisation = reduce_utilisation(utilisation or {})
    if window is not None and breakdown.batches < window:
        notes.append(f"only {breakdown.batches} batches measured (window={window}): the shares are noisy")
    diagnosis = diagnose(shares, context, thresholds, rank_seconds=rank_seconds if world_size > 1 else None)
    report.findings, report.skipped = diagnosis.findings, diagnosis.skipped
    # the verdict comes from the step rules; variability is a finding beside it, not a stage that holds back
    report.bottleneck = holding_back(shares, diagnosis.findings)
    report.variability = [merge_windows(rows) or {} for rows in variability_rows]
    spread = [(stats["step_p95"] / stats["step_p5"], rank) for rank, stats in enumerate(report.variability)
              if stats and stats["step_p5"] > 0]
    if spread:
        _, worst = max(spread)
        finding = variability_finding(report.variability[worst], context, thresholds,
                                      rank=worst if world_size > 1 else None)
        if finding is not None:
            report.findings.append(finding)
    return report
