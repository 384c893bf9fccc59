"""Budget and pay-back: what a search, a trial and a window cost, whether a fix repays them, and the cost models of
the fixes with one-off work (a first compile, the loader workers' search).

Numbers from a 2-core CPU, measured by benchmarks/bench_autopilot.py and benchmarks/bench_autopilot_real.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lightning_accel.core.autopilot.pairing import DECISIVE_GAIN
from lightning_accel.core.autopilot.protocol import MeasurementLike, Offer

__all__ = [
    "BUNDLE_WINDOWS",
    "ESTIMATE_WINDOW",
    "FEED_MARGIN",
    "MAX_COMPILE_GAIN",
    "MIN_WINDOW_SECONDS",
    "SEARCH_BATCHES",
    "SELF_PAYING_MULTIPLE",
    "SHORT_ESTIMATE_FIT",
    "SHORT_ESTIMATE_WINDOW",
    "SHORT_WARMUP_STEPS",
    "TYPICAL_COMPILE_SECONDS",
    "WORKER_SPEEDUP_BOUND",
    "WORKER_START_SECONDS",
    "Opening",
    "WindowLength",
    "compile_cannot_pay_back",
    "compile_pays_back",
    "compile_verdict",
    "decisive_ratio",
    "estimate_window",
    "expects_confirmation",
    "feasible_worker_counts",
    "main_process_load_seconds",
    "opening",
    "pays_back",
    "pays_for_itself",
    "step_consumption",
    "trial_cost",
    "window_cost",
    "window_steps",
    "worker_search_seconds",
]

#: A measuring window's timed steps last at least this long (windows lengthen up to 4x their steps, by the last
#: window's step time): on a shared 2-core CPU, windows of 30-70 ms (a tiny model's 10-25 steps) disagree by 10-15 %
#: between adjacent pairs; a quarter second averages the scheduler's hiccups out.
MIN_WINDOW_SECONDS = 0.25
#: (warm-up, timed) steps of the pay-back estimate, the search's first window: the first steps (loader start,
#: allocator) warm up untimed. Its two timed steps mark it for :class:`WindowLength`, which takes it as asked and
#: sets no window length from it (with more timed steps it would be taken for the baseline's first window, and
#: every later window capped at the estimate's few steps).
ESTIMATE_WINDOW = (2, 2)
#: (warm-up, timed) steps of the estimate on a fit of fewer than :data:`SHORT_ESTIMATE_FIT` steps: the estimate's
#: steps are extra work a fit that is not searched pays for, 4 % of a 100-step fit with four and 2 % with two
#: (``bench_autopilot_real.py --short --short-scenarios short_decode --short-steps 100``); one warm-up step estimated
#: that fit's step at the same 17-18 ms as two
SHORT_ESTIMATE_WINDOW = (1, 1)
#: fits shorter than this many optimizer steps are estimated with :data:`SHORT_ESTIMATE_WINDOW` (there the
#: estimate's four steps would cost over 1 % of the fit)
SHORT_ESTIMATE_FIT = 400
#: Untimed warm-up steps of a short fit's windows (a new loader's workers start in the first; 5 by default)
SHORT_WARMUP_STEPS = 2
#: windows a bundle's confirmation costs (A, B, B, A and some slack), reserved in the budget once two gains are held
BUNDLE_WINDOWS = 4.4


# ------------------------------------------------------------------------------------------------ windows
def estimate_window(steps_left: int) -> tuple[int, int]:
    """(warm-up, timed) optimizer steps of the pay-back estimate of a fit of ``steps_left`` steps:
    :data:`ESTIMATE_WINDOW`, or :data:`SHORT_ESTIMATE_WINDOW` under :data:`SHORT_ESTIMATE_FIT` steps."""
    return SHORT_ESTIMATE_WINDOW if steps_left < SHORT_ESTIMATE_FIT else ESTIMATE_WINDOW


def window_steps(warmup_steps: int, steps: int, accumulate: int) -> tuple[int, int]:
    """The optimizer steps a window of ``warmup_steps`` + ``steps`` runs with ``accumulate`` micro-batches per step:
    ``ceil(warmup / k)`` warm-up and ``ceil(steps / sqrt(k))`` timed steps (at least 1 and 2). Worker start-up and the
    allocator warm up per micro-batch, and k micro-batches per timed step already average k calls (on the GPT-2 script
    of benchmarks/bench_autopilot_real.py, micro-batch 4 x 8, the full protocol would take 5 s a window: two trials in a
    5 % budget of a 10-minute fit)."""
    k = max(1, int(accumulate))
    if k == 1:
        return warmup_steps, steps
    return max(1, math.ceil(warmup_steps / k)), max(2, math.ceil(steps / math.sqrt(k)))


class WindowLength:
    """The window length policy: :func:`window_steps`, then every window after the baseline's first at least
    :data:`MIN_WINDOW_SECONDS` (up to 4x its steps) and at most as long in seconds as that one, the step count from the
    last window's step time (aggregated over ranks, so every rank runs the same number of steps). A window of
    :data:`ESTIMATE_WINDOW`'s timed steps or fewer (the pay-back estimate) is taken as asked and sets nothing."""

    def __init__(self) -> None:
        self.step_seconds: float | None = None  # of the last window
        self.target_seconds: float | None = None  # the timed length of the baseline's first window

    def steps(self, warmup_steps: int, steps: int, accumulate: int) -> tuple[int, int]:
        """(warm-up, timed) optimizer steps of the next window."""
        short = steps <= ESTIMATE_WINDOW[1]
        warm, timed = window_steps(warmup_steps, steps, accumulate)
        if not short and self.step_seconds:
            timed = min(4 * timed, max(timed, math.ceil(MIN_WINDOW_SECONDS / self.step_seconds)))
            if self.target_seconds:
                # no longer than the baseline's windows: a window averages the machine's noise by its length in
                # seconds, not in steps; after the 4 x 8 -> 32 x 1 jump of bench_autopilot_real.py's GPT-2 the same
                # step count takes 3.2 s instead of 1.4 s, and the next trial (SDPA) would not fit the budget
                timed = min(timed, max(2, math.ceil(self.target_seconds / self.step_seconds)))
        return warm, timed

    def observe(self, window: MeasurementLike, steps_asked: int) -> None:
        """The window just measured, asked for ``steps_asked`` timed steps."""
        self.step_seconds = window.step_seconds
        if steps_asked > ESTIMATE_WINDOW[1] and self.target_seconds is None:
            self.target_seconds = window.seconds


def window_cost(warmup_steps: int, steps: int, step: float, accumulate: int = 1) -> float:
    """Seconds a window of ``warmup_steps`` + ``steps`` optimizer steps of ``step`` seconds takes as
    :class:`WindowLength` runs it (shorter under accumulation, none below :data:`MIN_WINDOW_SECONDS`)."""
    warm, timed = window_steps(warmup_steps, steps, accumulate)
    return warm * step + max(timed * step, min(MIN_WINDOW_SECONDS, 4 * timed * step))


# ------------------------------------------------------------------------------------------------ trials
def decisive_ratio(gate: float) -> float:
    """A first paired ratio at least this high is kept without a confirmation pair (:data:`DECISIVE_GAIN`)."""
    return 1.0 + max(DECISIVE_GAIN, 4 * gate)


def expects_confirmation(gain: float, gate: float) -> bool:
    """Whether a fix expected to remove ``gain`` of the step is likely to need its confirmation pair: it should
    clear the gate, but not decisively (a fix removing 69 % of the step is a 3x ratio: no pair)."""
    return gain >= gate and 1.0 / max(1e-9, 1.0 - gain) < decisive_ratio(gate)


def trial_cost(
    *, window: float, step: float, probe: float, fresh: bool, confirm: bool, warmup_steps: int, setup: float
) -> float:
    """Seconds a trial is expected to take: a ``window`` of the current configuration unless a ``fresh`` one is at
    hand, the candidate's window (and its extra warm-up), the ``confirm``-ation pair when it is likely (windows of the
    configuration now current: after the 4 x 8 -> 32 x 1 jump on the GPT-2 script of bench_autopilot_real.py a window
    takes 3.5 s instead of 2.3 s, so a trial costed at the old length would overrun a 29 s budget by 5 s), its
    one-off ``setup`` work and two numerics probes."""
    windows = (0 if fresh else 1) + 1.2 + (2 if confirm else 0)
    return windows * window + warmup_steps * step + setup + 2 * probe


def pays_back(gain: float | None, cost: float, step: float, steps_left: int | None) -> tuple[bool, str]:
    """Whether a fix expected to remove ``gain`` of a ``step``-second step repays a trial costing ``cost`` seconds
    over the ``steps_left``; the reason when not (a fix without a prior, or a fit of unknown length, always may)."""
    if gain is None or steps_left is None:
        return True, ""
    saving = gain * step * steps_left
    if saving > cost:
        return True, ""
    return False, (
        f"expected to save ~{saving:.1f} s ({gain:.1%} of the step over the {steps_left} steps), "
        f"less than the ~{cost:.1f} s a trial costs"
    )


#: A trial whose expected saving over the steps left is at least this many times its cost runs even when it does not
#: fit the budget: the budget caps the search, never a trial that pays for itself. On the 2000-step data-bound fit of
#: ``bench_autopilot_real.py --short`` (a 14 ms step, ~90 % of it the data wait) the workers' trial needs ~1.5 s of a
#: 1.5 s budget the baseline has half spent, and is expected to save ~13 s; without this the search tried only the
#: cheaper prefetch, kept nothing, and the fit trained at vanilla's speed. Three times leaves room for a prior that
#: promises twice what the fix delivers.
SELF_PAYING_MULTIPLE = 3.0


def pays_for_itself(gain: float | None, cost: float, step: float, steps_left: int | None) -> tuple[bool, float]:
    """Whether a fix expected to remove ``gain`` of a ``step``-second step saves at least :data:`SELF_PAYING_MULTIPLE`
    times a trial costing ``cost`` seconds over the ``steps_left``, and its expected saving in seconds (a fix without
    a prior, or a fit of unknown length, has no expected saving: it stays within the budget)."""
    if gain is None or steps_left is None or cost <= 0:
        return False, 0.0
    saving = gain * step * steps_left
    return saving >= SELF_PAYING_MULTIPLE * cost, saving


@dataclass
class Opening:
    """What the pay-back estimate decides before the baseline: the budget, the windows, why not to search."""

    budget: float
    warmup_steps: int
    measure_steps: int
    floor: float = 0.0  # the budget raised to a baseline and one trial that pay back
    stopped: str | None = None
    notes: list[str] = field(default_factory=list)


def opening(
    estimate: MeasurementLike,
    offers: Sequence[Offer],
    *,
    steps_left: int,
    budget: float,
    warmup_steps: int,
    measure_steps: int,
    threshold: float,
    spent: float,
    accumulate: int = 1,
) -> Opening:
    """Does a search pay? The largest expected gain on ``offers`` (the share of its prior counted on) times the fit's
    duration, less the fix's one-off work, must exceed twice the cost of a baseline and one trial; a short fit is
    costed again with the shortest windows that still average the noise out; the budget is raised to a baseline and
    one trial when the best fix repays them (``spent``: seconds spent on the estimate)."""
    step = estimate.step_seconds
    fit = step * steps_left
    plan = Opening(budget * fit, warmup_steps, measure_steps)
    available = [o for o in offers if o.why_not is None]
    # a fix without a prior (one of the user's own) cannot be estimated: it is searched for
    gains = [o.counted_gain for o in available]
    best, saving = None, math.inf
    if None not in gains:
        # each fix's saving over the fit less its one-off work: a first compile (~60 s on a 2-core CPU) is no reason
        # to search a 30 s fit, though its prior (a fifth of forward + backward) is the largest
        nets = [((o.counted_gain or 0.0) * fit - o.candidate.setup_seconds(), o.counted_gain) for o in available]
        saving, best = max(nets, default=(0.0, 0.0))
    # baseline A A, then the first trial: its B (+ 0.2 for its warm-up) and its confirmation pair unless the best fix
    # is expected to be decisive
    windows = 3.2 + 2 * (best is None or expects_confirmation(best, threshold))
    start_cost = windows * window_cost(warmup_steps, measure_steps, step, accumulate)
    if saving <= 2 * start_cost and best is not None:
        # a short fit: the shortest windows that still average the machine's noise out (MIN_WINDOW_SECONDS); the A/A
        # noise is measured on them, so the gate follows their noise
        warm = min(warmup_steps, SHORT_WARMUP_STEPS)
        steps = max(3, min(measure_steps, math.ceil(MIN_WINDOW_SECONDS / max(step, 1e-9))))
        short_cost = windows * window_cost(warm, steps, step, accumulate)
        if short_cost < start_cost:
            if saving > 2 * short_cost:
                plan.notes.append(
                    f"a short fit (~{fit:.0f} s): windows of {warm} + {steps} steps instead of "
                    f"{warmup_steps} + {measure_steps}, whose baseline and first trial "
                    f"(~{start_cost:.1f} s) the best fix on offer (~{saving:.1f} s) would not repay twice"
                )
            plan.warmup_steps, plan.measure_steps, start_cost = warm, steps, short_cost
    if saving <= 2 * start_cost:
        why = (
            "no fix is on offer"
            if not available
            else f"the best fix on offer is expected to save ~{max(0.0, saving):.1f} s ({best:.1%} of a "
            f"{step * 1000:.1f} ms step over {steps_left} steps)"
        )
        plan.stopped = (
            f"not searched: the fit (~{fit:.0f} s) is too short to repay a search: {why}, "
            f"less than twice the ~{start_cost:.1f} s a baseline and one trial cost"
        )
        return plan
    if plan.budget < spent + start_cost:  # the estimate's steps are spent already
        plan.budget = plan.floor = spent + start_cost * 1.1
        expected = (
            f"the best fix on offer is expected to save ~{saving:.1f} s"
            if best is not None
            else "a fix of your own is on offer"
        )
        plan.notes.append(
            f"the budget is raised to {plan.budget:.1f} s (a baseline and one trial): {expected} of the ~{fit:.0f} s fit"
        )
    return plan


# ------------------------------------------------------------------------------------------------ compile
#: the method's upper end of torch.compile's gain on compute-heavy models ("typically 10-30 %")
MAX_COMPILE_GAIN = 0.30
#: seconds a first inductor compile of a small model typically takes (CPU: C++ codegen on few cores — the 2-layer HF
#: GPT-2 script of benchmarks/bench_autopilot_real.py takes 61.7 s on a 2-core CPU; CUDA: triton); used to skip a
#: trial that could not pay back even at MAX_COMPILE_GAIN and to cost a trial against the search's budget — a real
#: trial measures its own
TYPICAL_COMPILE_SECONDS = {False: 60.0, True: 20.0}


def compile_pays_back(
    compile_seconds: float, step_seconds_before: float, step_seconds_after: float, steps_left: int | None
) -> tuple[bool, str]:
    """Whether compiling pays for itself within the fit: the time it saves over the steps left exceeds the time it
    took to compile (``steps_left=None``: unknown length, judged on the per-step gain alone)."""
    saved_per_step = step_seconds_before - step_seconds_after
    if saved_per_step <= 0:
        return False, "compiled steps are not faster"
    if steps_left is None:
        return True, "fit length unknown; compiled steps are faster"
    saved = saved_per_step * steps_left
    verdict = saved > compile_seconds
    return verdict, (
        f"saves {saved:.1f} s over the {steps_left} steps left vs {compile_seconds:.1f} s to compile"
        if verdict
        else f"would save {saved:.1f} s over the {steps_left} steps left, less than the {compile_seconds:.1f} s "
        "compiling takes"
    )


def compile_verdict(
    before: MeasurementLike, after: MeasurementLike, warmup_steps: int, steps_left: int | None
) -> tuple[bool, str]:
    """:func:`compile_pays_back` from the trial's windows: the compile time is the first compiled window's warm-up
    (``warmup_steps`` of them) beyond that of compiled steps."""
    compile_seconds = max(0.0, after.warmup_seconds - warmup_steps * after.step_seconds)
    return compile_pays_back(compile_seconds, before.step_seconds, after.step_seconds, steps_left)


def compile_cannot_pay_back(step_seconds: float, steps_left: int, cuda: bool) -> str | None:
    """Why even the method's best case (:data:`MAX_COMPILE_GAIN` faster steps) cannot repay a typical first compile
    over ``steps_left`` steps of ``step_seconds``, or ``None``."""
    saved = MAX_COMPILE_GAIN * step_seconds * steps_left
    typical = TYPICAL_COMPILE_SECONDS[cuda]
    if saved >= typical:
        return None
    return (
        f"cannot pay back: the {steps_left} steps left take ~{step_seconds * steps_left:.0f} s, "
        f"so even {MAX_COMPILE_GAIN:.0%} faster steps save ~{saved:.0f} s, less than a typical "
        f"first compile (~{typical:.0f} s)"
    )


# ------------------------------------------------------------------------------------------------ loader workers
#: A loader worker is taken to load a batch at most this many times faster than the main process did when it
#: loaded alone (``num_workers=0``, its data wait): on a 2-core CPU a worker of the sleeping dataset of
#: ``bench_autopilot.py`` takes 29 ms a batch against 24 ms in the main process (it shares the cores with the step).
WORKER_SPEEDUP_BOUND = 2.0
#: prior seconds to start one loader worker (a fork of the training process and its first batch); each setting the
#: worker search measures starts a fresh loader
WORKER_START_SECONDS = 0.2
#: batches each measured setting iterates beyond its workers' queue: ``loader_batches_per_sec(loader, 2, 20, ...)``
#: (2 untimed + 21 stamps)
SEARCH_BATCHES = 23
#: the rate a setting must exceed the step's consumption by to feed it (``choose_loader_setting``'s margin)
FEED_MARGIN = 0.2


class StagedWindow(Protocol):
    """A window with its stage seconds (the Lightning backend's ``Window``)."""

    @property
    def steps(self) -> int: ...

    @property
    def step_seconds(self) -> float: ...

    @property
    def stage_seconds(self) -> Mapping[str, float]: ...


def main_process_load_seconds(window: StagedWindow, accumulate: int) -> float:
    """Seconds the training process took to load one batch, from a window of a loader without workers (its data
    wait per optimizer step spread over the step's micro-batches)."""
    return window.stage_seconds.get("data", 0.0) / (window.steps * max(1, accumulate))


def step_consumption(window: StagedWindow, accumulate: int) -> float:
    """Batches per second the step consumes: steps/s of everything but the data wait, times its micro-batches."""
    busy = max(window.step_seconds - window.stage_seconds.get("data", 0.0) / max(window.steps, 1), 1e-9)
    return accumulate / busy


def feasible_worker_counts(
    counts: list[int], window: StagedWindow | None, accumulate: int, consumption: float, current_workers: int
) -> list[int]:
    """The worker counts worth measuring: from a loader without workers, whose data wait per batch is the load time
    of one batch, a count that could not feed ``consumption`` batches/s even at :data:`WORKER_SPEEDUP_BOUND` times
    that speed is left out (at least the largest count stays). On the 300-step data-bound fit of
    ``bench_autopilot_real.py --short`` the walk measured one worker twice (prefetch 2 and 4) before two: 1.2 s of
    a 3.7 s search, for a count that loads 41 batches/s where the step takes 111."""
    if current_workers != 0 or window is None or not window.steps:
        return counts
    per_batch = main_process_load_seconds(window, accumulate)
    if per_batch <= 0:
        return counts
    return [w for w in counts if w * WORKER_SPEEDUP_BOUND / per_batch >= consumption] or counts[-1:]


def worker_search_seconds(grid: list[tuple[int, int]], per_batch: float, consumption: float, cores: int) -> float:
    """Seconds the worker search (``choose_loader_setting`` over ``grid``, (workers, prefetch) cheapest first, every
    setting with workers) is expected to take when the main process loads a batch in ``per_batch`` seconds: each
    setting starts its workers and iterates :data:`SEARCH_BATCHES` + its queue with up to ``cores`` of them loading at
    once; the first setting expected to feed ``consumption`` batches/s (its rate above it by :data:`FEED_MARGIN`, the
    DataLoaderTuner's rule for a loader with workers) is measured twice and ends the walk. On the real-model scripts of
    ``bench_autopilot_real.py`` the walk takes 4-11 s, against ~3-4 s for the trial's windows alone."""
    total = 0.0
    for workers, prefetch in grid:
        parallel = max(1, min(workers, cores))
        one = workers * WORKER_START_SECONDS + (SEARCH_BATCHES + workers * prefetch) * per_batch / parallel
        if parallel / max(per_batch, 1e-12) >= consumption * (1 + FEED_MARGIN):
            return total + 2 * one
        total += one
    return total
