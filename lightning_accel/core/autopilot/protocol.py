"""The protocol between the search loop and a training framework: a :class:`Candidate` (a change the loop may try), a
:class:`SearchBackend` (what the loop needs to measure, apply, guard and agree), the windows it returns, the offers it
makes, and what the loop reports (:class:`SearchStatus`, :class:`SearchResult`).

:class:`~lightning_accel.Autopilot` is the Lightning backend (``callbacks/autopilot/backend.py``); the tests drive the
loop with a scripted backend and a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_accel.core.autopilot.numerics import NUMERICS_KINDS, NumericsCheck
from lightning_accel.core.autopilot.plan import AutopilotPlan, TrialRecord

__all__ = [
    "Bundle",
    "Candidate",
    "Measurement",
    "MeasurementLike",
    "Offer",
    "SearchBackend",
    "SearchProgress",
    "SearchResult",
    "SearchStatus",
    "Undo",
    "without_alternatives",
]


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
    """A measured window: global samples/s, seconds per optimizer step, its timed and warm-up seconds, the optimizer
    steps' micro-batches, and the stage shares."""

    @property
    def samples_per_sec(self) -> float: ...

    @property
    def step_seconds(self) -> float: ...

    @property
    def seconds(self) -> float: ...

    @property
    def warmup_seconds(self) -> float: ...

    @property
    def micro_batches(self) -> int: ...

    def shares(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Measurement:
    """A measured window as the loop sees it (the Lightning backend returns its own ``Window`` with these fields)."""

    samples_per_sec: float
    step_seconds: float
    seconds: float
    warmup_seconds: float = 0.0
    stage_shares: Mapping[str, float] = field(default_factory=dict)
    micro_batches: int = 1

    def shares(self) -> dict[str, float]:
        return dict(self.stage_shares)


class Candidate(Protocol):
    """A change the loop may try, as it reads it.

    Attributes:
        name: the fix's name (one trial per name unless the backend follows up with another).
        kind: how it may alter the numbers, one of :data:`~lightning_accel.core.autopilot.numerics.NUMERICS_KINDS`.
        knobs: the settings it sets; held changes setting one knob are alternatives, not gains to add up.
        warmup_steps: extra warm-up steps its first window needs (a compile).
        probe_through_strategy: its numerics probe runs through the strategy's wrapper (a communication change).
    """

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def knobs(self) -> tuple[str, ...]: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def probe_through_strategy(self) -> bool: ...

    def describe(self) -> str:
        """The change, for the table (after it was applied: with what it chose)."""

    def setup_seconds(self) -> float:
        """Seconds of one-off work a trial pays beyond its windows (a first compile, the loader workers' search)."""

    def judge(self, before: MeasurementLike, after: MeasurementLike) -> tuple[bool, str] | None:
        """An extra keep condition once measured (a compile's pay-back), or ``None``."""


@dataclass
class Offer:
    """A candidate the backend proposes: ``why_not`` is why it cannot be tried (``None``: it can), ``gain`` the
    fraction of the step it is expected to remove (``None``: unknown, e.g. a fix of the user's own), ``confidence``
    the share of that gain a pay-back decision counts (:data:`~lightning_accel.core.autopilot.PRIOR_CONFIDENCE`)."""

    candidate: Candidate
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

    members: list[Candidate]
    name: str = "bundle"

    @property
    def kind(self) -> str:
        return str(max((m.kind for m in self.members), key=NUMERICS_KINDS.index))

    @property
    def same_batches(self) -> bool:
        return any(m.kind == "data" for m in self.members)

    @property
    def probe_through_strategy(self) -> bool:
        return any(m.probe_through_strategy for m in self.members)

    @property
    def warmup_steps(self) -> int:
        return sum(int(m.warmup_steps) for m in self.members)


def without_alternatives(candidates: list[Candidate]) -> tuple[list[Candidate], list[str]]:
    """The candidates (best first) less those that set a knob an earlier one sets: two ways of doing one thing
    (the fused and the foreach optimizer step, bf16 and TF32) are alternatives, and a bundle keeps the better
    measured one. Returns the members and the reasons for those left out."""
    members: list[Candidate] = []
    left_out: list[str] = []
    owner: dict[str, Candidate] = {}
    for candidate in candidates:
        knobs = tuple(candidate.knobs or ())
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
    """What the loop needs from a training framework."""

    def clock(self) -> float:
        """Seconds on a monotonic clock (this rank)."""

    def measure(self, warmup_steps: int, steps: int) -> MeasurementLike:
        """One window of the current configuration, aggregated over ranks; the training state restored after."""

    def agree(self, ok: bool, error: BaseException | None) -> tuple[bool, str | None]:
        """Every rank's verdict: ``(all ok, description of a failure on any rank or None)``."""

    def offers(self, shares: Mapping[str, float], tried: set[str]) -> list[Offer]:
        """Candidates to try next for these stage shares, most promising first, none named in ``tried``."""

    def apply(self, candidate: Candidate) -> Callable[[], None]:
        """Apply ``candidate`` (a change or a :class:`Bundle`'s member); return its undo. Raising leaves nothing
        applied. A change probed through the strategy takes its numerics reference through it first."""

    def check(self, candidate: Candidate | Bundle) -> NumericsCheck:
        """The numerics guard's verdict on the applied ``candidate`` (or :class:`Bundle`) against the reference, and
        (``changed_nothing``) whether a member turned out to change nothing."""

    def follow_up(self, candidate: Candidate, kept: bool) -> bool:
        """After ``candidate``'s trial: whether its kind offers another one (a kept micro-batch doubles once more; a
        refused projected Top-K falls back to bf16)."""

    def adopt(self, current: MeasurementLike, baseline: MeasurementLike | None) -> None:
        """The configuration now current: its window (and the baseline's, once); probe it on the fixed probe batches
        as the numerics reference of the trials that follow."""

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


class Silent:
    """A :class:`SearchProgress` that shows nothing."""

    def phase(self, status: SearchStatus) -> None:
        pass

    def record(self, record: TrialRecord) -> None:
        pass


@dataclass
class SearchResult:
    records: list[TrialRecord] = field(default_factory=list)
    kept: list[Candidate] = field(default_factory=list)
    baseline_samples_per_sec: float | None = None
    final_samples_per_sec: float | None = None
    noise: float | None = None
    stopped: str = ""
    budget_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    #: seconds per optimizer step of the configuration the search ended with (the estimate's when not searched)
    step_seconds: float | None = None
    #: the claimed speed-up of the kept set over the untouched configuration and its 90 % interval
    #: (:func:`~lightning_accel.core.autopilot.pairing.claimed_speedup`), and where it comes from: ``"final A/B"``
    #: (paired windows of both, interleaved, after the search) or ``"trials"`` (the product of the kept trials' paired
    #: ratios, when a kept change cannot be toggled without one-off work); ``None`` when nothing was kept
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_source: str | None = None
    #: the final check's paired ratios (kept set ÷ untouched)
    final_ratios: list[float] = field(default_factory=list)
    #: seconds the final check took (not counted in the search's budget)
    final_seconds: float = 0.0

    def fill(self, plan: AutopilotPlan) -> None:
        """Copy what the plan reports of the search into ``plan`` (the kept changes and trials are the caller's)."""
        plan.baseline_samples_per_sec = self.baseline_samples_per_sec
        plan.final_samples_per_sec = self.final_samples_per_sec
        plan.speedup, plan.speedup_source = self.speedup, self.speedup_source
        plan.speedup_low, plan.speedup_high = self.speedup_low, self.speedup_high
        plan.noise = self.noise
        plan.stopped = self.stopped or None
