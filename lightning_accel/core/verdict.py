"""The doctor's verdict: measured windows, fit phases and smells → one
:class:`~lightning_accel.core.report.DoctorReport`, its findings reconciled so that no two claim the same seconds.

Pure (no Lightning): the callback calls it at the end of ``fit``; any other loop that fed a
:class:`~lightning_accel.core.breakdown.Breakdown` (e.g. from :class:`~lightning_accel.core.stages.StageMachine`
windows) gets the same report. See docs/method.md (Outside the step), which says how the findings are reconciled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_accel.core.breakdown import Breakdown
from lightning_accel.core.findings import by_saving
from lightning_accel.core.phases import FitBreakdown, diagnose_fit, phase_cadences
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import Diagnosis, Finding, RunContext, Thresholds, diagnose, holding_back
from lightning_accel.core.utilisation import reduce_utilisation
from lightning_accel.core.variability import merge_windows, spike_phase, variability_finding

__all__ = ["build_report", "place_finding", "step_to_fit"]


def step_to_fit(fit: Mapping[str, Any] | FitBreakdown | None) -> float:
    """The factor that turns a share of the step time into a share of the fit after start-up: the measured
    training batches' share of that fit (1.0 when no fit was measured: savings stay shares of the step)."""
    if fit is None:
        return 1.0
    data = fit.to_dict() if isinstance(fit, FitBreakdown) else fit
    seconds = data.get("seconds", {})
    base = float(data.get("wall", 0.0)) - float(seconds.get("startup", 0.0))
    if base <= 0:
        return 1.0
    return max(0.0, min(1.0, float(seconds.get("train", 0.0)) / base))


def _rescaled(findings: Sequence[Finding], factor: float) -> list[Finding]:
    return [f if f.saving is None or factor == 1.0 else replace(f, saving=f.saving * factor) for f in findings]


def place_finding(report: DoctorReport, finding: Finding) -> None:
    """Add a step finding measured outside the breakdown (e.g. the pipeline bubble) to ``report.findings`` at the
    place its saving gives it (its saving, a share of the step, rescaled as :func:`build_report` does)."""
    report.findings = by_saving([*report.findings, *_rescaled([finding], step_to_fit(report.fit or None))])


def _fold(step: list[Finding], extra: Finding, rank: int | None) -> list[Finding] | None:
    """``step`` with ``extra`` (a variability finding) joined to the step finding that counts the same stage's
    seconds (the data wait, or the straggler on ``rank``); ``None`` when there is none."""
    for i, f in enumerate(step):
        if f.stage != extra.stage or f.rule == "step_variability":
            continue
        if f.rule == "straggler" and not f.evidence.startswith(f"rank {rank if rank is not None else 0} "):
            continue
        joined = replace(
            f,
            evidence=f"{f.evidence} Its batch times vary too: {extra.evidence}",
            fix=f"{f.fix} For the slow batches: {extra.fix}",
        )
        return [*step[:i], joined, *step[i + 1 :]]
    return None


def build_report(
    breakdown: Breakdown,
    *,
    context: RunContext,
    thresholds: Thresholds,
    world_size: int = 1,
    fit: FitBreakdown | None = None,
    smells: Diagnosis | None = None,
    variability_rows: Sequence[Sequence[Sequence[float]]] = (),
    utilisation: Mapping[str, Sequence[float]] | None = None,
    window: int | None = None,
    timeline: Sequence[dict[str, Any]] = (),
    precision: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
    empty_note: str = "too little data to diagnose",
) -> DoctorReport:
    """The report of a run; ``report.findings`` holds the step, variability and fit findings reconciled (see
    docs/method.md, Outside the step), largest saving first, and ``report.fit_findings`` the fit ones among them.

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
    report = DoctorReport(
        world_size=world_size,
        context=context,
        thresholds=vars(thresholds).copy(),
        precision=dict(precision or {}),
        notes=notes,
        timeline=list(timeline),
        windows=len(breakdown.windows),
        batches=breakdown.batches,
    )
    if fit is not None:
        report.fit = fit.to_dict()
    if smells is not None:
        report.smells, report.smells_skipped = list(smells.findings), list(smells.skipped)
    shares = breakdown.shares()
    if shares is None:
        notes.append(empty_note)
        if fit is not None:
            report.findings = report.fit_findings = by_saving(diagnose_fit(fit, context, thresholds).findings)
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

    report.variability = [merge_windows(rows) or {} for rows in variability_rows]
    spread = [
        (stats["step_p95"] / stats["step_p5"], rank)
        for rank, stats in enumerate(report.variability)
        if stats and stats["step_p5"] > 0
    ]
    worst = max(spread)[1] if spread else None
    stats = report.variability[worst] if worst is not None else {}
    cadences = phase_cadences(context, fit)
    rank = worst if world_size > 1 else None
    varied = variability_finding(stats, context, thresholds, rank=rank, cadences=cadences) if stats else None

    # the spikes at a fit phase's cadence: that phase's finding counts them when it fires with them
    fit_findings: list[Finding] = diagnose_fit(fit, context, thresholds).findings if fit is not None else []
    accounted: list[tuple[str, float, str]] = []
    phase = spike_phase(stats, cadences) if stats else None
    if phase is not None and varied is not None and stats.get("seconds", 0.0) > 0:
        data_share = stats.get("spike_data_excess", 0.0) / stats["seconds"]
        with_tail = (
            diagnose_fit(
                fit, context, thresholds, tails={phase: (stats["spike_excess"], int(stats["spikes"]))}
            ).findings
            if fit is not None
            else []
        )
        if any(f.stage == phase for f in with_tail):
            fit_findings, varied = with_tail, None
            accounted.append(("data", data_share, f"the {phase} finding"))
        else:
            accounted.append(("data", data_share, "the step_variability finding"))

    diagnosis = diagnose(
        shares, context, thresholds, rank_seconds=rank_seconds if world_size > 1 else None, accounted=accounted
    )
    report.skipped = diagnosis.skipped
    # the verdict comes from the step rules; variability is a finding beside it, not a stage that holds back
    report.bottleneck = holding_back(shares, diagnosis.findings)
    step = list(diagnosis.findings)
    if varied is not None:
        folded = _fold(step, varied, rank) if phase is None else None
        step = folded if folded is not None else [*step, varied]
    factor = step_to_fit(fit)
    report.findings = by_saving([*_rescaled(step, factor), *fit_findings])
    report.fit_findings = [f for f in report.findings if f.kind == "fit"]
    return report
