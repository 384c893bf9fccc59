"""The whole fit: wall time split into start-up, training steps, validation, checkpoint saving and the rest.

:class:`FitClock` attributes wall time to nested phases (the innermost open phase gets the time);
:func:`diagnose_fit` turns the result into findings with the concrete Trainer / ``ModelCheckpoint`` settings. See
docs/method.md (Outside the step), which defines the phases (:data:`FIT_PHASES`) and a fit finding's saving.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_accel.core.findings import Diagnosis, Finding, RunContext, Thresholds

__all__ = ["FIT_PHASES", "FitBreakdown", "FitClock", "diagnose_fit", "phase_cadences"]

FIT_PHASES: tuple[str, ...] = ("startup", "train", "validation", "checkpoint", "other")
# Where the fixes aim: validation at ~5 % of the fit, checkpoints at ~2 %.
_VALIDATION_TARGET = 0.05
_CHECKPOINT_TARGET = 0.02


@dataclass
class FitBreakdown:
    """Seconds per fit phase and how often each ran.

    Attributes:
        seconds: phase → wall seconds (keys of :data:`FIT_PHASES`).
        wall: the fit's wall time, seconds.
        counts: ``validation`` (runs in fit), ``sanity_check`` (0 or 1), ``checkpoint`` (saves).
        sanity_seconds: the part of ``validation`` that was the sanity check.
        train_batches: training batches run (per device, warm-up included).
    """

    seconds: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    sanity_seconds: float = 0.0
    train_batches: int = 0

    def shares(self) -> dict[str, float]:
        """Phase → fraction of the fit's wall time."""
        return {p: (self.seconds.get(p, 0.0) / self.wall if self.wall > 0 else 0.0) for p in FIT_PHASES}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FitBreakdown:
        return cls(
            seconds={str(k): float(v) for k, v in data.get("seconds", {}).items()},
            wall=float(data.get("wall", 0.0)),
            counts={str(k): int(v) for k, v in data.get("counts", {}).items()},
            sanity_seconds=float(data.get("sanity_seconds", 0.0)),
            train_batches=int(data.get("train_batches", 0)),
        )


class FitClock:
    """Wall time per fit phase; the innermost open phase gets the time.

    Args:
        clock: host clock in seconds (injectable for tests).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._start: float | None = None
        self._end: float | None = None
        self._stack: list[str] = []
        self._since = 0.0
        self._seconds = dict.fromkeys(FIT_PHASES, 0.0)
        self.counts: dict[str, int] = {"validation": 0, "sanity_check": 0, "checkpoint": 0}
        self.sanity_seconds = 0.0
        self._sanity_from: float | None = None

    def start(self) -> None:
        """The fit starts (``setup``)."""
        self._start = self._since = self.clock()

    def enter(self, phase: str, *, sanity: bool = False, count: bool = True) -> None:
        """Open ``phase`` (nested inside the open one); ``sanity`` marks the sanity check, ``count=False`` adds time
        without counting a run (e.g. deleting an old checkpoint)."""
        if phase not in FIT_PHASES or phase in ("train", "other"):
            raise ValueError(
                f"FitClock.enter({phase!r}): use 'startup', 'validation' or 'checkpoint' ('train' is "
                "the step breakdown's wall time, 'other' the rest)"
            )
        now = self._charge()
        self._stack.append(phase)
        if phase == "validation" and sanity:
            self._sanity_from = now
        if count:
            self.count_run(phase, sanity=sanity)

    def count_run(self, phase: str, *, sanity: bool = False) -> None:
        """Count one run of ``phase`` (``enter(..., count=False)`` opened it before it was known to run)."""
        key = "sanity_check" if phase == "validation" and sanity else phase
        if key in self.counts:
            self.counts[key] += 1

    def exit(self, phase: str) -> None:
        """Close ``phase`` (and any phase opened inside it and left open); a phase not open is ignored."""
        if phase not in self._stack:
            return
        now = self._charge()
        while self._stack:
            if self._stack.pop() == phase:
                break
        if phase == "validation" and self._sanity_from is not None:
            self.sanity_seconds += now - self._sanity_from
            self._sanity_from = None

    def is_open(self, phase: str) -> bool:
        return phase in self._stack

    def stop(self) -> None:
        """The fit ends: open phases close."""
        self._charge()
        self._stack.clear()
        self._end = self.clock()

    def _charge(self) -> float:
        now = self.clock()
        if self._stack:
            self._seconds[self._stack[-1]] += now - self._since
        self._since = now
        return now

    def breakdown(self, train_seconds: float, train_batches: int = 0) -> FitBreakdown:
        """The fit's phases, with ``train_seconds`` (the measured batches' wall time) as ``train``."""
        if self._start is None:
            return FitBreakdown()
        end = self._end if self._end is not None else self.clock()
        wall = max(0.0, end - self._start)
        seconds = {p: self._seconds[p] for p in ("startup", "validation", "checkpoint")}
        seconds["train"] = max(0.0, min(train_seconds, wall - sum(seconds.values())))
        seconds["other"] = max(0.0, wall - sum(seconds.values()))
        return FitBreakdown(
            seconds={p: seconds[p] for p in FIT_PHASES},
            wall=wall,
            counts=dict(self.counts),
            sanity_seconds=self.sanity_seconds,
            train_batches=train_batches,
        )


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def phase_cadences(context: RunContext | None = None, fit: FitBreakdown | None = None) -> dict[str, int]:
    """Training batches between two runs of the periodic work a step-time spike can come from: ``logging``
    (``log_every_n_steps``), ``checkpoint`` (``ModelCheckpoint(every_n_train_steps)``) and ``validation`` (an int
    ``val_check_interval``); both count optimizer steps or batches as Lightning does (x ``accumulate_grad_batches``
    for the step counts). Without the setting, a fit's measured cadence: its training batches ÷ its runs of the
    phase. Work with no known cadence is left out."""
    ctx = context or RunContext()
    accumulate = ctx.accumulate_grad_batches or 1
    out: dict[str, int] = {}
    if ctx.log_every_n_steps:
        out["logging"] = ctx.log_every_n_steps * accumulate
    if ctx.checkpoint_every_n_train_steps:
        out["checkpoint"] = ctx.checkpoint_every_n_train_steps * accumulate
    interval = ctx.val_check_interval
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        out["validation"] = interval
    if fit is not None and fit.train_batches > 0:
        for phase in ("checkpoint", "validation"):
            runs = fit.counts.get(phase, 0)
            if phase not in out and runs >= 2:
                out[phase] = round(fit.train_batches / runs)
    return out


def diagnose_fit(
    fit: FitBreakdown,
    context: RunContext | None = None,
    thresholds: Thresholds | None = None,
    *,
    tails: Mapping[str, tuple[float, int]] | None = None,
) -> Diagnosis:
    """Findings about the fit outside the training step: ``validation_heavy``, ``checkpoint_heavy``.

    Shares are of the fit after start-up (wall − ``startup``), so a long compilation does not hide them.

    Args:
        fit: the fit's phases.
        context: the Trainer's validation and checkpoint settings (for the fix).
        thresholds: where the findings fire (``validation_share``, ``checkpoint_share``).
        tails: phase → (seconds, batches): the extra time of the training batches that run slow right after each
            run of the phase (spikes at its cadence), which the step time counted. It is that phase's cost: it is
            added to the phase's share, and the evidence says how much of it there was.
    """
    ctx = context or RunContext()
    th = thresholds or Thresholds()
    out = Diagnosis()
    base = fit.wall - fit.seconds.get("startup", 0.0)
    if base <= 0:
        return out
    tails = dict(tails or {})
    for phase, (seconds, batches) in tails.items():
        if phase not in ("validation", "checkpoint") or not seconds >= 0 or batches < 0:
            raise ValueError(
                f"tails[{phase!r}] = ({seconds!r}, {batches!r}): give 'validation' or 'checkpoint' "
                "with seconds >= 0 and a batch count >= 0"
            )
    val_tail = tails.get("validation", (0.0, 0))
    val = fit.seconds.get("validation", 0.0) + val_tail[0]
    runs = fit.counts.get("validation", 0)
    if val / base > th.validation_share:
        out.findings.append(_validation_finding(fit, ctx, th, base, val, runs, val_tail))
    ckpt_tail = tails.get("checkpoint", (0.0, 0))
    ckpt = fit.seconds.get("checkpoint", 0.0) + ckpt_tail[0]
    if ckpt / base > th.checkpoint_share:
        out.findings.append(_checkpoint_finding(fit, ctx, th, base, ckpt, ckpt_tail))
    return out


def _tail_clause(tail: tuple[float, int], after: str) -> str:
    seconds, batches = tail
    if seconds <= 0:
        return ""
    return (
        f"; {seconds:.2f} s of it are the {batches} training batch(es) that ran slow right after {after} "
        "(counted in the step time)"
    )


def _validation_finding(
    fit: FitBreakdown, ctx: RunContext, th: Thresholds, base: float, val: float, runs: int, tail: tuple[float, int]
) -> Finding:
    share = val / base
    evidence = (
        f"validation takes {val:.2f} s of the {base:.2f} s fit after start-up ({_pct(share)}, threshold "
        f"{_pct(th.validation_share)})"
    )
    if runs:
        per_run = (val - tail[0] - fit.sanity_seconds) / runs
        evidence += f": {runs} run(s) of {per_run:.2f} s"
        if fit.train_batches:
            evidence += f", one every {fit.train_batches / runs:.0f} training batches"
    if fit.sanity_seconds > 0:
        evidence += f"; the sanity check {fit.sanity_seconds:.2f} s"
    evidence += _tail_clause(tail, "a validation run")
    # validate k x less (or on k x fewer batches) to bring it to ~5 % of the fit
    train_like = max(base - val, 1e-9)
    k = max(2, math.ceil(val / (_VALIDATION_TARGET / (1 - _VALIDATION_TARGET) * train_like)))
    steps = []
    interval = ctx.val_check_interval
    if isinstance(interval, int) and not isinstance(interval, bool):  # an int: every N training batches
        steps.append(f"validate {k}x less often: Trainer(val_check_interval={int(interval * k)})")
    elif ctx.check_val_every_n_epoch is not None:
        if interval is not None and interval < 1:
            steps.append(
                f"validate {k}x less often: Trainer(val_check_interval={min(1.0, interval * k):.2g}"
                + (
                    ")"
                    if interval * k <= 1
                    else f", check_val_every_n_epoch={math.ceil(interval * k * ctx.check_val_every_n_epoch)})"
                )
            )
        else:
            steps.append(
                f"validate {k}x less often: Trainer(check_val_every_n_epoch={ctx.check_val_every_n_epoch * k})"
            )
    else:
        steps.append(f"validate {k}x less often (Trainer(val_check_interval=..., check_val_every_n_epoch=...))")
    limit = ctx.limit_val_batches
    if limit is not None and limit > 1:
        steps.append(f"or on fewer batches: Trainer(limit_val_batches={max(1, int(limit / k))})")
    elif limit is not None:
        steps.append(f"or on fewer batches: Trainer(limit_val_batches={limit / k:.2g})")
    if fit.sanity_seconds > 0.5 * val:
        steps.append("the sanity check is most of it: Trainer(num_sanity_val_steps=0) skips it")
    if tail[0] > 0:
        steps.append(
            "the slow batches after each run wait for what Lightning does before on_validation_start: the "
            "validation DataLoader's workers starting (keep them: DataLoader(persistent_workers=True)) or "
            "the model's on_validation_model_eval"
        )
    return Finding(
        "validation_heavy", "validation", evidence + ".", "; ".join(steps) + ".", share, kind="fit", saving=share
    )


def _checkpoint_finding(
    fit: FitBreakdown, ctx: RunContext, th: Thresholds, base: float, ckpt: float, tail: tuple[float, int]
) -> Finding:
    share = ckpt / base
    saves = fit.counts.get("checkpoint", 0)
    evidence = (
        f"saving checkpoints takes {ckpt:.2f} s of the {base:.2f} s fit after start-up ({_pct(share)}, "
        f"threshold {_pct(th.checkpoint_share)})"
    )
    if saves:
        evidence += f": {saves} save(s) of {1e3 * (ckpt - tail[0]) / saves:.0f} ms"
    every = ctx.checkpoint_every_n_train_steps
    if every:
        evidence += f", every {every} training step(s)"
    evidence += _tail_clause(tail, "a save")
    train_like = max(base - ckpt, 1e-9)
    k = max(2, math.ceil(ckpt / (_CHECKPOINT_TARGET / (1 - _CHECKPOINT_TARGET) * train_like)))
    steps = []
    if every:
        steps.append(f"save {k}x less often: ModelCheckpoint(every_n_train_steps={every * k})")
    else:
        steps.append(f"save {k}x less often: ModelCheckpoint(every_n_train_steps=N) or every_n_epochs")
    if not ctx.async_checkpoint:
        steps.append(
            "write in a background thread: Trainer(plugins=[AsyncCheckpointIO()]) "
            "(lightning.pytorch.plugins.io.AsyncCheckpointIO)"
        )
    steps.append(
        "keep only what a resume needs (save_top_k, save_weights_only=True when the optimizer state is not needed)"
    )
    return Finding(
        "checkpoint_heavy", "checkpoint", evidence + ".", "; ".join(steps) + ".", share, kind="fit", saving=share
    )
