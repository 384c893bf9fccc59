"""The Autopilot's search loop on a scripted backend with a fake clock: exact decisions, no timing.

The backend's rate is ``100 samples/s x the product of the applied changes' gains x a scripted per-window noise
factor``; every window advances the fake clock by its steps' duration, so budgets and pay-back are exact too."""

from __future__ import annotations

import math
import re

import pytest

from lightning_accel.core.autopilot import (
    ESTIMATE_WINDOW,
    AutopilotSearch,
    Bundle,
    Measurement,
    NumericsCheck,
    Offer,
    SearchStatus,
    Undo,
    WindowLength,
    claimed_speedup,
    decide_paired,
    expected_gain,
    needs_third_pair,
    paired_bar,
    rank_by_expected_gain,
)
from lightning_accel.core.autopilot.budget import SHORT_ESTIMATE_WINDOW
from lightning_accel.core.autopilot.plan import Outcome

SAMPLES_PER_STEP = 10


class Change:
    def __init__(
        self,
        name: str,
        gain: float = 1.0,
        *,
        kind: str = "exact",
        numerics_ok: bool = True,
        expected: float | None = None,
        fails_apply: bool = False,
        repeatable: bool = False,
        setup: float = 0.0,
    ) -> None:
        self.name, self.gain, self.kind, self.numerics_ok = name, gain, kind, numerics_ok
        self.expected, self.fails_apply, self.repeatable = expected, fails_apply, repeatable
        self.warmup_steps = 0
        self.probe_through_strategy = False
        self.knobs: tuple[str, ...] = ()
        self.setup = setup

    # the candidate protocol
    def describe(self) -> str:
        return self.name

    def setup_seconds(self) -> float:
        return self.setup

    def judge(self, before, after):
        return None

    def __repr__(self) -> str:
        return self.name


class Scripted:
    def __init__(
        self,
        changes: list[Change],
        *,
        rate: float = 100.0,
        noise: list[float] | None = None,
        shares: dict[str, float] | None = None,
        bad_together: list[set[str]] | None = None,
    ) -> None:
        self.changes, self.rate, self.noise = changes, rate, list(noise or [])
        self.shares = shares or {"forward": 0.5, "backward": 0.3, "data": 0.2}
        self.bad_together = [frozenset(b) for b in bad_together or []]
        self.t = 0.0
        self.applied: list[Change] = []
        self.log: list[tuple] = []
        self.restores = 0

    # the protocol
    def clock(self) -> float:
        return self.t

    def measure(self, warmup_steps: int, steps: int) -> Measurement:
        factor = self.noise.pop(0) if self.noise else 1.0
        rate = self.rate * math.prod(c.gain for c in self.applied) * factor
        step = SAMPLES_PER_STEP / rate
        self.t += (warmup_steps + steps) * step
        self.log.append(("measure", tuple(c.name for c in self.applied)))
        return Measurement(rate, step, steps * step, warmup_steps * step, self.shares)

    def apply(self, candidate):
        if candidate.fails_apply:
            raise RuntimeError(f"{candidate.name} exploded")
        self.applied.append(candidate)
        return lambda: self.applied.remove(candidate)

    def check(self, candidate) -> NumericsCheck:
        members = candidate.members if isinstance(candidate, Bundle) else [candidate]
        names = frozenset(c.name for c in self.applied)
        ok = all(m.numerics_ok for m in members) and not any(bad <= names for bad in self.bad_together)
        self.log.append(("check", tuple(sorted(names))))
        return NumericsCheck(ok, candidate.kind, "same numbers" if ok else "numerics guard: loss differs")

    def agree(self, ok: bool, error: BaseException | None):
        return ok and error is None, (f"{type(error).__name__}: {error}" if error is not None else None)

    def offers(self, shares, tried):
        return [Offer(c, None, c.expected) for c in self.changes if c.name not in tried]

    def follow_up(self, candidate, kept: bool) -> bool:
        return False

    def adopt(self, current, baseline) -> None:
        self.log.append(("reference", tuple(c.name for c in self.applied)))

    def restore(self) -> None:
        self.restores += 1


class Events:
    def __init__(self) -> None:
        self.phases: list[SearchStatus] = []
        self.rows: list = []

    def phase(self, status: SearchStatus) -> None:
        self.phases.append(status)

    def record(self, record) -> None:
        self.rows.append((record.index, record.name, record.kept))


def _search(backend: Scripted, **kwargs) -> AutopilotSearch:
    # the final check (the kept set against the untouched configuration) has its own tests: off by default here, so
    # the scripted windows of the others stay those of the search
    defaults = {
        "threshold": 0.05,
        "warmup_steps": 5,
        "measure_steps": 20,
        "patience": 4,
        "budget_seconds": 1e6,
        "final_pairs": 0,
    }
    return AutopilotSearch(backend, **{**defaults, **kwargs})


def _measured(backend: Scripted) -> list[tuple]:
    return [entry[1] for entry in backend.log if entry[0] == "measure"]


def test_a_decisive_gain_needs_no_confirmation_pair() -> None:
    backend = Scripted([Change("workers", 2.0)])
    result = _search(backend).run()
    assert [c.name for c in result.kept] == ["workers"] and _measured(backend) == [(), (), ("workers",)]
    assert result.records[1].reason.startswith("paired 2.000x beat the 1.05x gate (decisive")


def test_a_clear_gain_is_confirmed_with_paired_windows_and_kept() -> None:
    backend = Scripted([Change("workers", 1.4)])
    events = Events()
    result = _search(backend, progress=events).run()
    assert [c.name for c in result.kept] == ["workers"]
    # A A (baseline), then B against the adjacent A (the second baseline window, nothing measured since), then the
    # confirmation pair in reverse order, B A: never a decision against a window measured before another
    # configuration's
    assert _measured(backend) == [(), (), ("workers",), ("workers",), ()]
    trial = result.records[1]
    assert trial.kept and trial.ratio == pytest.approx(1.4) and trial.vs_baseline == pytest.approx(1.4)
    assert trial.reason.startswith("paired 1.400x and 1.400x beat the 1.05x gate")
    assert result.final_samples_per_sec == pytest.approx(140.0) and result.stopped == "no candidate left"
    assert events.rows == [(0, "baseline", True), (1, "workers", True)]
    phases = [(p.phase, p.candidate) for p in events.phases]
    assert phases == [
        ("baseline", None),
        ("numerics reference", None),
        ("measuring the current configuration", "workers"),
        ("applying", "workers"),
        ("numerics probe", "workers"),
        ("measuring", "workers"),
        ("confirmation (A B B A)", "workers"),
    ]
    assert events.phases[-1].best_speedup == pytest.approx(1.0)  # before the confirmation decided it
    assert backend.applied == [backend.changes[0]]  # left applied for the training


def test_noise_raises_the_gate_and_two_pairs_that_disagree_are_settled_by_a_third() -> None:
    # baseline windows 100 and 108: their 7.7 % A/A spread is the gate; the candidate (really 1.10x) has a lucky
    # first window (123.2 against the adjacent 108: 1.14x) and an unlucky confirmation pair (99 against 100); a
    # third pair (B again against the shared last A: 110 / 100) decides by majority, on a gate shrunk by sqrt(2/3)
    backend = Scripted([Change("compile", 1.10)], noise=[1.0, 1.08, 1.12, 0.9, 1.0])
    events = Events()
    result = _search(backend, progress=events).run()
    assert result.noise == pytest.approx(0.08 / 1.04)
    row = result.records[1]
    assert row.kept and row.reason.startswith("paired 1.141x and 0.990x and 1.100x beat the 1.06x gate")
    assert row.ratio == pytest.approx((1.232 / 1.08 + 0.99 + 1.1) / 3)
    assert _measured(backend) == [(), (), ("compile",), ("compile",), (), ("compile",)]
    assert "a third pair (A B B A B)" in [p.phase for p in events.phases]
    assert backend.applied == [backend.changes[0]]


def test_a_third_pair_that_is_low_too_rejects_the_change() -> None:
    backend = Scripted([Change("compile", 1.10)], noise=[1.0, 1.08, 1.12, 0.9, 1.0, 0.9])
    result = _search(backend).run()
    row = result.records[1]
    assert not row.kept and row.reason.startswith("paired 1.141x and 0.990x and 0.990x inside the 1.06x gate")
    assert backend.applied == [] and result.kept == []


def test_no_third_pair_when_two_pairs_agree_it_is_slower_or_small() -> None:
    # 1.14 then 0.90: the mean (1.02) is under half the gate above 1, nothing to settle
    backend = Scripted([Change("compile", 1.02)], noise=[1.0, 1.08, 1.2, 0.88, 1.0])
    result = _search(backend).run()
    assert not result.records[1].kept and len(_measured(backend)) == 5


def test_a_promising_fix_under_the_gate_earns_its_confirmation_pairs() -> None:
    # expected to remove 20 % of the step, measured 4 % faster: one pair under the 5 % gate would be a verdict
    # on one window; it gets A B B A (and a third pair: the mean 1.04 is over half the gate) before it is held
    promising = Change("micro_batch", 1.04, expected=0.2)
    unknown = Change("mine", 1.04)  # no prior: one pair, then held
    backend = Scripted([promising, unknown])
    result = _search(backend).run()
    rows = {r.name: r for r in result.records}
    assert rows["micro_batch"].reason.startswith("paired 1.040x and 1.040x and 1.040x inside the 1.05x gate: held")
    assert rows["mine"].reason.startswith("paired 1.040x inside the 1.05x gate: held")
    assert _measured(backend)[:6] == [(), (), ("micro_batch",), ("micro_batch",), (), ("micro_batch",)]
    assert rows["bundle"].kept  # the two small gains together clear the gate


def test_a_promising_fix_with_one_unlucky_pair_just_under_one_is_confirmed_and_kept() -> None:
    # a 20 % gain whose first B window ran 17.5 % slow: 0.99x on one pair. Refused on it, the search would keep or
    # lose the fix by the luck of one window; the confirmation and a third pair measure it at 1.2x
    backend = Scripted([Change("micro_batch", 1.2, expected=0.2)], noise=[1.0, 1.0, 0.825])
    result = _search(backend).run()
    record = result.records[1]
    assert record.kept and record.reason.startswith("paired 0.990x and 1.200x and 1.200x beat")
    assert _measured(backend) == [(), (), ("micro_batch",), ("micro_batch",), (), ("micro_batch",)]


def test_a_promising_fix_measured_slower_than_the_gate_is_refused_on_one_pair() -> None:
    backend = Scripted([Change("micro_batch", 0.9, expected=0.2)])
    result = _search(backend).run()
    assert not result.records[1].kept and result.records[1].reason.startswith("paired 0.900x below the 1.05x gate")
    assert _measured(backend) == [(), (), ("micro_batch",)]


def test_small_gains_are_held_and_kept_together_as_a_bundle() -> None:
    changes = [Change("sdpa", 1.03), Change("fused_adamw", 1.02), Change("workers", 1.025), Change("slower", 0.97)]
    backend = Scripted(changes)
    result = _search(backend).run()
    rows = {r.name: r for r in result.records}
    for name in ("sdpa", "fused_adamw", "workers"):
        assert rows[name].kept and "held for a bundle" in rows[name].reason
        assert "kept in the bundle" in rows[name].reason
    assert not rows["slower"].kept and "held" not in rows["slower"].reason
    bundle = rows["bundle"]
    assert bundle.kept and bundle.change == "sdpa + workers + fused_adamw"  # by measured gain
    assert bundle.ratio == pytest.approx(1.03 * 1.02 * 1.025)
    assert {c.name for c in result.kept} == {"sdpa", "fused_adamw", "workers"}
    assert {c.name for c in backend.applied} == {"sdpa", "fused_adamw", "workers"}
    # the bundle's numerics were checked on all three together, then A B B A
    assert ("check", ("fused_adamw", "sdpa", "workers")) in backend.log
    both = ("sdpa", "workers", "fused_adamw")
    assert _measured(backend) == [
        (),
        (),
        ("sdpa",),
        (),
        ("fused_adamw",),
        (),
        ("workers",),
        (),
        ("slower",),
        (),
        both,
        both,
        (),
    ]
    assert result.final_samples_per_sec == pytest.approx(100 * 1.03 * 1.02 * 1.025)


def test_a_bundle_whose_two_pairs_disagree_gets_a_third() -> None:
    # windows: A A | a vs A | A, b | bundle: A, B (lucky), B (unlucky), A, then a third B against the shared A
    backend = Scripted([Change("a", 1.03), Change("b", 1.03)], noise=[1, 1, 1, 1, 1, 1, 1.08, 0.93, 1.0, 1.0])
    result = _search(backend).run()
    bundle = next(r for r in result.records if r.name == "bundle")
    together = 1.03 * 1.03
    assert bundle.kept and bundle.reason.startswith(
        f"paired {together * 1.08:.3f}x and {together * 0.93:.3f}x and {together:.3f}x beat the 1.05x gate"
    )
    assert _measured(backend)[-5:] == [(), ("a", "b"), ("a", "b"), (), ("a", "b")]
    assert {c.name for c in backend.applied} == {"a", "b"} and {c.name for c in result.kept} == {"a", "b"}


def test_held_alternatives_for_one_knob_enter_the_bundle_once_the_faster_one() -> None:
    fused, foreach, sdpa = Change("fused", 1.03), Change("foreach", 1.04), Change("sdpa", 1.03)
    fused.knobs = foreach.knobs = ("optimizer",)
    sdpa.knobs = ("attention",)
    backend = Scripted([fused, foreach, sdpa])
    result = _search(backend).run()
    rows = {r.name: r for r in result.records}
    bundle = rows["bundle"]
    assert bundle.kept and bundle.change == "foreach + sdpa"
    assert "dropped: fused (an alternative to foreach: both set 'optimizer'; foreach measured faster)" in bundle.reason
    assert [c.name for c in result.kept] == ["foreach", "sdpa"]
    assert {c.name for c in backend.applied} == {"foreach", "sdpa"}
    assert rows["foreach"].kept and not rows["fused"].kept and "kept in the bundle" not in rows["fused"].reason


def test_alternatives_alone_form_no_bundle() -> None:
    fused, foreach = Change("fused", 1.03), Change("foreach", 1.04)
    fused.knobs = foreach.knobs = ("optimizer",)
    backend = Scripted([fused, foreach])
    result = _search(backend).run()
    bundle = next(r for r in result.records if r.name == "bundle")
    assert not bundle.kept and bundle.reason.startswith("bundle not formed: fused (an alternative to foreach")
    assert result.kept == [] and backend.applied == []


def test_a_bundle_that_fails_numerics_is_split_and_the_culprit_dropped() -> None:
    changes = [Change("a", 1.03), Change("b", 1.03), Change("c", 1.03)]
    backend = Scripted(changes, bad_together=[{"a", "c"}])  # fine alone, wrong together
    result = _search(backend).run()
    bundle = next(r for r in result.records if r.name == "bundle")
    assert bundle.kept and bundle.change == "a + b" and "dropped: c (numerics guard: loss differs)" in bundle.reason
    assert "could not" not in bundle.reason
    assert [c.name for c in result.kept] == ["a", "b"] and {c.name for c in backend.applied} == {"a", "b"}


def test_a_bundle_below_the_gate_is_reverted() -> None:
    backend = Scripted([Change("a", 1.015), Change("b", 1.015)])
    result = _search(backend).run()
    bundle = next(r for r in result.records if r.name == "bundle")
    assert not bundle.kept and "inside the 1.05x gate" in bundle.reason
    assert result.kept == [] and backend.applied == [] and result.final_samples_per_sec == pytest.approx(100.0)


def test_a_failed_apply_leaves_nothing_and_the_next_trial_reuses_the_adjacent_window() -> None:
    changes = [Change("broken", 2.0, fails_apply=True), Change("wrong", 2.0, numerics_ok=False), Change("good", 1.3)]
    backend = Scripted(changes)
    result = _search(backend).run()
    rows = {r.name: r for r in result.records}
    assert rows["broken"].reason == "could not apply: RuntimeError: broken exploded"
    assert rows["wrong"].reason == "numerics guard: loss differs" and rows["wrong"].samples_per_sec is None
    assert rows["good"].kept
    # neither rejected candidate measured a window, so "good" was paired with the last baseline window
    assert _measured(backend) == [(), (), ("good",), ("good",), ()]


def test_a_held_small_gain_is_no_miss() -> None:
    # held (1.03), slower, held (1.02), slower: two misses, so patience=3 lets the search reach the large fix
    changes = [Change("a", 1.03), Change("x", 0.9), Change("b", 1.02), Change("y", 0.95), Change("big", 1.4)]
    result = _search(Scripted(changes), patience=3).run()
    assert "big" in [c.name for c in result.kept] and result.stopped == "no candidate left"


def test_patience_counts_measured_misses_only() -> None:
    changes = [Change("wrong", numerics_ok=False), Change("x", 0.9), Change("y", 0.95), Change("z", 1.3)]
    result = _search(Scripted(changes), patience=2).run()
    assert [r.name for r in result.records] == ["baseline", "wrong", "x", "y"]
    assert result.stopped == "2 measured candidate(s) in a row without a gain" and result.kept == []


def test_a_fit_too_short_to_repay_a_search_is_not_searched() -> None:
    balanced = {"forward": 0.35, "backward": 0.35, "optimizer": 0.1, "data": 0.1, "other": 0.1}
    backend = Scripted([Change("fused_adamw", 1.5, expected=0.02)], shares=balanced)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=300).run()
    # two steps estimated the 0.1 s step (four would be over 1 % of a 300-step fit); 0.02 x 30 s is far below twice a
    # baseline + one trial (4 x 2.5 s)
    assert _measured(backend) == [()] and result.records == [] and result.kept == []
    assert result.stopped.startswith(
        "not searched: the fit (~30 s) is too short to repay a search: the best fix on offer is expected to save ~0.6 s"
    )
    assert backend.t == pytest.approx(0.2)  # not searching cost the fit two steps


def test_a_dominant_stage_is_searched_even_in_a_short_fit_and_the_budget_follows_its_payback() -> None:
    data_bound = {"data": 0.77, "forward": 0.13, "backward": 0.1}
    changes = [Change("dataloader", 3.0, expected=0.69), Change("tiny", 1.3, expected=0.001)]
    result = _search(Scripted(changes, shares=data_bound), budget_seconds=None, budget=0.05, steps_left=1000).run()
    assert [c.name for c in result.kept] == ["dataloader"]
    # 5 % of a 100 s fit (5 s) cannot hold a baseline and a decisive trial (3.2 windows, 8 s) after the estimate's
    # 0.4 s: raised, because the fix pays back
    assert result.budget_seconds == pytest.approx(0.4 + 8.0 * 1.1) and any("raised" in n for n in result.notes)
    tiny = next(r for r in result.records if r.name == "tiny")
    assert tiny.reason.startswith("not trialled: expected to save ~0.0 s") and tiny.samples_per_sec is None


def test_a_trial_that_pays_for_itself_many_times_runs_beyond_the_budget() -> None:
    # a 100 s fit at 10 %: 10 s, enough for the estimate (0.4 s), a baseline (5 s) and a 3 s trial, so not raised at
    # the estimate; the workers' trial needs 1.2 windows (3 s) + its 4 s worker search, 7 s of the 4.6 s left, and is
    # expected to save 69 s: it runs (the budget grows to hold it) instead of the cheaper prefetch
    data_bound = {"data": 0.77, "forward": 0.13, "backward": 0.1}
    changes = [Change("dataloader", 3.0, expected=0.69, setup=4.0), Change("prefetch", 1.0, expected=0.2)]
    backend = Scripted(changes, shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.1, steps_left=1000).run()
    assert [c.name for c in result.kept] == ["dataloader"]
    assert ("dataloader",) in _measured(backend)
    note = next(n for n in result.notes if "for the dataloader trial" in n)
    assert "expected to save ~69.0 s over the 1000 steps, 10x its cost" in note
    assert result.budget_seconds == pytest.approx(5.4 + 1.1 * 7.0)


def test_a_trial_that_pays_back_less_than_several_times_stays_within_the_budget() -> None:
    data_bound = {"data": 0.77, "forward": 0.13, "backward": 0.1}
    changes = [Change("dataloader", 3.0, expected=0.25, setup=12.0), Change("prefetch", 1.1, expected=0.3)]
    backend = Scripted(changes, shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.2, steps_left=1000).run()
    # 25 s expected against a 15 s trial (3 s of windows, 12 s of search) with 14.5 s of the 20 s budget left: it
    # would pay back, but not three times over: the cheaper prefetch is tried instead
    rows = {r.name: r for r in result.records}
    assert (
        rows["dataloader"].samples_per_sec is None
        and "the cheaper prefetch is tried instead" in rows["dataloader"].reason
    )
    assert ("dataloader",) not in _measured(backend) and not any("for the dataloader trial" in n for n in result.notes)


def test_a_fix_whose_one_off_work_exceeds_its_saving_is_no_reason_to_search() -> None:
    balanced = {"forward": 0.45, "backward": 0.45, "optimizer": 0.1}
    changes = [Change("compile", 1.3, expected=0.19, setup=60.0), Change("precision", 1.1, expected=0.09)]
    backend = Scripted(changes, shares=balanced)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=300).run()
    # a 30 s fit: the compile's ~5.7 s less its 60 s first compile saves nothing; precision's ~2.7 s does not repay
    # twice a baseline and a confirmed trial even in short windows (5.2 x 0.5 s)
    assert result.records == [] and result.stopped.startswith(
        "not searched: the fit (~30 s) is too short to repay a search: the best fix on offer is expected to save "
        "~2.7 s (9.0% of a 100.0 ms step over 300 steps)"
    )


class Confident(Scripted):
    """Offers each change's prior with a confidence (as the backend does for bf16 on a CPU)."""

    def __init__(self, changes, confidence: float, **kwargs) -> None:
        super().__init__(changes, **kwargs)
        self.confidence = confidence

    def offers(self, shares, tried):
        return [Offer(c, None, c.expected, self.confidence) for c in self.changes if c.name not in tried]


@pytest.mark.parametrize("confidence", [1.0, 0.5])
def test_a_short_fit_counts_only_the_confident_share_of_a_prior_before_searching(confidence) -> None:
    balanced = {"forward": 0.45, "backward": 0.45, "optimizer": 0.1}
    backend = Confident([Change("precision", 0.9, expected=0.3)], confidence, shares=balanced)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=300).run()
    if confidence == 1.0:
        # a 30 s fit: 0.3 x 30 s = 9 s repays twice a baseline and a confirmed trial in short windows (5.2 x 0.5 s)
        assert [r.name for r in result.records] == ["baseline", "precision"] and result.kept == []
    else:
        # half of it (~4.5 s) does not: the balanced fit trains untouched (bf16 on a CPU is a bet, 0.905x here)
        assert result.records == [] and result.stopped.startswith(
            "not searched: the fit (~30 s) is too short to repay a search: the best fix on offer is expected to "
            "save ~4.5 s (15.0% of a 100.0 ms step over 300 steps)"
        )


def test_a_trial_raises_the_budget_on_its_prior_not_on_the_confident_share_of_it() -> None:
    # a 1000 s fit of 0.1 s steps: the loader's trial (refused after its confirmation pair) leaves too little of the
    # budget for bf16's 3 s trial. Its prior, 1.2 % of the step over 10,000 steps, saves 12 s: 4x the trial, past
    # the 3x multiple; the confident half (6 s, 2x) would pass it over although the multiple is the margin already
    balanced = {"forward": 0.45, "backward": 0.45, "optimizer": 0.1}
    changes = [Change("dataloader", 0.97, expected=0.3), Change("precision", 1.3, expected=0.012)]
    backend = Confident(changes, 0.5, shares=balanced)
    result = _search(backend, budget_seconds=None, budget=0.01, steps_left=10000).run()
    assert [c.name for c in result.kept] == ["precision"]
    assert any("for the precision trial (~3.0 s): it is expected to save ~12.0 s" in n for n in result.notes)


def test_bf16_on_a_cpu_with_it_in_hardware_is_counted_at_half_its_prior() -> None:
    from lightning_accel.core.autopilot import prior_confidence

    assert prior_confidence("precision", "cpu+bf16") == 0.5
    assert prior_confidence("precision", "cuda") == prior_confidence("dataloader", "cpu+bf16") == 1.0
    assert Offer(None, None, 0.3, 0.5).counted_gain == pytest.approx(0.15)
    assert Offer(None, None, None, 0.5).counted_gain is None


class Windows(Scripted):
    """Records each window's (warm-up, timed) steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[tuple[int, int]] = []

    def measure(self, warmup_steps: int, steps: int) -> Measurement:
        self.windows.append((warmup_steps, steps))
        return super().measure(warmup_steps, steps)


def test_a_short_fit_whose_fix_repays_short_windows_is_searched_with_them() -> None:
    data_bound = {"data": 0.6, "forward": 0.25, "backward": 0.15}
    backend = Windows([Change("dataloader", 2.0, expected=0.5)], shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=300).run()
    # a 30 s fit of 0.1 s steps: the saving (~15 s) does not repay twice the 5 + 20-step protocol (a baseline and a
    # decisive trial: 3.2 x 2.5 s), but twice windows of 2 + 3 steps (0.25 s timed; 3.2 x 0.5 s): searched with those
    assert [c.name for c in result.kept] == ["dataloader"]
    # the estimate, the baseline A A, the decisive B
    assert backend.windows == [SHORT_ESTIMATE_WINDOW, (2, 3), (2, 3), (2, 3)]
    assert any(n.startswith("a short fit (~30 s): windows of 2 + 3 steps instead of 5 + 20") for n in result.notes)


def test_the_estimate_sets_no_window_length() -> None:
    # the estimate's ~40 ms must not become the length every later window is capped at: the baseline's first window
    # is asked 5 + 20 steps and runs them (then at least MIN_WINDOW_SECONDS), and it sets the target
    length = WindowLength()
    assert length.steps(*ESTIMATE_WINDOW, 1) == ESTIMATE_WINDOW
    length.observe(Measurement(1000.0, 0.02, 0.04, 0.04, {}), ESTIMATE_WINDOW[1])
    assert length.target_seconds is None
    assert length.steps(5, 20, 1) == (5, 20)
    length.observe(Measurement(1000.0, 0.02, 0.4, 0.1, {}), 20)
    assert length.steps(5, 20, 1) == (5, 20) and length.target_seconds == pytest.approx(0.4)
    # a fast step: lengthened to MIN_WINDOW_SECONDS, at most the baseline's first window in seconds
    length.observe(Measurement(1000.0, 0.005, 0.1, 0.1, {}), 20)
    assert length.steps(5, 20, 1) == (5, 50)


def test_a_fit_too_short_even_for_short_windows_says_so_with_their_cost() -> None:
    data_bound = {"data": 0.6, "forward": 0.25, "backward": 0.15}
    backend = Windows([Change("dataloader", 2.0, expected=0.5)], shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=30).run()
    # a 3 s fit: ~1.5 s to save, twice the short windows' ~1.6 s (a baseline and a decisive B) would not be repaid
    assert backend.windows == [SHORT_ESTIMATE_WINDOW] and result.records == [] and result.kept == []
    assert result.stopped.endswith("less than twice the ~1.6 s a baseline and one trial cost")
    assert not any(n.startswith("a short fit") for n in result.notes)


def test_a_long_fit_keeps_the_full_windows() -> None:
    data_bound = {"data": 0.6, "forward": 0.25, "backward": 0.15}
    backend = Windows([Change("dataloader", 2.0, expected=0.5)], shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=3000).run()
    assert [c.name for c in result.kept] == ["dataloader"]
    assert backend.windows == [ESTIMATE_WINDOW] + [(5, 20)] * 3 and not any(
        n.startswith("a short fit") for n in result.notes
    )


def test_the_budget_stops_the_search_before_a_trial_it_cannot_afford() -> None:
    # 25 steps of 0.1 s per window: the baseline costs 5 s, a trial ~3 s
    result = _search(Scripted([Change("a", 1.5)]), budget_seconds=6.0).run()
    assert result.kept == [] and result.stopped.startswith("time budget spent (5.0 of 6.0 s")
    assert any("too small for one trial" in n for n in result.notes)


def test_the_fixes_the_budget_ended_before_are_shown_with_their_cost() -> None:
    # the baseline spends 5 of the 6 s: both trials (~3 s) pay back and neither fits; each is a row with its cost
    result = _search(Scripted([Change("a", 1.5), Change("b", 1.3)]), budget_seconds=6.0).run()
    rows = {r.name: r for r in result.records}
    assert result.kept == [] and result.stopped.startswith("time budget spent (5.0 of 6.0 s")
    for name in ("a", "b"):
        assert not rows[name].kept and rows[name].outcome == Outcome.NOT_TRIALLED
        assert re.fullmatch(
            r"not trialled: its trial needs ~\d+\.\d s, 1\.0 s of the budget are left", rows[name].reason
        )


def test_the_budget_follows_the_baselines_step_time_not_the_estimates() -> None:
    # the estimate's steps ran at half speed (0.2 s a step): 5 % of a 10000-step fit looked like 100 s; the
    # baseline's windows (0.1 s a step) put it at 50 s
    backend = Scripted([Change("a", 1.5)], noise=[0.5])
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=10_000).run()
    assert result.budget_seconds == pytest.approx(50.0)


class SlowProbe(Scripted):
    def adopt(self, current, baseline) -> None:  # the numerics reference probe of the configuration adopted
        self.t += 1.0
        super().adopt(current, baseline)


def test_a_trial_is_costed_with_its_numerics_probes() -> None:
    # baseline 5 s + the reference probe 1 s; a trial: 1.2 windows (3 s) + its probe and the next reference (2 s)
    result = _search(SlowProbe([Change("a", 1.5)]), budget_seconds=9.0).run()
    assert result.kept == [] and result.stopped == "time budget spent (6.0 of 9.0 s; the next trial needs ~5.0 s)"


def test_a_budget_raised_for_one_paying_trial_holds_that_trial_as_costed_after_the_baseline() -> None:
    data_bound = {"data": 0.77, "forward": 0.13, "backward": 0.1}
    backend = SlowProbe([Change("dataloader", 3.0, expected=0.69)], shares=data_bound)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=1000).run()
    # raised to 9.2 s at the estimate; the baseline (5 s) and its 1 s probe leave 2.8 s for a trial costed at 5 s
    # (1.2 windows + two probes): the budget grows to hold it (with the margin the raise at the estimate has), since
    # it pays back
    assert [c.name for c in result.kept] == ["dataloader"]
    assert result.budget_seconds == pytest.approx(0.4 + 5.0 + 1.0 + 1.1 * 5.0)


class LongerSteps(Scripted):
    """A kept "jump" makes each optimizer step 4x the samples (one micro-batch per step): 1.3x the rate, and a
    window of the same step count 4 / 1.3 ~ 3x longer."""

    def measure(self, warmup_steps: int, steps: int) -> Measurement:
        window = super().measure(warmup_steps, steps)
        if any(c.name == "jump" for c in self.applied):
            extra = (warmup_steps + steps) * window.step_seconds * (4 / 1.3 - 1)
            self.t += extra
            return Measurement(
                window.samples_per_sec,
                window.step_seconds * 4 / 1.3,
                window.seconds * 4 / 1.3,
                window.warmup_seconds * 4 / 1.3,
                self.shares,
            )
        return window


def test_trials_are_costed_at_the_window_length_of_the_configuration_kept() -> None:
    # baseline windows 2.5 s; the decisive jump's windows 3x that: the next trial (a clear gain expected, so a
    # confirmation pair likely) no longer fits in what is left, and the search stops inside its budget
    jump, later = Change("jump", 1.3), Change("later", 1.2, expected=0.15)
    backend = LongerSteps([jump, later])
    result = _search(backend, budget_seconds=30.0).run()
    assert [c.name for c in result.kept] == ["jump"]
    assert result.stopped.startswith("time budget spent") and backend.t <= 30.0
    rows = {r.name: r for r in result.records}  # "later" was not measured: a row with its cost says so
    assert rows["later"].samples_per_sec is None and rows["later"].reason.startswith("not trialled: its trial needs ~")


def test_a_trial_longer_than_the_time_left_is_passed_over_for_a_cheaper_one() -> None:
    # a first compile (100 warm-up steps of 0.1 s and 90 s of one-off work: ~100 s) cannot fit a 30 s budget; the
    # optimizer fix after it can, and is trialled instead of the search ending on the compile
    compile_ = Change("compile", 1.3, expected=0.2, setup=90.0)
    compile_.warmup_steps = 100
    backend = Scripted([compile_, Change("foreach", 1.2, expected=0.15)])
    result = _search(backend, budget_seconds=30.0).run()
    rows = {r.name: r for r in result.records}
    assert rows["compile"].samples_per_sec is None and rows["compile"].reason.startswith(
        "not trialled: its trial needs ~"
    )
    assert "(the cheaper foreach is tried instead)" in rows["compile"].reason
    assert [c.name for c in result.kept] == ["foreach"] and backend.t <= 30.0
    assert ("compile",) not in _measured(backend)


def test_the_search_stops_on_the_budget_when_no_trial_fits() -> None:
    compile_ = Change("compile", 1.3, expected=0.2, setup=90.0)
    compile_.warmup_steps = 100
    result = _search(Scripted([compile_]), budget_seconds=30.0).run()
    assert result.stopped.startswith("time budget spent (5.0 of 30.0 s; the next trial needs ~")
    assert [r.name for r in result.records] == ["baseline", "compile"]  # the compile as a row with its cost
    assert result.records[1].reason.startswith("not trialled: its trial needs ~")


def test_the_state_is_restored_after_every_trial_and_at_the_end() -> None:
    backend = Scripted([Change("a", 1.5), Change("b", 0.8)])
    result = _search(backend).run()
    assert len(result.records) == 3 and backend.restores == 3  # each trial + the end of the search


def test_decide_paired_needs_every_pair_above_one_and_the_mean_above_the_gate() -> None:
    assert decide_paired([1.10, 1.06], 0.05)[0]
    assert not decide_paired([1.20, 0.99], 0.05)[0]
    assert not decide_paired([1.04, 1.05], 0.05)[0]
    # three pairs: a majority above 1 and the mean over the gate x sqrt(2/3), never under the floor
    assert decide_paired([1.20, 0.99, 1.10], 0.10, 0.05)[0]
    assert not decide_paired([1.20, 0.99, 0.99], 0.10, 0.05)[0]
    assert not decide_paired([1.06, 1.06, 1.06], 0.10, 0.05)[0]  # 1.06 < 1.082
    assert decide_paired([1.06, 1.06, 1.06], 0.06, 0.05)[0]  # bar max(0.05, 0.049)
    assert paired_bar(2, 0.1) == 0.1 and paired_bar(3, 0.1, 0.05) == pytest.approx(0.1 * math.sqrt(2 / 3))
    assert needs_third_pair([1.16, 0.98], 0.10) and not needs_third_pair([1.16, 1.12], 0.10)
    assert not needs_third_pair([1.14, 0.90], 0.10) and not needs_third_pair([1.10], 0.10)


def test_undo_runs_every_step_in_reverse_once() -> None:
    done: list[int] = []
    undo = Undo()
    undo.push(lambda: done.append(1))
    undo.push(lambda: (_ for _ in ()).throw(RuntimeError("second")))
    undo.push(lambda: done.append(3))
    with pytest.raises(RuntimeError, match="second"):
        undo()
    assert done == [3, 1]
    undo()
    assert done == [3, 1]


def test_expected_gain_is_the_stage_share_times_what_the_fix_removes() -> None:
    shares = {"data": 0.5, "forward": 0.3, "backward": 0.1, "optimizer": 0.1}
    assert expected_gain("dataloader", shares) == pytest.approx(0.45)
    assert expected_gain("precision", shares, "cuda") == pytest.approx(0.16)
    assert expected_gain("precision", shares, "cpu") == pytest.approx(0.04)
    # a CPU with bf16 in hardware: its own precision prior, and the CPU's loader prior still applies
    assert expected_gain("precision", shares, "cpu+bf16") == pytest.approx(0.12)
    assert (
        expected_gain("dataloader", shares, "cpu+bf16")
        == expected_gain("dataloader", shares, "cpu")
        == pytest.approx(0.25)
    )
    assert expected_gain("my_fix", shares) is None
    assert rank_by_expected_gain(["optimizer_foreach", "my_fix", "compile", "dataloader"], shares) == [
        "dataloader",
        "compile",
        "optimizer_foreach",
        "my_fix",
    ]
    # the micro-batch first, whatever the priors: bf16 at micro-batch 4 is not bf16 at 32
    fwd = {"forward": 0.5, "backward": 0.4, "other": 0.1}
    assert expected_gain("precision", fwd, "cpu+bf16") > expected_gain("micro_batch", fwd, "cpu+bf16")
    assert rank_by_expected_gain(["precision", "fused_attention", "micro_batch"], fwd, "cpu+bf16") == [
        "micro_batch",
        "precision",
        "fused_attention",
    ]


def test_a_held_change_that_no_longer_applies_is_dropped_from_the_bundle() -> None:
    stale = Change("stale", 1.03)
    backend = Scripted([Change("a", 1.03), stale, Change("b", 1.03)])
    search = _search(backend)
    original = backend.apply

    def apply(candidate):
        if candidate is stale and any(r.name == "b" for r in search.result.records):
            raise ValueError("changes the global batch")  # fine when trialled, not once the config moved
        return original(candidate)

    backend.apply = apply
    result = search.run()
    bundle = next(r for r in result.records if r.name == "bundle")
    assert bundle.kept and bundle.change == "a + b"
    assert "dropped: stale (could not apply: ValueError: changes the global batch)" in bundle.reason
    assert [c.name for c in result.kept] == ["a", "b"]


def test_a_fix_without_a_prior_is_always_searched_for() -> None:
    balanced = {"forward": 0.35, "backward": 0.35, "optimizer": 0.1, "data": 0.1, "other": 0.1}
    backend = Scripted([Change("fused_adamw", 1.0, expected=0.02), Change("mine", 1.5)], shares=balanced)
    result = _search(backend, budget_seconds=None, budget=0.05, steps_left=300).run()
    assert [c.name for c in result.kept] == ["mine"]


def test_the_budget_keeps_the_time_to_confirm_held_gains() -> None:
    changes = [Change("a", 1.03), Change("b", 1.03), Change("c", 1.03), Change("d", 1.03)]
    # baseline 5 s, then each trial ~5 s (A + B windows of 2.5 s); the bundle needs 4.4 windows (11 s)
    result = _search(Scripted(changes), budget_seconds=26.0).run()
    bundle = next(r for r in result.records if r.name == "bundle")
    assert bundle.kept and bundle.change == "a + b"
    assert [r.name for r in result.records] == ["baseline", "a", "b", "bundle", "c", "d"]
    assert all(r.samples_per_sec is None and not r.kept for r in result.records[4:])  # shown, not measured


class FallingBack(Scripted):
    """A backend whose refused ``compression:topk`` falls back to ``compression:bf16`` (one fall-back only)."""

    def follow_up(self, candidate, kept: bool) -> bool:
        if not kept and candidate.name == "compression" and candidate.mode == "topk":
            bf16 = Change("compression", 1.5, kind="low_precision")
            bf16.mode = "bf16"
            self.changes = [bf16 if c is candidate else c for c in self.changes]
            return True
        return False


def test_a_refused_change_with_a_fall_back_is_tried_once_more_and_a_backend_without_one_is_not() -> None:
    def topk() -> Change:
        change = Change("compression", 3.0, kind="low_precision", numerics_ok=False)
        change.mode = "topk"
        return change

    backend = FallingBack([topk()])
    result = _search(backend).run()
    assert [(r.name, r.kept) for r in result.records[1:]] == [("compression", False), ("compression", True)]
    assert [c.mode for c in result.kept] == ["bf16"]
    plain = Scripted([topk()])  # a backend whose refused change has nothing to follow up with
    assert not _search(plain).run().kept and len(_search(Scripted([topk()])).run().records) == 2


def test_bf16_in_hardware_is_read_from_the_cpu_flags() -> None:
    from lightning_accel.core.precision import cpu_has_native_bf16

    assert cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_native_bf16("Features\t: fp asimd bf16 i8mm\n")  # Arm
    assert not cpu_has_native_bf16("flags\t\t: fpu sse avx2 avx512f avx512bw\n")  # emulated bf16 only
    assert not cpu_has_native_bf16("model name\t: bf16 in the name is no flag\n")
    assert not cpu_has_native_bf16("")  # no /proc/cpuinfo


def test_the_prior_of_a_cpu_follows_its_bf16_hardware(monkeypatch) -> None:
    import lightning_accel.core.precision as precision
    from lightning_accel.core.autopilot import prior_device

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert prior_device("cpu") == "cpu+bf16" and prior_device("cuda") == "cuda"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert prior_device("cpu") == "cpu"


def test_a_burst_in_the_baseline_gets_a_third_window_and_the_closest_two_count() -> None:
    # the second baseline window ran at half speed (one burst): 100 % A/A noise would cap the gate and refuse a
    # real 1.3x; a third window is measured, the closest two (1.00, 1.02) set the noise, and the first trial
    # measures its own A (the newest window is one of the two, so it is reused)
    backend = Scripted([Change("workers", 1.3)], noise=[1.0, 0.5, 1.02])
    result = _search(backend).run()
    assert _measured(backend)[:3] == [(), (), ()]
    assert result.noise == pytest.approx(0.02 / 1.01)
    assert any("a third window measured" in n for n in result.notes)
    assert [c.name for c in result.kept] == ["workers"]
    assert _measured(backend)[3] == ("workers",)  # the newest baseline window is the A of the first pair


def test_right_after_a_baseline_that_needed_settling_one_lucky_pair_is_not_decisive() -> None:
    # a burst in the baseline (third window), then the first trial's B runs twice as fast by luck: on one pair it
    # would be kept as decisive; its confirmation pair shows the change does nothing, and it is not kept
    backend = Scripted([Change("lucky", 1.0), Change("real", 2.0)], noise=[1.0, 0.5, 1.02, 2.0])
    result = _search(backend).run()
    rows = {r.name: r for r in result.records}
    assert not rows["lucky"].kept and "decisive" not in rows["lucky"].reason
    assert _measured(backend).count(("lucky",)) >= 2  # B, then the confirmation's B (and a third pair's)
    # the next decision is no longer after the settling: a 2x ratio is decisive again
    assert rows["real"].kept and "decisive" in rows["real"].reason
    calm = Scripted([Change("lucky", 1.0)], noise=[1.0, 1.0, 2.0])  # a calm baseline: one 2x pair is decisive
    assert [c.name for c in _search(calm).run().kept] == ["lucky"]


def test_a_third_baseline_window_further_off_is_dropped_and_the_trial_measures_its_own_a() -> None:
    backend = Scripted([Change("workers", 1.3)], noise=[1.0, 0.8, 0.3])
    result = _search(backend).run()
    # the first two are the closest: the third is dropped; their 22.2 % is still above the gate's 10 % cap, so the
    # baseline is measured again with windows 4x longer (the scripted noise is spent: 0 %)
    assert any("third window" in n for n in result.notes)
    assert any("A/A noise was 22.2%: windows lengthened to 80 steps" in n for n in result.notes)
    assert result.noise == pytest.approx(0.0)
    # the longer baseline's two windows, then the trial's B (its A is the newest of them)
    assert _measured(backend)[3:6] == [(), (), ("workers",)]
    calm = Scripted([Change("workers", 1.3)], noise=[1.0, 0.9])
    notes = _search(calm).run().notes
    assert not any("third window" in n for n in notes)  # 10.5 % is no burst: no third window, but above the cap
    assert any("windows lengthened to 40 steps" in n for n in notes)
    assert _measured(calm)[2:5] == [(), (), ("workers",)]


def test_the_ranks_agree_before_a_third_baseline_window() -> None:
    # the ranks' clocks differ: the third window is a collective, so it is measured only when every rank's budget
    # affords it (agree); here another rank says no, and nobody measures it
    backend = Scripted([Change("workers", 1.3)], noise=[1.0, 0.5, 1.02])
    asked: list[bool] = []

    def agree(ok, error):
        asked.append(ok)
        return (False if len(asked) == 1 else ok), None

    backend.agree = agree
    result = _search(backend).run()
    assert asked and asked[0] is True  # this rank could afford it
    assert not any("third window" in n for n in result.notes)
    # 66.7 % without a third window: the windows lengthen (every rank affords it this time)
    assert any("A/A noise was 66.7%: windows lengthened" in n for n in result.notes)
    assert result.noise == pytest.approx(0.02 / 1.01)


# ------------------------------------------------------------------ the claim: the kept set vs the untouched run
def test_the_claim_is_a_final_paired_ab_of_the_kept_set_against_the_untouched_configuration() -> None:
    # baseline A A, the change's B against the baseline's last A (decisive at 1.5x); then B A, A B, B A
    noise = [1.0, 1.0, 1.0] + [1.02, 0.98, 1.0, 1.01, 0.99, 1.0]
    backend = Scripted([Change("workers", 1.5)], noise=noise)
    result = _search(backend, final_pairs=3).run()
    assert [c.name for c in result.kept] == ["workers"] and backend.applied == result.kept
    # the windows: B, A | A, B | B, A, all the check's own; the change on again after
    assert _measured(backend)[-6:] == [("workers",), (), (), ("workers",), ("workers",), ()]
    ratios = [1.5 * 1.02 / 0.98, 1.5 * 1.01 / 1.0, 1.5 * 0.99 / 1.0]
    assert result.final_ratios == pytest.approx(ratios)
    speedup, low, high = claimed_speedup(ratios)
    assert (result.speedup, result.speedup_low, result.speedup_high) == pytest.approx((speedup, low, high))
    assert result.speedup_source == "final A/B" and low < speedup < high and low > 1.0
    final = result.records[-1]
    assert final.name == "final A/B" and final.kept and "90 % interval" in final.reason


def test_a_kept_set_slower_than_the_untouched_configuration_beyond_the_noise_is_reverted() -> None:
    # the trial was lucky (a burst in its B window); the final check measures the change 10 % slower every time
    backend = Scripted([Change("flaky", 0.9)], noise=[1.0, 1.0, 1.7] + [1.0] * 6)
    result = _search(backend, final_pairs=3).run()
    assert result.kept == [] and backend.applied == []
    assert result.speedup == pytest.approx(0.9) and result.speedup_high < 1.0
    assert "reverted" in result.records[-1].reason and not result.records[-1].kept
    assert any("reverted to it" in n for n in result.notes)


def test_a_reverted_kept_set_sends_the_search_back_to_the_gains_measured_on_top_of_it() -> None:
    # "lucky" is 30 % slower but its B window caught a burst (2.5x: decisive); "real" (1.3x) is measured on top of it;
    # the final A/B measures the set at 0.91x and reverts both; "real" is trialled again against the untouched run
    lucky, real = Change("lucky", 0.7), Change("real", 1.3)
    backend = Scripted([lucky, real], noise=[1.0, 1.0, 2.5])
    result = _search(backend, final_pairs=3).run()
    assert [c.name for c in result.kept] == ["real"] and backend.applied == [real]
    names = [r.name for r in result.records]
    assert names == ["baseline", "lucky", "real", "final A/B", "real", "final A/B"]
    assert not result.records[3].kept and "reverted" in result.records[3].reason
    assert result.records[-1].kept and result.speedup == pytest.approx(1.3)
    assert any(n.startswith("real measured on top of the reverted lucky: trialled again") for n in result.notes)
    # the retrial is measured against the untouched configuration, its first decision with a confirmation pair
    measured = _measured(backend)
    last_with_lucky = max(i for i, applied in enumerate(measured) if "lucky" in applied)
    after = measured[last_with_lucky + 1 :]
    assert set(after) == {(), ("real",)} and after.count(("real",)) >= 2 + 3  # B + its confirmation, the final A/B


def test_a_claim_inside_the_noise_is_said_to_be_unresolved_and_kept() -> None:
    # ratios 1.12, 0.96, 1.20: a gain on average, an interval that holds 1.0
    backend = Scripted([Change("small", 1.6)], noise=[1.0, 1.0, 1.0] + [0.7, 1.0, 1.0, 0.6, 0.75, 1.0])
    result = _search(backend, final_pairs=3).run()
    assert [c.name for c in result.kept] == ["small"]
    assert result.speedup_low <= 1.0 <= result.speedup_high
    assert "not resolved from 1.0" in result.records[-1].reason


def test_a_change_with_one_off_work_is_not_toggled_and_the_claim_comes_from_its_trial() -> None:
    change = Change("compile", 1.6)
    change.warmup_steps = 3
    backend = Scripted([change])
    result = _search(backend, final_pairs=3).run()
    assert result.speedup_source == "trials" and result.speedup == pytest.approx(1.6)
    assert result.records[-1].name != "final A/B" and backend.applied == [change]


def test_claimed_speedup_is_the_geometric_mean_with_a_student_t_interval() -> None:
    speedup, low, high = claimed_speedup([1.1, 1.2, 1.3])
    logs = [math.log(r) for r in (1.1, 1.2, 1.3)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert speedup == pytest.approx(math.exp(mean))
    assert (low, high) == pytest.approx(
        (math.exp(mean - 2.920 * sd / math.sqrt(3)), math.exp(mean + 2.920 * sd / math.sqrt(3)))
    )
    assert claimed_speedup([1.2]) == (pytest.approx(1.2), None, None)
    with pytest.raises(ValueError, match=r"claimed_speedup\(\[0.0\]\)"):
        claimed_speedup([0.0])


# ------------------------------------------------------------------ windows long enough for the noise
def test_a_noisy_baseline_lengthens_the_windows_and_the_search_goes_on_when_the_noise_settles() -> None:
    # a 20 ms step (10 samples at 500 samples/s) with 14 % A/A noise at 20-step windows: above the gate's 10 % cap
    # (below the 15 % of a burst, which measures a third window first); (13.9 / 10)^2 -> 2x longer windows, after
    # which the A/A noise is 2 %
    backend = Scripted([Change("workers", 1.3)], rate=500.0, noise=[1.0, 0.87, 1.0, 0.98])
    search = _search(backend)
    result = search.run()
    assert search.measure_steps == 40
    assert any("A/A noise was 13.9%: windows lengthened to 40 steps, A/A noise now 2.0%" in n for n in result.notes)
    assert result.noise == pytest.approx(0.02 / 0.99) and [c.name for c in result.kept] == ["workers"]


def test_noise_longer_windows_do_not_settle_refuses_the_gains_inside_it_saying_so() -> None:
    # 12.8 % after 2x longer windows: the gate rises to it; a 6 % gain (paired 1.07) cannot be told from the noise
    # and is not held for a bundle either; a decisive 2x gain is kept through it
    backend = Scripted(
        [Change("small", 1.06, expected=0.08), Change("big", 2.0)],
        rate=500.0,
        noise=[1.0, 0.87, 0.88, 1.0, 1.01, 1.0, 1.0],
    )
    result = _search(backend).run()
    assert any(
        n.startswith("noise too high to resolve a gain of 10%: the baseline's A/A noise is 12.8% at windows of 40")
        for n in result.notes
    )
    small = next(r for r in result.records if r.name == "small")
    assert (
        not small.kept and "noise too high to resolve a gain of 7% (the baseline's A/A noise is 12.8%)" in small.reason
    )
    assert [c.name for c in result.kept] == ["big"]


def test_noise_the_budget_cannot_lengthen_the_windows_for_is_said_once() -> None:
    # 0.7 s of budget: the baseline's two windows (~0.5 s) leave no room for two windows 2x longer
    backend = Scripted([Change("workers", 1.3)], rate=500.0, noise=[1.0, 0.87])
    result = _search(backend, budget_seconds=0.7).run()
    assert any("noise too high to resolve a gain of 10%" in n and "windows of 20 steps" in n for n in result.notes)
    assert not any("lengthened" in n for n in result.notes)
