"""The search's state and its trial of one candidate (:meth:`Trials._trial`): applied, guarded by the numerics probe,
measured with :func:`~lightning_accel.core.autopilot.pairing.measure_pairs`. The held small gains are tried together in
:mod:`~lightning_accel.core.autopilot.bundle`, the kept set is claimed in :mod:`~lightning_accel.core.autopilot.claim`,
and the loop around them is :class:`~lightning_accel.core.autopilot.search.AutopilotSearch`."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from lightning_accel.core.autopilot.budget import decisive_ratio, pays_for_itself
from lightning_accel.core.autopilot.pairing import measure_pairs
from lightning_accel.core.autopilot.plan import Outcome, TrialRecord
from lightning_accel.core.autopilot.protocol import (
    Bundle,
    Candidate,
    MeasurementLike,
    Offer,
    SearchBackend,
    SearchProgress,
    SearchResult,
    SearchStatus,
)

__all__ = ["Held", "Trials", "rate_ratio", "short_error", "undo_all"]


@dataclass
class Held:
    candidate: Candidate
    ratio: float
    record: TrialRecord


def rate_ratio(b: MeasurementLike, a: MeasurementLike) -> float:
    return b.samples_per_sec / max(a.samples_per_sec, 1e-12)


class Trials:
    """The search's state and its trials (the loop, :class:`~lightning_accel.core.autopilot.search.AutopilotSearch`,
    sets the state up and runs them)."""

    backend: SearchBackend
    progress: SearchProgress
    result: SearchResult
    threshold: float
    min_gain: float
    warmup_steps: int
    measure_steps: int
    final_pairs: int
    budget_seconds: float | None
    steps_left: int | None
    _started: float
    _budget: float
    _gate: float
    _current: MeasurementLike | None
    _current_rates: list[float]
    _fresh: MeasurementLike | None  # a window of the current configuration, nothing measured since
    _window_seconds: float
    _kept: list[tuple[Candidate, Callable[[], None]]]  # each kept change with its undo, in order
    _held: list[Held]
    _noisy: float | None  # the baseline's A/A noise when longer windows left it above the gate's cap
    _settling: bool  # the baseline needed a third window or longer ones: the next decision gets its confirmation
    _max_trials: int | None
    _reverted: list[Candidate]  # the kept set the final A/B reverted, in the order it was kept

    # ------------------------------------------------------------------ helpers
    def _spent(self) -> float:
        return self.backend.clock() - self._started

    def _best(self) -> float | None:
        base = self.result.baseline_samples_per_sec
        if not base or not self._current_rates:
            return None
        return statistics.median(self._current_rates) / base

    def _phase(self, phase: str, candidate: str | None = None, trial: int | None = None) -> None:
        budget = None if math.isinf(self._budget) else self._budget
        self.progress.phase(
            SearchStatus(phase, candidate, trial, self._max_trials, self._best(), self._spent(), budget)
        )

    def _record(self, record: TrialRecord) -> None:
        self.progress.record(record)

    def _new_record(self, name: str, change: str, reason: str = "", outcome: Outcome = Outcome.MEASURED) -> TrialRecord:
        record = TrialRecord(len(self.result.records), name, change, None, None, False, reason, outcome=outcome)
        self.result.records.append(record)
        return record

    def _measure(self, extra_warmup: int = 0) -> MeasurementLike:
        return self.backend.measure(self.warmup_steps + extra_warmup, self.measure_steps)

    def _measure_current(self) -> MeasurementLike:
        """A window of the current configuration adjacent to the candidate's (reused if nothing measured since)."""
        if self._fresh is None:
            self._fresh = self._measure()
        return self._fresh

    def _set_fresh(self, window: MeasurementLike | None) -> None:
        self._fresh = window

    def _affords(self, seconds: float) -> bool:
        ok, _ = self.backend.agree(self._spent() + seconds <= self._budget, None)
        return ok

    def _measured_any(self) -> bool:
        """Whether any candidate was measured yet (the baseline aside)."""
        return any(r.samples_per_sec is not None for r in self.result.records[1:])

    def _stop_reason(self, too_long: list[tuple[Offer, float]], reserve: float) -> str:
        """Why the loop stops when no offer is tried."""
        if not too_long:
            return "no candidate left"
        if reserve and self._affords(too_long[0][1]):
            return "time left kept for confirming the held small gains together"
        cost = too_long[0][1]
        if not self._measured_any():
            self.result.notes.append(
                f"the budget ({self._budget:.1f} s) is too small for one trial (~{cost:.1f} s): nothing was changed"
            )
        return f"time budget spent ({self._spent():.1f} of {self._budget:.1f} s; the next trial needs ~{cost:.1f} s)"

    def _raise_for(self, offer: Offer, cost: float) -> bool:
        """Raise the budget to hold a trial that does not fit it but pays for itself several times over
        (:func:`~lightning_accel.core.autopilot.budget.pays_for_itself`); an absolute ``budget_seconds`` is the user's
        cap and is never raised. The ranks agree (their step times differ)."""
        if self._current is None or self.budget_seconds is not None:
            return False
        # the prior itself, not its confident share: the multiple is already the margin for a prior that promises
        # more than the fix delivers (halved as well, bf16 on a CPU would need six times its cost: on the BERT
        # classifier of bench_autopilot_real.py its trial, 1.37-1.46x when run, was passed over in 2 of 5 searches)
        repays, saving = pays_for_itself(offer.gain, cost, self._current.step_seconds, self.steps_left)
        repays, _ = self.backend.agree(repays, None)
        if not repays:
            return False
        self._budget = self._spent() + 1.1 * cost
        self.result.budget_seconds = self._budget
        self.result.notes.append(
            f"the budget is raised to {self._budget:.1f} s for the {offer.candidate.name} trial (~{cost:.1f} s): it "
            f"is expected to save ~{saving:.1f} s over the {self.steps_left} steps, {saving / cost:.0f}x its cost"
        )
        return True

    def _adopt(self, window: MeasurementLike, rates: list[float]) -> None:
        """``window``'s configuration is current: the next trials measure against it, in windows of its length."""
        self._current, self._current_rates = window, rates
        self._window_seconds = window.seconds + window.warmup_seconds
        self.backend.adopt(window, None)

    # ------------------------------------------------------------------ applying and guarding
    def _apply(self, candidate: Candidate) -> tuple[Callable[[], None] | None, str | None]:
        undo, error = None, None
        try:
            undo = self.backend.apply(candidate)
        except Exception as err:  # noqa: BLE001 - reported and skipped
            error = err
        ok, failure = self.backend.agree(error is None, error)
        if ok and failure is None:
            return undo, None
        if undo is not None:
            undo()
        return None, failure or "failed on another rank"

    def _apply_all(self, members: list[Candidate]) -> tuple[list[Callable[[], None]], str | None]:
        """Apply every member (all or nothing): the undos, or the failure with nothing left applied."""
        undos: list[Callable[[], None]] = []
        for member in members:
            undo, failure = self._apply(member)
            if undo is None:
                undo_all(undos)
                return [], f"{member.name}: {failure}"
            undos.append(undo)
        return undos, None

    def _guard(self, candidate: Candidate | Bundle, record: TrialRecord) -> tuple[Outcome, str] | None:
        """Numerics, then whether it changed anything; ``None`` when it may be measured, else why not."""
        check, error = None, None
        try:
            check = self.backend.check(candidate)
        except Exception as err:  # noqa: BLE001
            error = err
        ok, failure = self.backend.agree(check is not None and check.ok, error)
        if check is not None:
            record.numerics = check.to_dict()
        if failure is not None:
            return Outcome.FAILED, f"failed in the numerics probe: {failure}"
        if not ok:
            why = check.reason if check is not None and not check.ok else "numerics guard failed on another rank"
            return Outcome.REJECTED, why
        void = check.changed_nothing if check is not None else None
        ok, _ = self.backend.agree(void is None, None)
        if not ok:
            return Outcome.REJECTED, void or "changed nothing on another rank"
        return None

    # ------------------------------------------------------------------ one candidate
    def _trial(self, candidate: Candidate, prior: float | None = None) -> tuple[bool, bool]:
        """Trial one change: (kept, measured). ``prior``: the gain expected of it (the offer's), which earns a
        first ratio under the gate (but not slower by more than it) its confirmation pair instead of a verdict on one
        pair."""
        backend = self.backend
        started = backend.clock()
        record = self._new_record(candidate.name, candidate.describe())
        index = record.index
        undo: Callable[[], None] | None = None
        kept = measured = False
        try:
            self._phase("measuring the current configuration", candidate.name, index)
            before = self._measure_current()
            self._phase("applying", candidate.name, index)  # some changes search first (the loader's workers)
            undo, failure = self._apply(candidate)
            record.change = candidate.describe()
            if undo is None:
                record.outcome, record.reason = Outcome.COULD_NOT_APPLY, f"could not apply: {failure}"
                return False, False
            self._phase("numerics probe", candidate.name, index)
            refused = self._guard(candidate, record)
            if refused is not None:
                record.outcome, record.reason = refused
                return False, False
            self._phase("measuring", candidate.name, index)
            warm = int(candidate.warmup_steps)
            # right after a baseline that needed settling, one pair is never decisive: its A may be the lucky one
            decisive = math.inf if self._settling else decisive_ratio(self._gate)
            # a first ratio under the gate is confirmed too when the fix is expected to clear the gate, unless it
            # measured slower by more than the gate: one window pair in ~10 % noise cannot tell a 15 % gain from
            # none (litgpt's 4 x 8 -> 32 x 1 measured 0.99x on one pair and 1.24x, 1.38x on others)
            promising = prior is not None and prior >= self._gate

            def switch(on: bool) -> str | None:
                nonlocal undo
                if on:
                    undo, failure = self._apply(candidate)
                    return failure
                if undo is not None:
                    undo()
                    undo = None
                return None

            def b(first: bool) -> MeasurementLike:
                nonlocal measured
                window = self._measure(warm if first else 0)
                if not measured:
                    record.shares = window.shares()
                measured = True
                return window

            pairs = measure_pairs(
                before,
                b=b,
                a=self._measure,
                switch=switch,
                ratio=rate_ratio,
                gate=self._gate,
                floor=self.threshold,
                confirm=lambda r: (r >= 1.0 + self._gate or (promising and r >= 1.0 - self._gate)) and r < decisive,
                third=lambda: self._affords(1.2 * self._window_seconds),
                phase=lambda name: self._phase(name, candidate.name, index),
                fresh=self._set_fresh,
            )
            after, ratios, keep, reason = pairs.windows[0], pairs.ratios, pairs.keep, pairs.reason
            if ratios[0] >= decisive:
                reason = f"{reason} (decisive: no confirmation pair needed)"
            verdict = candidate.judge(before, after)
            if verdict is not None:
                ok, why = verdict
                keep = keep and ok
                reason = f"{reason}; {why}"
            if keep and undo is None:  # back on after the confirmation's last A window
                undo, failure = self._apply(candidate)
                if undo is None:
                    keep = False
                    reason = f"{reason}; re-applying it after the confirmation failed: {failure}"
            if keep and record.numerics:
                reason = f"{reason}; numerics ok ({record.numerics.get('reason')})"
            mean = statistics.fmean(ratios)
            self._score(record, pairs.windows, ratios)
            if keep:
                kept = True
                last = pairs.last
                # the last window measured: B (one pair, or the third pair's), or the confirmation's A
                self._fresh = last if last is after or len(ratios) == 3 else None
                self.result.kept.append(candidate)
                if undo is not None:
                    self._kept.append((candidate, undo))
                self._adopt(last, [w.samples_per_sec for w in pairs.windows])
            elif self._noisy is not None and mean >= 1.0 + self.min_gain:
                reason = (
                    f"{reason}: noise too high to resolve a gain of {mean - 1.0:.0%} (the baseline's A/A noise is "
                    f"{self._noisy:.1%})"
                )
            elif (
                mean >= 1.0 + self.min_gain and (verdict is None or verdict[0]) and not candidate.probe_through_strategy
            ):
                self._held.append(Held(candidate, mean, record))
                reason = f"{reason}: held for a bundle with other small gains"
            record.reason = reason
            return kept, measured
        except Exception as err:  # noqa: BLE001 - a trial that raises is reverted and reported
            record.outcome, record.reason = (
                Outcome.FAILED,
                f"failed during the trial: {type(err).__name__}: {short_error(err)}",
            )
            return False, measured
        finally:
            if measured:
                self._settling = False
            record.kept = kept
            record.seconds = backend.clock() - started
            if undo is not None and not kept:
                try:
                    undo()
                except Exception as err:  # noqa: BLE001
                    self.result.notes.append(f"reverting {candidate.name} raised {err!r}")
            backend.restore()
            self._record(record)

    def _score(self, record: TrialRecord, windows: list[MeasurementLike], ratios: list[float]) -> None:
        """The row's numbers: the median rate of the change's windows, against the baseline, the mean paired ratio."""
        record.samples_per_sec = statistics.median(w.samples_per_sec for w in windows)
        base = self.result.baseline_samples_per_sec
        record.vs_baseline = record.samples_per_sec / base if base else None
        record.ratio = statistics.fmean(ratios)


def undo_all(undos: list[Callable[[], None]]) -> None:
    error: BaseException | None = None
    while undos:
        try:
            undos.pop()()
        except BaseException as err:  # noqa: BLE001
            error = error or err
    if error is not None:
        raise error


def short_error(err: BaseException | None, chars: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if err is not None and str(err).strip() else repr(err)
    return text if len(text) <= chars else text[:chars] + "…"
