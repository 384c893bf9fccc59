"""The Autopilot's search loop, behind a small backend protocol: nothing here runs a step or imports Lightning.

:class:`AutopilotSearch` decides; a :class:`SearchBackend` measures a window, applies a change (returning its
undo), probes numerics, agrees across ranks, proposes what to try for the current stage shares, and restores the
training state. :class:`lightning_accel.Autopilot` is the Lightning backend; the tests drive the loop with a
scripted backend and a fake clock, so every decision below is checked with exact numbers and no timing.

The protocol, and why (numbers from a 2-core CPU, measured by benchmarks/bench_autopilot.py and
benchmarks/bench_autopilot_real.py; ``docs/method.md``, "Closing the loop"):

1. **Does a search pay?** With a fit length and the default fractional budget, three steps (one warm-up, two timed)
   estimate the step time and its stage shares before anything else. The largest *expected* gain of the fixes on
   offer (:func:`~lightning_accel.core.autopilot.expected_gain`: the stage share times what the fix can remove)
   times the fit's duration, less the fix's one-off work (a first compile), is the saving to expect; when it does
   not exceed twice the cost of a baseline and one trial (its B window, and its confirmation pair unless the fix is
   expected to be decisive), the search does not start and says so in one line: a 300-step balanced fit trains
   untouched. Before giving up, a short fit is costed with the shortest windows that still average the machine's noise out
   (:data:`SHORT_WARMUP_STEPS` untimed + :data:`MIN_WINDOW_SECONDS` timed, at least 3 steps): the 300-step fit of
   ``bench_autopilot_real.py --short`` whose data wait is ~45 % of its 33 ms step expected to save ~4.5 s, and the
   default 5 + 20-step windows cost 2.7 s for a baseline and one decisive trial; windows of 2 + 8 steps ~1.0 s. The
   A/A noise is measured on the windows the search uses, so the gate follows their noise. The search may spend
   ``max(budget x fit, baseline + first trial)`` when that first trial pays back, the trial costed again once the
   baseline's windows and numerics probe are measured. After the baseline the fit's length, and so the budget,
   follows the baseline's step time rather than the estimate's three steps.
2. **Paired windows.** Every decision compares a window of the candidate (B) with a window of the current configuration
   measured right before it (A), never with a baseline measured minutes earlier: on a shared 2-core CPU the unchanged
   configuration can measure 1453 samples/s in the baseline and 1058-1222 a few trials later, once other work starts,
   while one candidate's two paired ratios agree within 3 % (1.162, 1.135). A window of the current configuration is
   reused by the next trial only when no other window was measured since (a candidate rejected by its numerics probe
   measured nothing).
3. **The gate.** A first ratio B/A of at least ``1 + max(threshold, noise)`` (noise: the A/A spread of the baseline's
   two windows, counted up to twice the threshold: one burst of interference in the baseline measured 24.6 % on a shared
   2-core CPU and would otherwise hide every later gain) is confirmed by a second pair in reverse order (A B B A: a
   linear drift of the machine's speed cancels); the change is kept when both ratios exceed 1 and their mean clears the
   gate. A first ratio of at least ``1 + max(0.5, 4 x gate)`` is decisive and kept without the second pair (the largest
   burst on a shared 2-core CPU: 25 %). A fix whose expected gain (the offer's) clears the gate gets its second pair for
   any first ratio above ``1 + min_gain``: one pair in ~10 % noise cannot tell a 15 % gain from none. Two pairs that
   leave the question open (mean at least half the gate above 1, not kept: one pair under 1, or the mean short of the
   gate) get a third (A B B A B, the last A shared): kept when two of the three exceed 1 and the mean clears the gate
   shrunk as the noise of a mean of three, ``gate x sqrt(2/3)``, never under the threshold. On a shared 2-core CPU the
   larger micro-batch's real 15-30 % gain can measure 1.16 then 0.98, or 1.20 then 0.92: with two pairs the unluckiest
   window decides; a majority of three does not hang on one.
4. **Compounding small gains.** A change measured at least ``min_gain`` (1 %) faster but below the gate is not thrown
   away: it is reverted and held. On the GPT-2 script of benchmarks/bench_autopilot_real.py the worker, SDPA,
   fused-optimizer and micro-batch gains are 2-9 % each, mostly within the 5 % gate alone and 1.45x together. When no
   candidate is left (or the patience runs out), the held changes are applied together as a *bundle*, checked by the
   numerics guard (the loosest member's tolerance; bit-identical batches when a member changes data loading) and
   confirmed with A B B A against the current configuration. A sum of 2-3 % gains reaches the 5 % gate where each alone
   cannot, and the bundle's two pairs are measured with the whole sum in them. A bundle that fails numerics is split:
   its members are re-applied one at a time with the guard after each, and a member that breaks the numbers is dropped
   (the culprit is named). Held changes that set the same knob (a candidate's optional ``knobs``: the fused and the
   foreach optimizer step) are alternatives, not gains to add up: the bundle keeps the one measured faster and names the
   other.
5. **Payback per trial.** A candidate is trialled only while its expected saving over the steps left exceeds the
   trial's cost; sorted by expected gain, the first one that would not pay back ends the search.
6. **Windows long enough for the noise.** A baseline whose A/A noise stays above the gate's cap (twice the
   threshold) after a third window is measured again with windows up to :data:`MAX_LENGTHENING` times longer (noise
   falls as 1/sqrt(steps)), as the budget allows; noise that longer windows do not settle raises the gate to it, and a
   gain inside it is refused as "noise too high to resolve a gain of x %".
7. **The claim.** With something kept, :data:`FINAL_PAIRS` pairs of fresh windows (B A, A B, B A) measure the kept
   set against the untouched configuration, the kept changes undone and re-applied between them; the claimed
   speed-up is their geometric mean with a 90 % interval (:func:`claimed_speedup`), not the last trial's winning
   window (chosen because it won). A kept set whose interval lies below 1 is reverted. A kept change with one-off
   work (a compile) is not toggled: the claim is then the product of the kept trials' paired ratios, labelled so.

Faults: an apply that raises leaves nothing applied (the backend's undo runs); any error in a trial is reported in
the table and the search goes on from the last good configuration; every decision that depends on a rank's own
clock or outcome goes through :meth:`SearchBackend.agree`, so all ranks take the same branch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from lightning_accel.core.autopilot import NUMERICS_KINDS, NumericsCheck, TrialRecord, relative_noise

__all__ = [
    "AutopilotSearch",
    "Bundle",
    "Measurement",
    "Offer",
    "SearchBackend",
    "SearchProgress",
    "SearchResult",
    "SearchStatus",
    "Undo",
    "claimed_speedup",
    "decide_paired",
    "needs_third_pair",
    "noise_gate",
    "paired_bar",
]


#: A first paired ratio this far above 1 (and at least 4 gates) is kept without a confirmation pair: no burst of
#: interference measured on a shared 2-core CPU (at most 25 % between two windows) makes a window 1.5x faster, and a short
#: fit cannot afford two more windows for a fix that halves its data wait.
DECISIVE_GAIN = 0.5
#: A measuring window's timed steps last at least this long (a backend lengthens shorter ones up to 4x their steps,
#: by the last window's step time): on a shared 2-core CPU, windows of 30-70 ms (a tiny model's 10-25 steps)
#: disagree by 10-15 % between adjacent pairs; a quarter second averages the scheduler's hiccups out.
MIN_WINDOW_SECONDS = 0.25
#: Untimed warm-up steps of a short fit's windows (a new loader's workers start in the first; 5 by default)
SHORT_WARMUP_STEPS = 2
#: windows a bundle's confirmation costs (A, B, B, A and some slack), reserved in the budget once two gains are held
BUNDLE_WINDOWS = 4.4
#: The gate stops at this many thresholds (:func:`noise_gate`); a baseline noisier than that lengthens its windows,
#: or the search stops: paired windows that noisy cannot resolve the gate's gain
NOISE_CAP = 2.0
#: Windows lengthen at most this many times their steps for a noisy baseline (noise falls as 1/sqrt(steps): 2x)
MAX_LENGTHENING = 4
#: Pairs of the final check (the untouched configuration against the kept set, B A A B B A): three ratios give the
#: claimed speed-up a confidence interval; two would need a t quantile of 6.3 for it
FINAL_PAIRS = 3
#: Two-sided 90 % Student t quantiles by degrees of freedom (pairs - 1), for the claim's interval
_T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
#: A baseline whose two windows differ by more than this many thresholds gets a third window, and the two closest
#: of the three count: one burst of interference on a shared CPU made a Llama baseline's A/A noise 85.7 %, the gate sat at
#: its 10 % cap, and a micro-batch jump measured 1.34x then 0.50x was refused (the fit trained at 0.49x the
#: hand-tuned configuration)
BASELINE_RETRY_NOISE = 3.0


class Undo:
    """The undo of one applied change: steps pushed as the change is made, run in reverse by calling it.

    A change pushes the undo of each part *as it makes it*, so an apply that raises halfway is undone exactly as
    far as it got. Calling it twice does nothing the second time; every step runs even if one raises (the first
    error is raised after all ran)."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], Any]] = []

    def push(self, step: Callable[[], Any]) -> None:
        self._steps.append(step)

    def __len__(self) -> int:
        return len(self._steps)

    def __call__(self) -> None:
        error: BaseException | None = None
        while self._steps:
            step = self._steps.pop()
            try:
                step()
            except BaseException as err:  # noqa: BLE001 - run every step, raise the first error afterwards
                error = error or err
        if error is not None:
            raise error


class MeasurementLike(Protocol):
    samples_per_sec: float
    step_seconds: float
    seconds: float
    warmup_seconds: float

    def shares(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Measurement:
    """A measured window as the loop sees it (the Lightning backend returns its own ``Window`` with these fields)."""

    samples_per_sec: float
    step_seconds: float
    seconds: float
    warmup_seconds: float = 0.0
    stage_shares: Mapping[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        return dict(self.stage_shares)


@dataclass
class Offer:
    """A candidate the backend proposes: ``why_not`` is why it cannot be tried (``None``: it can), ``gain`` the
    fraction of the step it is expected to remove (``None``: unknown, e.g. a fix of the user's own), ``confidence``
    the share of that gain a pay-back decision counts (:data:`~lightning_accel.core.autopilot.PRIOR_CONFIDENCE`)."""

    candidate: Any
    why_not: str | None = None
    gain: float | None = None
    confidence: float = 1.0

    @property
    def counted_gain(self) -> float | None:
        """The gain a pay-back decision counts: ``gain x confidence``."""
        return None if self.gain is None else self.gain * self.confidence


@dataclass
class Bundle:
    """Changes applied together (each measured positive but below the gate alone)."""

    members: list[Any]
    name: str = "bundle"

    @property
    def kind(self) -> str:
        return str(max((m.kind for m in self.members), key=NUMERICS_KINDS.index))

    @property
    def same_batches(self) -> bool:
        return any(m.kind == "data" for m in self.members)

    @property
    def probe_through_strategy(self) -> bool:
        return any(getattr(m, "probe_through_strategy", False) for m in self.members)

    @property
    def warmup_steps(self) -> int:
        return sum(int(getattr(m, "warmup_steps", 0)) for m in self.members)


def _without_alternatives(candidates: list[Any]) -> tuple[list[Any], list[str]]:
    """The candidates (best first) less those that set a knob an earlier one sets: two ways of doing one thing
    (the fused and the foreach optimizer step, bf16 and TF32) are alternatives, and a bundle keeps the better
    measured one. Returns the members and the reasons for those left out."""
    members: list[Any] = []
    left_out: list[str] = []
    owner: dict[str, Any] = {}
    for candidate in candidates:
        knobs = tuple(getattr(candidate, "knobs", ()) or ())
        taken = next((owner[k] for k in knobs if k in owner), None)
        if taken is not None:
            shared = next(k for k in knobs if k in owner)
            left_out.append(
                f"{candidate.name} (an alternative to {taken.name}: both set {shared!r}; {taken.name} measured faster)"
            )
            continue
        members.append(candidate)
        owner.update((k, candidate) for k in knobs)
    return members, left_out


class SearchBackend(Protocol):
    """What the loop needs from a training framework (see the module docstring)."""

    def clock(self) -> float:
        """Seconds on a monotonic clock (this rank)."""

    def measure(self, warmup_steps: int, steps: int) -> MeasurementLike:
        """One window of the current configuration, aggregated over ranks; the training state restored after."""

    def reference(self) -> None:
        """Probe the current configuration on the fixed probe batches: the numerics reference."""

    def prepare(self, candidate: Any) -> None:
        """Called before ``candidate`` is applied (e.g. a reference probe through the DDP wrapper)."""

    def apply(self, candidate: Any) -> Callable[[], None]:
        """Apply ``candidate`` (a change or a :class:`Bundle`'s member); return its undo. Raising leaves nothing
        applied."""

    def check(self, candidate: Any) -> NumericsCheck:
        """The numerics guard's verdict on the applied ``candidate`` (or :class:`Bundle`) against the reference."""

    def changed_nothing(self, candidate: Any) -> str | None:
        """Why the applied candidate turned out to change nothing, or ``None``."""

    def judge(self, candidate: Any, before: MeasurementLike, after: MeasurementLike) -> tuple[bool, str] | None:
        """An extra keep condition once measured (compile pay-back), or ``None``."""

    def agree(self, ok: bool, error: BaseException | None) -> tuple[bool, str | None]:
        """Every rank's verdict: ``(all ok, description of a failure on any rank or None)``."""

    def offers(self, shares: Mapping[str, float], tried: set[str]) -> list[Offer]:
        """Candidates to try next for these stage shares, most promising first, none named in ``tried``."""

    def describe(self, candidate: Any) -> str:
        """The change, for the table."""

    def renew(self, candidate: Any) -> bool:
        """After ``candidate`` was kept: whether a fresh one of its kind may be offered again (micro-batch ×2)."""

    def setup_seconds(self, candidate: Any) -> float:
        """Seconds of one-off work a trial of ``candidate`` pays beyond its windows (optional: a first compile;
        without this method a candidate's ``warmup_steps`` are costed at 10 steps each)."""

    def fall_back(self, candidate: Any) -> bool:
        """After ``candidate`` was not kept: whether its kind offers a next choice (optional: a backend without
        this method offers none; e.g. the compression fix falls back from a projected Top-K to bf16)."""

    def adopt(self, current: MeasurementLike, baseline: MeasurementLike | None) -> None:
        """The window of the configuration now current (and the baseline's, once)."""

    def restore(self) -> None:
        """The training state back to the snapshot taken before the search."""


@dataclass
class SearchStatus:
    """What the live line shows."""

    phase: str
    candidate: str | None = None
    trial: int | None = None
    max_trials: int | None = None
    best_speedup: float | None = None
    spent_seconds: float = 0.0
    budget_seconds: float | None = None


class SearchProgress(Protocol):
    def phase(self, status: SearchStatus) -> None: ...

    def record(self, record: TrialRecord) -> None: ...


class _Silent:
    def phase(self, status: SearchStatus) -> None:
        pass

    def record(self, record: TrialRecord) -> None:
        pass


@dataclass
class SearchResult:
    records: list[TrialRecord] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
    baseline_samples_per_sec: float | None = None
    final_samples_per_sec: float | None = None
    noise: float | None = None
    stopped: str = ""
    budget_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    #: seconds per optimizer step of the configuration the search ended with (the estimate's when not searched)
    step_seconds: float | None = None
    #: the claimed speed-up of the kept set over the untouched configuration and its 90 % interval
    #: (:func:`claimed_speedup`), and where it comes from: ``"final A/B"`` (paired windows of both, interleaved,
    #: after the search) or ``"trials"`` (the product of the kept trials' paired ratios, when a kept change cannot be
    #: toggled without one-off work); ``None`` when nothing was kept
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_source: str | None = None
    #: the final check's paired ratios (kept set ÷ untouched)
    final_ratios: list[float] = field(default_factory=list)
    #: seconds the final check took (not counted in the search's budget)
    final_seconds: float = 0.0


def claimed_speedup(ratios: Sequence[float]) -> tuple[float, float | None, float | None]:
    """The speed-up a set of paired ratios (B ÷ A, each from adjacent windows) bears out: their geometric mean and its
    two-sided 90 % interval from their spread (Student t on the log ratios, ``pairs - 1`` degrees of freedom); no
    interval from one pair."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"claimed_speedup({list(ratios)!r}): needs one or more positive ratios")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = _T90.get(len(logs) - 1, 1.645) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def noise_gate(threshold: float, noise: float) -> float:
    """The relative gain a change must clear: ``threshold``, raised by the measured A/A ``noise`` up to twice the
    threshold (one burst of interference in the baseline would otherwise hide every later gain)."""
    return max(threshold, min(noise, NOISE_CAP * threshold))


def paired_bar(pairs: int, gate: float, floor: float = 0.0) -> float:
    """The gain the mean of ``pairs`` paired ratios must clear: ``gate`` for one or two pairs; for more, the
    gate shrinks as the noise of a mean does, ``gate x sqrt(2 / pairs)``, but never below ``floor`` (the
    threshold: the smallest gain worth keeping)."""
    return gate if pairs <= 2 else max(floor, gate * math.sqrt(2.0 / pairs))


def decide_paired(ratios: Sequence[float], gate: float, floor: float = 0.0) -> tuple[bool, str]:
    """One or two pairs: keep when every paired ratio B/A exceeds 1 and their mean clears ``1 + gate``. Three or
    more (a third pair settles two that disagree): keep when most of them exceed 1 and their mean clears
    ``1 +`` :func:`paired_bar`."""
    mean = statistics.fmean(ratios)
    bar = paired_bar(len(ratios), gate, floor)
    shown = " and ".join(f"{r:.3f}x" for r in ratios)
    above = sum(r > 1.0 for r in ratios)
    ok = (above == len(ratios)) if len(ratios) <= 2 else (above > len(ratios) / 2)
    if ok and mean >= 1.0 + bar:
        return True, f"paired {shown} beat the {1 + bar:.2f}x gate"
    return False, f"paired {shown} {'inside' if mean >= 1.0 else 'below'} the {1 + bar:.2f}x gate"


def needs_third_pair(ratios: Sequence[float], gate: float) -> bool:
    """Two pairs that leave the question open: their mean is at least half the gate above 1 but they were not
    kept (one pair below 1, or the mean short of the gate). On a 2-core CPU a real 15-30 % gain of the larger
    micro-batch can measure 1.16 then 0.98, or 1.20 then 0.92 (benchmarks/bench_autopilot_real.py); one more pair
    decides by majority instead of by the unluckiest window."""
    return len(ratios) == 2 and statistics.fmean(ratios) >= 1.0 + gate / 2 and not decide_paired(ratios, gate)[0]


@dataclass
class _Held:
    candidate: Any
    ratio: float
    record: TrialRecord


class AutopilotSearch:
    """The loop (see the module docstring). ``budget_seconds`` set: an absolute budget, no pay-back estimate;
    otherwise ``budget`` × the fit's expected duration (``steps_left`` × the estimated step time), or
    ``unknown_length_seconds`` without a fit length."""

    def __init__(
        self,
        backend: SearchBackend,
        *,
        threshold: float = 0.05,
        warmup_steps: int = 5,
        measure_steps: int = 20,
        patience: int = 4,
        budget: float = 0.05,
        budget_seconds: float | None = None,
        steps_left: int | None = None,
        unknown_length_seconds: float = 60.0,
        min_gain: float = 0.01,
        progress: SearchProgress | None = None,
        final_pairs: int = FINAL_PAIRS,
    ) -> None:
        if final_pairs < 0:
            raise ValueError(f"AutopilotSearch(final_pairs={final_pairs!r}): use 0 (no final check) or more pairs")
        self.backend = backend
        self.threshold, self.warmup_steps, self.measure_steps = threshold, warmup_steps, measure_steps
        self.patience, self.budget, self.budget_seconds = patience, budget, budget_seconds
        self.steps_left, self.unknown_length_seconds, self.min_gain = steps_left, unknown_length_seconds, min_gain
        self.progress = progress or _Silent()
        self.final_pairs = final_pairs
        self.result = SearchResult()
        self._kept: list[tuple[Any, Callable[[], None]]] = []  # each kept change with its undo, in order
        self._noisy: float | None = None  # the baseline's A/A noise when longer windows left it above the gate's cap
        self._started = 0.0
        self._budget = math.inf
        self._current: MeasurementLike | None = None
        self._current_rates: list[float] = []
        self._fresh: MeasurementLike | None = None  # a window of the current configuration, nothing measured since
        self._gate = threshold
        self._window_seconds = 0.0
        self._probe_seconds = 0.0  # of the numerics reference probe
        self._floor = 0.0  # the budget raised to a baseline and one trial that pay back
        self._held: list[_Held] = []
        self._max_trials: int | None = None

    # ------------------------------------------------------------------ helpers
    def _spent(self) -> float:
        return self.backend.clock() - self._started

    def _best(self) -> float | None:
        base = self.result.baseline_samples_per_sec
        if not base or not self._current_rates:
            return None
        return statistics.median(self._current_rates) / base

    def _phase(self, phase: str, candidate: str | None = None, trial: int | None = None) -> None:
        self.progress.phase(
            SearchStatus(
                phase,
                candidate,
                trial,
                self._max_trials,
                self._best(),
                self._spent(),
                None if math.isinf(self._budget) else self._budget,
            )
        )

    def _record(self, record: TrialRecord) -> None:
        self.progress.record(record)

    def _new_record(self, name: str, change: str, reason: str = "") -> TrialRecord:
        record = TrialRecord(len(self.result.records), name, change, None, None, False, reason)
        self.result.records.append(record)
        return record

    def _measure(self, extra_warmup: int = 0) -> MeasurementLike:
        return self.backend.measure(self.warmup_steps + extra_warmup, self.measure_steps)

    def _measure_current(self) -> MeasurementLike:
        """A window of the current configuration adjacent to the candidate's (reused if nothing measured since)."""
        if self._fresh is None:
            self._fresh = self._measure()
        return self._fresh

    def _measured_any(self) -> bool:
        """Whether any candidate was measured yet (the baseline aside)."""
        return any(r.samples_per_sec is not None for r in self.result.records[1:])

    def _affords(self, seconds: float) -> bool:
        ok, _ = self.backend.agree(self._spent() + seconds <= self._budget, None)
        return ok

    def _decisive_ratio(self) -> float:
        """A first paired ratio at least this high is kept without a confirmation pair (:data:`DECISIVE_GAIN`)."""
        return 1.0 + max(DECISIVE_GAIN, 4 * self._gate)

    def _expects_confirmation(self, gain: float) -> bool:
        """Whether a fix expected to remove ``gain`` of the step is likely to need its confirmation pair: it should
        clear the gate, but not decisively (a fix removing 69 % of the step is a 3x ratio: no pair)."""
        return gain >= self._gate and 1.0 / max(1e-9, 1.0 - gain) < self._decisive_ratio()

    def _trial_cost(self, candidate: Any, gain: float | None = None) -> float:
        """Seconds a trial is expected to take: a window of the current configuration unless a fresh one is at
        hand, the candidate's window (and its extra warm-up), plus the confirmation pair when it is likely: a fix
        expected to clear the gate, but not decisively, gets one for any positive first ratio (windows of the configuration now
        current: after the 4 x 8 -> 32 x 1 jump on the GPT-2 script of benchmarks/bench_autopilot_real.py a window
        takes 3.5 s instead of 2.3 s, so a trial costed at the old length would overrun a 29 s budget by 5 s)."""
        step = self._current.step_seconds if self._current is not None else 0.0
        fresh = 0 if self._fresh is not None else 1
        confirm = 2 if gain is not None and self._expects_confirmation(gain) else 0
        warmup = int(getattr(candidate, "warmup_steps", 0)) * step
        setup = getattr(self.backend, "setup_seconds", None)  # one-off work the trial pays (a first compile)
        extra = warmup + float(setup(candidate)) if setup is not None else 10 * warmup
        return (fresh + 1.2 + confirm) * self._window_seconds + extra + 2 * self._probe_seconds

    def _window_cost(self, warmup_steps: int, steps: int, step: float) -> float:
        """Seconds a window of ``warmup_steps`` + ``steps`` optimizer steps of ``step`` seconds takes, as the backend
        runs it (it may shorten windows under accumulation, and lengthens none below :data:`MIN_WINDOW_SECONDS`)."""
        scale = getattr(self.backend, "window_steps", None)
        warm, timed = scale(warmup_steps, steps) if scale is not None else (warmup_steps, steps)
        return warm * step + max(timed * step, min(MIN_WINDOW_SECONDS, 4 * timed * step))

    def _pays_back(self, gain: float | None, cost: float) -> tuple[bool, str]:
        if gain is None or self.steps_left is None or self._current is None or self.budget_seconds is not None:
            return True, ""
        saving = gain * self._current.step_seconds * self.steps_left
        if saving > cost:
            return True, ""
        return False, (
            f"expected to save ~{saving:.1f} s ({gain:.1%} of the step over the {self.steps_left} steps), "
            f"less than the ~{cost:.1f} s a trial costs"
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> SearchResult:
        backend, result = self.backend, self.result
        self._started = backend.clock()
        try:
            if not self._start():
                return result
            self._loop()
            result.final_samples_per_sec = statistics.median(self._current_rates)
            self._claim()
        finally:
            if self._current is not None:
                result.step_seconds = self._current.step_seconds
            backend.restore()
        return result

    def _start(self) -> bool:
        """The estimate (pay-back), the baseline (A A), the numerics reference; False when the search stops."""
        backend, result = self.backend, self.result
        if self.budget_seconds is not None:
            self._budget = float(self.budget_seconds)
        elif self.steps_left is None:
            self._budget = self.unknown_length_seconds
            result.notes.append(
                f"the fit's length is unknown (no max_steps / max_epochs): searching for at most {self._budget:.0f} s"
            )
        else:
            self._phase("estimating the step time")
            estimate = backend.measure(2, 3)  # the first steps (loader start, allocator) warm up untimed
            step = estimate.step_seconds
            self._current = estimate
            fit = step * self.steps_left
            offers = [o for o in backend.offers(estimate.shares(), set()) if o.why_not is None]
            # a fix without a prior (one of the user's own) cannot be estimated: it is searched for
            gains = [o.counted_gain for o in offers]
            best, saving = None, math.inf
            if None not in gains:
                # each fix's saving over the fit (the share of its prior counted on: bf16 on a CPU is a bet), less
                # its one-off work: a first compile (~60 s on this CPU) is no reason to search a 30 s fit, though
                # its prior (a fifth of forward + backward) is the largest
                setup = getattr(backend, "setup_seconds", None)
                nets = [
                    (
                        cast(float, o.counted_gain) * fit - (float(setup(o.candidate)) if setup is not None else 0.0),
                        o.counted_gain,
                    )
                    for o in offers
                ]
                saving, best = max(nets, default=(0.0, 0.0))
            # baseline A A, then the first trial: its B (+ 0.2 for its warm-up) and its confirmation pair unless
            # the best fix is expected to be decisive
            windows = 3.2 + 2 * (best is None or self._expects_confirmation(best))
            start_cost = windows * self._window_cost(self.warmup_steps, self.measure_steps, step)
            self._budget = self.budget * fit
            if saving <= 2 * start_cost and best is not None:
                # a short fit: the shortest windows that still average the machine's noise out (MIN_WINDOW_SECONDS);
                # the A/A noise is measured on them, so the gate follows their noise
                warm = min(self.warmup_steps, SHORT_WARMUP_STEPS)
                steps = max(3, min(self.measure_steps, math.ceil(MIN_WINDOW_SECONDS / max(step, 1e-9))))
                short_cost = windows * self._window_cost(warm, steps, step)
                if short_cost < start_cost:
                    if saving > 2 * short_cost:
                        result.notes.append(
                            f"a short fit (~{fit:.0f} s): windows of {warm} + {steps} steps instead of "
                            f"{self.warmup_steps} + {self.measure_steps}, whose baseline and first trial "
                            f"(~{start_cost:.1f} s) the best fix on offer (~{saving:.1f} s) would not repay twice"
                        )
                    self.warmup_steps, self.measure_steps, start_cost = warm, steps, short_cost
            if saving <= 2 * start_cost:
                why = (
                    "no fix is on offer"
                    if not offers
                    else f"the best fix on offer is expected to save ~{max(0.0, saving):.1f} s ({best:.1%} of a "
                    f"{step * 1000:.1f} ms step over {self.steps_left} steps)"
                )
                result.stopped = (
                    f"not searched: the fit (~{fit:.0f} s) is too short to repay a search: {why}, "
                    f"less than twice the ~{start_cost:.1f} s a baseline and one trial cost"
                )
                return False
            if self._budget < self._spent() + start_cost:  # the estimate's steps are spent already
                self._budget = self._floor = self._spent() + start_cost * 1.1
                expected = (
                    f"the best fix on offer is expected to save ~{saving:.1f} s"
                    if best is not None
                    else "a fix of your own is on offer"
                )
                result.notes.append(
                    f"the budget is raised to {self._budget:.1f} s (a baseline and one trial): "
                    f"{expected} of the ~{fit:.0f} s fit"
                )
        result.budget_seconds = self._budget
        self._phase("baseline")
        first = self._measure()
        second = self._measure()
        rates = [first.samples_per_sec, second.samples_per_sec]
        fresh: MeasurementLike | None = second
        spread = relative_noise(rates)
        # the ranks agree on the budget (their clocks differ; one rank measuring alone would hang the other)
        if spread > BASELINE_RETRY_NOISE * self.threshold and self._affords(4.2 * _window_length(first)):
            # a third window, and the two closest of the three (the burst dropped); the newest stays the first
            # trial's A only when it is one of them
            third = self._measure()
            pairs = [(first, second), (first, third), (second, third)]
            first, second = min(pairs, key=lambda p: relative_noise([p[0].samples_per_sec, p[1].samples_per_sec]))
            fresh = third if second is third else None
            result.notes.append(
                f"the baseline's A/A noise was {spread:.1%}: a third window measured, the closest two kept"
            )
            rates = [first.samples_per_sec, second.samples_per_sec]
        noise = relative_noise(rates)
        if noise > NOISE_CAP * self.threshold:
            # the gate stops at twice the threshold: windows this noisy cannot resolve a gain of that size. Longer
            # windows average the noise down (as 1/sqrt(steps)): the baseline is measured again with them when the
            # budget allows; otherwise, or if it stays above the gate's cap, nothing can be kept, so nothing is tried
            factor = min(MAX_LENGTHENING, math.ceil((noise / (NOISE_CAP * self.threshold)) ** 2))
            longer = self.measure_steps * factor
            window = max(_window_length(first), _window_length(second))
            if factor > 1 and self._affords(2.2 * factor * window):
                self.measure_steps = longer
                first, second = self._measure(), self._measure()
                fresh = second
                rates = [first.samples_per_sec, second.samples_per_sec]
                result.notes.append(
                    f"the baseline's A/A noise was {noise:.1%}: windows lengthened to {longer} steps, "
                    f"A/A noise now {relative_noise(rates):.1%}"
                )
                noise = relative_noise(rates)
            if noise > NOISE_CAP * self.threshold:
                # trials still run against a gate raised to the noise: a decisive gain (a halved data wait) shows
                # through it; a gain inside the noise is refused, saying why
                self._noisy = noise
                result.notes.append(
                    f"noise too high to resolve a gain of {NOISE_CAP * self.threshold:.0%}: the baseline's A/A noise "
                    f"is {noise:.1%} at windows of {self.measure_steps} steps (a quieter machine, a longer fit or a "
                    "larger budget lets longer windows settle it)"
                )
        result.baseline_samples_per_sec = statistics.median(rates)
        result.noise = relative_noise(rates)
        # the baseline's A/A spread raises the gate, by at most the threshold again: one burst of interference in
        # the two baseline windows (24.6 % measured on a shared 2-core CPU) must not make every later gain unresolvable, and a
        # keep needs both paired ratios above 1 anyway
        self._gate = noise_gate(self.threshold, result.noise)
        if self._noisy is not None:  # longer windows did not settle it: no burst, the noise itself; gains must clear it
            self._gate = max(self._gate, self._noisy)
        if self.budget_seconds is None and self.steps_left is not None:
            # the fit's length from the baseline's windows, not from the three steps of the estimate: on the GPT-2
            # script of bench_autopilot_real.py the estimate puts a 10-minute fit at 452-736 s, and its 5 % budget
            # at 3.8-6.1 % of it
            fit = self.steps_left * statistics.median([first.step_seconds, second.step_seconds])
            self._budget = max(self.budget * fit, self._floor)
            result.budget_seconds = self._budget
        self._current, self._current_rates, self._fresh = second, rates, fresh
        self._window_seconds = max(_window_length(first), _window_length(second))
        backend.adopt(second, second)
        record = self._new_record("baseline", "as configured", f"A/A noise {result.noise:.1%}")
        record.samples_per_sec, record.vs_baseline, record.kept = result.baseline_samples_per_sec, 1.0, True
        record.seconds, record.shares = self._spent(), second.shares()
        self._record(record)
        self._phase("numerics reference")
        probe_started = backend.clock()
        backend.reference()
        # every trial probes once, and once more when kept (the next reference): costed with its windows
        self._probe_seconds = backend.clock() - probe_started
        return True

    def _loop(self) -> None:
        backend, result = self.backend, self.result
        tried: set[str] = set()
        misses = 0
        while True:
            stopped = None
            while True:
                assert self._current is not None  # the baseline measured it
                offers = backend.offers(self._current.shares(), tried)
                self._max_trials = len(self.result.records) + len([o for o in offers if o.why_not is None])
                # held gains keep the time to confirm them together: a trial may not eat the bundle's windows
                reserve = BUNDLE_WINDOWS * self._window_seconds if len(self._held) >= 2 else 0.0
                offer = None
                too_long: list[tuple[Offer, float]] = []  # paying back, but longer than the time left
                for o in offers:
                    name = o.candidate.name
                    if o.why_not is None:
                        cost = self._trial_cost(o.candidate, o.gain)
                        pays, why = self._pays_back(o.counted_gain, cost)
                        if pays and self._floor and not self._measured_any():
                            # the budget was raised for a baseline and one trial that pays back: it holds that
                            # trial as costed now, with the baseline's real windows and probe (a 300-step fit
                            # spent 2.1 s on a baseline and stopped: its bf16 trial needed 4.4 s of 4.1)
                            self._budget = max(self._budget, self._spent() + 1.1 * (cost + reserve))
                            result.budget_seconds = self._budget
                        if pays and self._affords(cost + reserve):
                            offer = o
                            break
                        if pays:  # a cheaper fix further down may still fit (a first compile does not)
                            too_long.append((o, cost))
                            continue
                        o.why_not = f"not trialled: {why}"
                    tried.add(name)
                    record = self._new_record(
                        name,
                        backend.describe(o.candidate),
                        o.why_not if o.why_not.startswith("not trialled") else f"not applicable: {o.why_not}",
                    )
                    self._record(record)
                if offer is None:
                    if not too_long:
                        stopped = "no candidate left"
                    elif reserve and self._affords(too_long[0][1]):
                        stopped = "time left kept for confirming the held small gains together"
                    else:
                        cost = too_long[0][1]
                        stopped = (
                            f"time budget spent ({self._spent():.1f} of {self._budget:.1f} s; the next trial "
                            f"needs ~{cost:.1f} s)"
                        )
                        if not self._measured_any():
                            result.notes.append(
                                f"the budget ({self._budget:.1f} s) is too small for one trial "
                                f"(~{cost:.1f} s): nothing was changed"
                            )
                    break
                tried.add(offer.candidate.name)
                left = self._budget - self._spent()
                for o, cost in too_long:  # passed over for a cheaper fix: said once, not offered again
                    tried.add(o.candidate.name)
                    self._record(
                        self._new_record(
                            o.candidate.name,
                            backend.describe(o.candidate),
                            f"not trialled: its trial needs ~{cost:.1f} s, {max(0.0, left):.1f} s of the budget are left"
                            f" (the cheaper {offer.candidate.name} is tried instead)",
                        )
                    )
                kept, measured = self._trial(offer.candidate, offer.gain)
                if kept:
                    misses = 0
                    if backend.renew(offer.candidate):
                        tried.discard(offer.candidate.name)
                else:
                    fall_back = getattr(backend, "fall_back", None)
                    if fall_back is not None and fall_back(offer.candidate):
                        tried.discard(offer.candidate.name)
                held = bool(self._held) and self._held[-1].candidate is offer.candidate
                if not kept and measured and not held:  # a held small gain is no miss: it may be kept together
                    misses += 1
                    if misses >= self.patience:
                        stopped = f"{misses} measured candidate(s) in a row without a gain"
                        break
            if len(self._held) >= 2 and self._affords(BUNDLE_WINDOWS * self._window_seconds):
                if self._bundle():
                    misses = 0
                    continue  # the bottleneck moved: diagnose again
            elif len(self._held) >= 2:
                stopped += f"; {len(self._held)} small gains held, no time left to confirm them together"
            result.stopped = stopped
            return

    # ------------------------------------------------------------------ one candidate
    def _apply(self, candidate: Any) -> tuple[Callable[[], None] | None, str | None]:
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

    def _guard(self, candidate: Any, record: TrialRecord) -> str | None:
        """Numerics, then whether it changed anything; ``None`` when it may be measured, else the reason."""
        check, error = None, None
        try:
            check = self.backend.check(candidate)
        except Exception as err:  # noqa: BLE001
            error = err
        ok, failure = self.backend.agree(check is not None and check.ok, error)
        if check is not None:
            record.numerics = check.to_dict()
        if failure is not None:
            return f"failed in the numerics probe: {failure}"
        if not ok:
            return check.reason if check is not None and not check.ok else "numerics guard failed on another rank"
        members = candidate.members if isinstance(candidate, Bundle) else [candidate]
        for member in members:
            void, error = None, None
            try:
                void = self.backend.changed_nothing(member)
            except Exception as err:  # noqa: BLE001
                error = err
            ok, failure = self.backend.agree(void is None, error)
            if failure is not None:
                return f"failed checking whether it changed anything: {failure}"
            if not ok:
                return void or "changed nothing on another rank"
        return None

    def _trial(self, candidate: Any, prior: float | None = None) -> tuple[bool, bool]:
        """Trial one change: (kept, measured). ``prior``: the gain expected of it (the offer's), which earns a
        first ratio that is positive but under the gate its confirmation pair instead of a verdict on one pair."""
        backend = self.backend
        started = backend.clock()
        record = self._new_record(candidate.name, backend.describe(candidate))
        index = record.index
        undo = None
        kept = measured = False
        try:
            self._phase("measuring the current configuration", candidate.name, index)
            before = self._measure_current()
            self._phase("applying", candidate.name, index)  # some changes search first (the loader's workers)
            backend.prepare(candidate)
            undo, failure = self._apply(candidate)
            record.change = backend.describe(candidate)
            if undo is None:
                record.reason = f"could not apply: {failure}"
                return False, False
            self._phase("numerics probe", candidate.name, index)
            why = self._guard(candidate, record)
            if why is not None:
                record.reason = why
                return False, False
            self._phase("measuring", candidate.name, index)
            warm = int(getattr(candidate, "warmup_steps", 0))
            after = self._measure(warm)
            self._fresh = None
            measured = True
            ratios = [after.samples_per_sec / max(before.samples_per_sec, 1e-12)]
            rates = [after.samples_per_sec]
            record.shares = after.shares()
            decisive = ratios[0] >= self._decisive_ratio()
            # a positive first ratio under the gate is confirmed too when the fix is expected to clear the gate:
            # one window pair in ~10 % noise cannot tell a 15 % gain from none
            promising = prior is not None and prior >= self._gate and ratios[0] >= 1.0 + self.min_gain
            if (ratios[0] >= 1.0 + self._gate or promising) and not decisive:
                # A B B A: the second pair in reverse order cancels a drift of the machine's speed
                self._phase("confirmation (A B B A)", candidate.name, index)
                second = self._measure()
                undo()
                undo = None
                again = self._measure()
                self._fresh = again  # the configuration stays current unless this one is kept
                ratios.append(second.samples_per_sec / max(again.samples_per_sec, 1e-12))
                rates.append(second.samples_per_sec)
                after_window = second
            else:
                after_window = after
            keep, reason = decide_paired(ratios, self._gate)
            if needs_third_pair(ratios, self._gate) and self._affords(1.2 * self._window_seconds):
                # A B B A B: the last A window is shared; the candidate goes back on for one more B window
                self._phase("a third pair (A B B A B)", candidate.name, index)
                undo, failure = self._apply(candidate)
                if undo is not None:
                    third = self._measure(warm)
                    self._fresh = None
                    ratios.append(third.samples_per_sec / max(again.samples_per_sec, 1e-12))
                    rates.append(third.samples_per_sec)
                    after_window = third
                    keep, reason = decide_paired(ratios, self._gate, self.threshold)
                else:
                    reason = f"{reason}; re-applying it for a third pair failed: {failure}"
            if decisive:
                reason = f"{reason} (decisive: no confirmation pair needed)"
            verdict = backend.judge(candidate, before, after)
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
            record.samples_per_sec = statistics.median(rates)
            base = self.result.baseline_samples_per_sec
            record.vs_baseline = record.samples_per_sec / base if base else None
            record.ratio = mean
            if keep:
                kept = True
                self._current, self._current_rates = after_window, rates
                # the last window measured: B (one pair, or the third pair's), or the confirmation's A
                self._fresh = after_window if after_window is after or len(ratios) == 3 else None
                self.result.kept.append(candidate)
                if undo is not None:
                    self._kept.append((candidate, undo))
                self._window_seconds = _window_length(after_window)  # the next trials' windows are of this one
                backend.adopt(after_window, None)
                backend.reference()
            elif self._noisy is not None and mean >= 1.0 + self.min_gain:
                reason = (
                    f"{reason}: noise too high to resolve a gain of {mean - 1.0:.0%} (the baseline's A/A noise is "
                    f"{self._noisy:.1%})"
                )
            elif (
                mean >= 1.0 + self.min_gain
                and (verdict is None or verdict[0])
                and not getattr(candidate, "probe_through_strategy", False)
            ):
                self._held.append(_Held(candidate, mean, record))
                reason = f"{reason}: held for a bundle with other small gains"
            record.reason = reason
            return kept, measured
        except Exception as err:  # noqa: BLE001 - a trial that raises is reverted and reported
            record.reason = f"failed during the trial: {type(err).__name__}: {_short(err)}"
            return False, measured
        finally:
            record.kept = kept
            record.seconds = backend.clock() - started
            if undo is not None and not kept:
                try:
                    undo()
                except Exception as err:  # noqa: BLE001
                    self.result.notes.append(f"reverting {candidate.name} raised {err!r}")
            backend.restore()
            self._record(record)

    # ------------------------------------------------------------------ the claim
    def _claim(self) -> None:
        """The speed-up the search claims: the kept set against the untouched configuration, measured the way
        decisions are (adjacent windows, pairs in alternating order: B A, A B, B A), not the winning windows of the
        last trial. A kept set measured slower than the untouched configuration beyond the noise (the interval's
        upper end below 1) is reverted. A kept change that costs one-off work to re-apply (a compile) is not
        toggled: the claim is then the product of the kept trials' paired ratios, labelled so."""
        result = self.result
        if not result.kept:
            return
        trials = [r for r in result.records[1:] if r.kept and r.ratio is not None and r.name != "final A/B"]
        toggles = len(self._kept) == len(result.kept) and not any(
            int(getattr(c, "warmup_steps", 0)) > 0 or float(self._setup_seconds(c)) > 0 for c, _ in self._kept
        )
        if self.final_pairs == 0 or not toggles:
            trial_ratios = [float(cast(float, r.ratio)) for r in trials]
            if trial_ratios:
                result.speedup = math.prod(trial_ratios)
                result.speedup_source = "trials"
            return
        started = self.backend.clock()
        record = self._new_record("final A/B", " + ".join(self.backend.describe(c) for c, _ in self._kept))
        ratios: list[float] = []
        on = True
        try:
            self._phase("final check: kept set vs untouched", "final A/B", record.index)
            # every window its own, the first too: the trial's last window of the kept set is the one that won, and
            # reusing it would carry its luck into the claim
            pending: MeasurementLike | None = None
            for pair in range(self.final_pairs):
                if pair % 2 == 0:  # B then A
                    kept_window = pending or self._measure()
                    self._switch_kept(off=True)
                    on = False
                    untouched = self._measure()
                    pending = self._measure() if pair + 1 < self.final_pairs else None
                else:  # A then B (the A measured at the end of the last pair)
                    untouched = cast(MeasurementLike, pending)
                    self._switch_kept(off=False)
                    on = True
                    kept_window = self._measure()
                    pending = None  # the next pair measures its own B: no window counts in two pairs
                ratios.append(kept_window.samples_per_sec / max(untouched.samples_per_sec, 1e-12))
            if not on:
                self._switch_kept(off=False)
                on = True
            speedup, low, high = claimed_speedup(ratios)
            result.final_ratios = ratios
            result.speedup, result.speedup_low, result.speedup_high = speedup, low, high
            result.speedup_source = "final A/B"
            record.ratio, record.kept = speedup, True
            shown = " ".join(f"{r:.3f}" for r in ratios)
            interval = f" (90 % interval {low:.2f}-{high:.2f})" if low is not None and high is not None else ""
            record.reason = f"kept set ÷ untouched, paired {shown}: {speedup:.2f}x{interval}"
            slower, _ = self.backend.agree(high is not None and high < 1.0, None)
            if slower:
                self._switch_kept(off=True)
                on = False
                reverted = ", ".join(self.backend.describe(c) for c, _ in self._kept)
                result.kept, self._kept = [], []
                record.kept = False
                record.reason += "; slower than the untouched configuration beyond the noise: reverted"
                result.notes.append(
                    f"the kept set ({reverted}) measured {speedup:.2f}x{interval} against the untouched "
                    "configuration: reverted to it"
                )
            elif low is not None and low <= 1.0:
                record.reason += "; not resolved from 1.0 at this noise"
        except Exception as err:  # noqa: BLE001 - the claim falls back to the trials' ratios
            record.reason = f"failed during the final check: {type(err).__name__}: {_short(err)}"
            if not on:
                try:
                    self._switch_kept(off=False)
                except Exception as again:  # noqa: BLE001
                    result.notes.append(f"re-applying the kept set after the final check raised {again!r}")
                    result.kept, self._kept = [], []
            if result.speedup is None and trials:
                result.speedup = math.prod(float(cast(float, r.ratio)) for r in trials)
                result.speedup_source = "trials"
        finally:
            record.seconds = result.final_seconds = self.backend.clock() - started
            self.backend.restore()
            self._record(record)

    def _setup_seconds(self, candidate: Any) -> float:
        setup = getattr(self.backend, "setup_seconds", None)
        return float(setup(candidate)) if setup is not None else 0.0

    def _switch_kept(self, *, off: bool) -> None:
        """Take every kept change off (their undos, last first) or put them back on in order (their undos renewed)."""
        if off:
            _undo_all([undo for _, undo in self._kept])
            return
        candidates = [c for c, _ in self._kept]
        undos, failure = self._apply_all(candidates)
        if failure is not None:
            raise RuntimeError(f"re-applying the kept set failed: {failure}")
        self._kept = list(zip(candidates, undos))

    # ------------------------------------------------------------------ the bundle
    def _apply_all(self, members: list[Any]) -> tuple[list[Callable[[], None]], str | None]:
        """Apply every member (all or nothing): the undos, or the failure with nothing left applied."""
        undos: list[Callable[[], None]] = []
        for member in members:
            self.backend.prepare(member)
            undo, failure = self._apply(member)
            if undo is None:
                _undo_all(undos)
                return [], f"{member.name}: {failure}"
            undos.append(undo)
        return undos, None

    def _apply_each(self, members: list[Any]) -> tuple[list[Callable[[], None]], list[Any], list[str]]:
        """Apply the members that apply (a held change may no longer fit the configuration): undos, members
        applied, and the dropped ones with their reasons."""
        undos: list[Callable[[], None]] = []
        applied: list[Any] = []
        dropped: list[str] = []
        for member in members:
            self.backend.prepare(member)
            undo, failure = self._apply(member)
            if undo is None:
                dropped.append(f"{member.name} (could not apply: {failure})")
                continue
            undos.append(undo)
            applied.append(member)
        return undos, applied, dropped

    def _bundle(self) -> bool:
        """Apply the held changes together, guard, split on a numerics failure, confirm A B B A; True if kept."""
        backend = self.backend
        held, self._held = sorted(self._held, key=lambda h: -h.ratio), []
        members, alternatives = _without_alternatives([h.candidate for h in held])
        bundle = Bundle(members)
        started = backend.clock()
        record = self._new_record("bundle", " + ".join(backend.describe(m) for m in bundle.members))
        index = record.index
        undos: list[Callable[[], None]] = []
        kept = False
        try:
            self._phase("measuring the current configuration", "bundle", index)
            before = self._measure_current()
            self._phase("numerics probe", "bundle", index)
            undos, applied, dropped = self._apply_each(bundle.members)
            dropped = [*alternatives, *dropped]
            if len(applied) < 2:
                record.reason = "bundle not formed: " + "; ".join(dropped)
                return False
            bundle = Bundle(applied)
            why = self._guard(bundle, record)
            if why is not None:  # split: add the members one at a time, the guard after each
                _undo_all(undos)
                undos = []
                survivors: list[Any] = []
                for member in bundle.members:
                    backend.prepare(member)
                    undo, failure = self._apply(member)
                    if undo is None:
                        dropped.append(f"{member.name} ({failure})")
                        continue
                    trial = Bundle([*survivors, member])
                    probe = TrialRecord(index, "bundle", "", None, None, False, "")
                    culprit = self._guard(trial, probe)
                    if culprit is None:
                        undos.append(undo)
                        survivors.append(member)
                    else:
                        undo()
                        dropped.append(f"{member.name} ({culprit})")
                bundle = Bundle(survivors)
                if len(survivors) == 0:
                    record.reason = "numerics guard failed on the bundle; split: " + "; ".join(dropped)
                    return False
            record.change = " + ".join(backend.describe(m) for m in bundle.members)
            self._phase("measuring", "bundle", index)
            warm = bundle.warmup_steps
            after = self._measure(warm)
            self._phase("confirmation (A B B A)", "bundle", index)
            second = self._measure()
            _undo_all(undos)
            undos = []
            again = self._measure()
            self._fresh = again
            ratios = [
                after.samples_per_sec / max(before.samples_per_sec, 1e-12),
                second.samples_per_sec / max(again.samples_per_sec, 1e-12),
            ]
            rates = [after.samples_per_sec, second.samples_per_sec]
            last = second
            keep, reason = decide_paired(ratios, self._gate)
            if needs_third_pair(ratios, self._gate) and self._affords(1.2 * self._window_seconds):
                self._phase("a third pair (A B B A B)", "bundle", index)
                undos, failure = self._apply_all(bundle.members)
                if failure is None:
                    last = self._measure(warm)
                    self._fresh = None
                    ratios.append(last.samples_per_sec / max(again.samples_per_sec, 1e-12))
                    rates.append(last.samples_per_sec)
                    keep, reason = decide_paired(ratios, self._gate, self.threshold)
                else:
                    reason = f"{reason}; re-applying it for a third pair failed: {failure}"
            if keep and not undos:  # back on after the last A window
                undos, failure = self._apply_all(bundle.members)
                if failure is not None:
                    keep = False
                    reason = f"{reason}; re-applying it after the confirmation failed: {failure}"
            if dropped:
                reason = f"{reason}; dropped: " + "; ".join(dropped)
            record.samples_per_sec = statistics.median(rates)
            base = self.result.baseline_samples_per_sec
            record.vs_baseline = record.samples_per_sec / base if base else None
            record.ratio, record.shares = statistics.fmean(ratios), last.shares()
            record.reason = reason
            if keep:
                kept = True
                # the last window measured is the third pair's B (the bundle, current now) or the confirmation's A
                self._current, self._current_rates = last, rates
                self._fresh = last if len(ratios) == 3 else None
                self.result.kept.extend(bundle.members)
                self._kept.extend(zip(bundle.members, undos))
                self._window_seconds = _window_length(last)
                for h in held:
                    if h.candidate in bundle.members:
                        h.record.kept = True
                        h.record.reason += f"; kept in the bundle (trial {index})"
                backend.adopt(last, None)
                backend.reference()
            return kept
        except Exception as err:  # noqa: BLE001
            record.reason = f"failed during the trial: {type(err).__name__}: {_short(err)}"
            return False
        finally:
            record.kept = kept
            record.seconds = backend.clock() - started
            if not kept:
                try:
                    _undo_all(undos)
                except Exception as err:  # noqa: BLE001
                    self.result.notes.append(f"reverting the bundle raised {err!r}")
            backend.restore()
            self._record(record)


def _window_length(window: MeasurementLike) -> float:
    """Seconds one window of this configuration takes, warm-up included."""
    return window.seconds + window.warmup_seconds


def _undo_all(undos: list[Callable[[], None]]) -> None:
    error: BaseException | None = None
    while undos:
        try:
            undos.pop()()
        except BaseException as err:  # noqa: BLE001
            error = error or err
    if error is not None:
        raise error


def _short(err: BaseException | None, chars: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if err is not None and str(err).strip() else repr(err)
    return text if len(text) <= chars else text[:chars] + "…"
