"""Step-time variability: p95 ÷ p5 of batch times, spikes, and their likely cause.

A window's batch times (host seconds per batch) and data waits are summarised into a fixed row of numbers
(:data:`VARIABILITY_FIELDS`), cheap to gather across ranks; :func:`merge_windows` pools the windows of a rank and
:func:`variability_finding` names the cause. See docs/method.md (Outside the step), which defines a spike, when
the finding fires and the causes it names.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from lightning_accel.core.findings import Finding, RunContext, Thresholds
from lightning_accel.core.phases import phase_cadences

__all__ = ["VARIABILITY_FIELDS", "merge_windows", "spike_phase", "summarise_window", "variability_finding"]

#: The summary of one window of one rank (gathered with the stage row).
VARIABILITY_FIELDS: tuple[str, ...] = (
    "step_p5",
    "step_p50",
    "step_p95",
    "spikes",
    "spike_excess",
    "spike_data_excess",
    "spike_first",
    "spike_last",
    "spike_gap",
    "spike_gap_agree",
    "seconds",
)
_SPIKE = 2.0
_SPIKE_SHARE = 0.05  # spikes whose extra time is >= 5 % of the measured time are a finding even with a calm p95


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _period(gaps: Sequence[int]) -> int:
    """The common gap between spikes when there are at least 2 gaps (3 spikes) and 3/4 of them agree (±1), else 0."""
    if len(gaps) < 2:
        return 0
    gap, _ = Counter(g for g in gaps if g > 0).most_common(1)[0] if any(g > 0 for g in gaps) else (0, 0)
    close = sum(1 for g in gaps if abs(g - gap) <= 1)
    return gap if gap > 1 and close >= 0.75 * len(gaps) else 0


def summarise_window(step_times: Sequence[float], data_times: Sequence[float], first_batch: int = 0) -> list[float]:
    """One window's row of :data:`VARIABILITY_FIELDS` (NaN for an empty window).

    Args:
        step_times: host seconds of each batch, in order.
        data_times: the data wait of each batch (same length).
        first_batch: index of the window's first batch (spike positions are counted from it).
    """
    if not step_times:
        return [math.nan] * len(VARIABILITY_FIELDS)
    if len(data_times) != len(step_times):
        raise ValueError(f"{len(step_times)} step times but {len(data_times)} data times")
    ordered = sorted(step_times)
    median = _quantile(ordered, 0.5)
    data_median = statistics.median(data_times)
    spikes = [i for i, t in enumerate(step_times) if median > 0 and t > _SPIKE * median]
    excess = sum(step_times[i] - median for i in spikes)
    data_excess = sum(max(0.0, data_times[i] - data_median) for i in spikes)
    gaps = [b - a for a, b in zip(spikes, spikes[1:])]
    gap = Counter(gaps).most_common(1)[0][0] if gaps else 0
    agree = sum(1 for g in gaps if abs(g - gap) <= 1)
    first, last = (first_batch + spikes[0], first_batch + spikes[-1]) if spikes else (-1, -1)
    return [
        _quantile(ordered, 0.05),
        median,
        _quantile(ordered, 0.95),
        float(len(spikes)),
        excess,
        data_excess,
        float(first),
        float(last),
        float(gap),
        float(agree),
        float(sum(step_times)),
    ]


def merge_windows(rows: Sequence[Sequence[float]]) -> dict[str, float] | None:
    """Pool one rank's window summaries (in order): mean p5/p50/p95, summed spikes and excess, and the spike period:
    the gap that 3/4 of the gaps between spikes share, within windows (each window's most common gap) and across
    window edges (0: no period)."""
    rows = [r for r in rows if all(math.isfinite(v) for v in r[: len(VARIABILITY_FIELDS)])]
    if not rows:
        return None
    cols = {f: [r[i] for r in rows] for i, f in enumerate(VARIABILITY_FIELDS)}
    gaps, last = [], None
    for row in rows:
        stats = dict(zip(VARIABILITY_FIELDS, row))
        if stats["spikes"] <= 0:
            continue
        if last is not None:
            gaps.append(int(stats["spike_first"] - last))
        agree = int(stats["spike_gap_agree"])
        gaps.extend([int(stats["spike_gap"])] * agree + [-1] * (int(stats["spikes"]) - 1 - agree))
        last = stats["spike_last"]
    return {
        "step_p5": statistics.fmean(cols["step_p5"]),
        "step_p50": statistics.fmean(cols["step_p50"]),
        "step_p95": statistics.fmean(cols["step_p95"]),
        "spikes": sum(cols["spikes"]),
        "spike_excess": sum(cols["spike_excess"]),
        "spike_data_excess": sum(cols["spike_data_excess"]),
        "spike_period": float(_period(gaps)),
        "windows": float(len(rows)),
        "seconds": sum(cols["seconds"]),
    }


def _matching(stats: Mapping[str, float], cadences: Mapping[str, int]) -> list[str]:
    """The periodic work whose cadence (batches between runs) the spikes' period matches (within one batch)."""
    period = int(stats.get("spike_period", 0))
    if period <= 0 or int(stats.get("spikes", 0)) < 3:
        return []
    return [work for work, every in cadences.items() if every > 0 and abs(period - every) <= 1]


def spike_phase(stats: Mapping[str, float], cadences: Mapping[str, int]) -> str | None:
    """The fit phase (``checkpoint`` or ``validation``) whose cadence the spikes follow, or ``None``: their extra
    time is then that phase's tail in the training batches (the checkpoint first when both match).

    Args:
        stats: a :func:`merge_windows` result.
        cadences: work → training batches between runs (:func:`~lightning_accel.core.phases.phase_cadences`).
    """
    matched = _matching(stats, cadences)
    return next((phase for phase in ("checkpoint", "validation") if phase in matched), None)


def variability_finding(
    stats: Mapping[str, float],
    context: RunContext | None = None,
    thresholds: Thresholds | None = None,
    *,
    rank: int | None = None,
    cadences: Mapping[str, int] | None = None,
) -> Finding | None:
    """The ``step_variability`` finding when p95 ÷ p5 of the batch times exceeds ``thresholds.variability`` or at
    least 3 spikes at a fixed interval add >= 5 % to the measured time.

    Args:
        stats: a :func:`merge_windows` result.
        context: run facts (logging and checkpoint cadence, the DataLoader's settings) to name the cause.
        thresholds: where the rule fires.
        rank: the rank the stats are from (named in the evidence under DDP).
        cadences: work → training batches between runs, to name periodic spikes' cause (default: the context's
            settings, :func:`~lightning_accel.core.phases.phase_cadences`).
    """
    th = thresholds or Thresholds()
    ctx = context or RunContext()
    p5, p50, p95 = stats["step_p5"], stats["step_p50"], stats["step_p95"]
    if p5 <= 0:
        return None
    spikes, excess = int(stats.get("spikes", 0)), stats.get("spike_excess", 0.0)
    seconds = stats.get("seconds", 0.0)
    spike_share = excess / seconds if seconds > 0 else 0.0
    # rare periodic spikes (one per window) leave p95 alone: their share of the time counts too (periodic only, so
    # that a few scheduler hiccups on a busy machine are not a finding)
    periodic = int(stats.get("spike_period", 0)) > 0
    if p95 / p5 <= th.variability and not (periodic and spikes >= 3 and spike_share >= _SPIKE_SHARE):
        return None
    where = f" on rank {rank}" if rank is not None else ""
    ratio = p95 / p5
    evidence = (
        f"batch times vary{where}: p5 {1e3 * p5:.2f} ms, median {1e3 * p50:.2f} ms, p95 {1e3 * p95:.2f} ms "
        f"(p95/p5 {ratio:.1f}, threshold {th.variability:.1f})"
    )
    period = int(stats.get("spike_period", 0))
    data_frac = stats.get("spike_data_excess", 0.0) / excess if excess > 0 else 0.0
    matched = _matching(stats, phase_cadences(ctx) if cadences is None else cadences)
    if spikes:
        evidence += (
            f"; {spikes} batch(es) took over {_SPIKE:.0f}x the median, {1e3 * excess:.1f} ms extra in all "
            f"({100 * spike_share:.1f} % of the measured time)"
        )
    # spikes at a checkpoint's or validation's cadence are that phase's, even when they are data wait
    if spikes and data_frac >= 0.5 and not {"checkpoint", "validation"} & set(matched):
        stage = "data"
        evidence += f", {100 * data_frac:.0f} % of it waiting for data: bursty data stalls."
        steps = []
        if ctx.loader == "DALIImageDataModule":  # a DALI pipeline has its own queue and threads, no workers
            steps.append(
                "deepen DALI's queue so it absorbs slow batches: "
                f"DALIImageDataModule(prefetch_queue_depth={max(3, (ctx.prefetch_queue_depth or 2) + 1)})"
            )
        elif ctx.num_workers == 0:
            steps.append(
                "load in background workers: DataLoader(num_workers=4, persistent_workers=True, prefetch_factor=4)"
            )
        else:
            steps.append(
                "prefetch deeper so the queue absorbs slow batches: DataLoader(prefetch_factor=4 or more"
                + (", persistent_workers=True" if ctx.persistent_workers is False else "")
                + ")"
            )
            steps.append("add workers (DataLoaderTuner searches num_workers/prefetch_factor)")
        steps.append("find the slow samples (very large files, remote reads) and pre-process them once")
        fix = "; ".join(steps) + "."
    elif spikes and period:
        stage = "data" if data_frac >= 0.5 else "other"
        causes = []
        if "logging" in matched:
            causes.append(
                f"logging (Trainer(log_every_n_steps={ctx.log_every_n_steps})): log less often or "
                "keep .item()/host syncs out of the logged values"
            )
        if "checkpoint" in matched:
            every = ctx.checkpoint_every_n_train_steps
            causes.append(
                f"checkpoints ({f'ModelCheckpoint(every_n_train_steps={every})' if every else 'the saves'}"
                "): save less often, or in the background with Trainer(plugins=[AsyncCheckpointIO()])"
            )
        if "validation" in matched:
            interval = ctx.val_check_interval
            causes.append(
                f"validation ({f'Trainer(val_check_interval={interval})' if interval else 'its runs'}): "
                "the set-up before each run (its DataLoader's workers starting) lands in the next batch; "
                "DataLoader(persistent_workers=True) for validation, or validate less often"
            )
        if not causes:
            causes.append(
                f"work that runs every {period} batches: a callback or logger with that cadence, or "
                "Python's garbage collector (gc.freeze() after set-up, or gc.disable() and gc.collect() "
                "every N steps)"
            )
        evidence += f", every {period} batches: periodic work on the step."
        fix = "; ".join(causes) + "."
    else:
        stage = "other"
        evidence += "." if not spikes else ", at no fixed interval."
        fix = (
            "look for work outside the model: Python's garbage collector (gc.freeze() after set-up), other "
            "processes on the machine's cores or GPU, variable-length batches (bucket by length); a "
            "ProfileWindow trace of the slow steps shows which."
        )
    return Finding("step_variability", stage, evidence, fix, ratio, saving=spike_share)
