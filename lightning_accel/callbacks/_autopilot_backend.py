"""The Lightning backend of the Autopilot's search loop (:class:`~lightning_accel.core.autopilot_search.SearchBackend`):
windows and probes through :class:`~lightning_accel.callbacks._autopilot_trials.TrialRunner`, agreement across ranks
with one ``all_gather``, the doctor's rules and code smells to propose fixes, the interventions' own undo."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks._autopilot_trials import Window
from lightning_accel.callbacks._fit.trainer_state import gather_floats, gather_outcomes
from lightning_accel.callbacks.interventions import INTERVENTIONS, Intervention, Run
from lightning_accel.core.autopilot import (
    NumericsCheck,
    compare_probes,
    expected_gain,
    fix_gains,
    propose,
    rank_by_expected_gain,
)
from lightning_accel.core.autopilot_search import MIN_WINDOW_SECONDS, Bundle, Offer
from lightning_accel.core.breakdown import MEASURED_STAGES

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot import Autopilot

__all__ = ["LightningSearchBackend", "short_error"]


def short_error(err: BaseException | None, chars: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if err is not None and str(err).strip() else repr(err)
    return text if len(text) <= chars else text[:chars] + "…"


class LightningSearchBackend:
    """One fit's backend: ``run`` is what the interventions see and change."""

    def __init__(self, autopilot: Autopilot, run: Run) -> None:
        self.autopilot, self.run = autopilot, run
        self.candidates = autopilot._candidates(run)
        # the built-in fixes the diagnosis proposes; fixes passed in `interventions=` are tried after them
        self._builtin = {
            name
            for name, c in self.candidates.items()
            if name in INTERVENTIONS and not any(c is e for e in autopilot.extra)
        }
        self._probe_steps: list[list[Any]] | None = None
        self._reference: Any = None
        self._strategy_reference: Any = None
        self._step_seconds: float | None = None  # of the last window, aggregated over ranks
        self._target_seconds: float | None = None  # the timed length of the baseline's first window
        self._compute: list[Any] | None = None  # the compute findings of the one attribution window

    # ------------------------------------------------------------------ clock, ranks, state
    def clock(self) -> float:
        return time.perf_counter()

    def agree(self, ok: bool, error: BaseException | None) -> tuple[bool, str | None]:
        oks, failed = gather_outcomes(self.run.trainer, 1.0 if ok else 0.0, error, "Autopilot trial outcome")
        if failed:
            return False, (
                f"{type(error).__name__}: {short_error(error)}" if error is not None else f"failed on rank(s) {failed}"
            )
        return bool(oks.min() > 0), None

    def restore(self) -> None:
        self.run.runner.state.restore()

    def adopt(self, current: Any, baseline: Any) -> None:
        self.run.current = current
        if baseline is not None:
            self.run.baseline = baseline

    # ------------------------------------------------------------------ measuring (aggregated over ranks)
    def window_steps(self, warmup_steps: int, steps: int) -> tuple[int, int]:
        """The optimizer steps a window of ``warmup_steps`` + ``steps`` runs (see :meth:`measure`)."""
        k = max(1, int(self.run.config.accumulate))
        if k == 1:
            return warmup_steps, steps
        return max(1, math.ceil(warmup_steps / k)), max(2, math.ceil(steps / math.sqrt(k)))

    def measure(self, warmup_steps: int, steps: int) -> Window:
        """One window, aggregated over ranks. Under gradient accumulation (k micro-batches per optimizer step) the
        window is ``ceil(warmup / k)`` warm-up and ``ceil(steps / sqrt(k))`` timed optimizer steps (at least 1 and 2):
        worker start-up and the allocator warm up per micro-batch, and k micro-batches per timed step already average k
        calls (on the GPT-2 script of benchmarks/bench_autopilot_real.py, micro-batch 4 x 8, the full protocol would
        take 5 s a window: two trials in a 5 % budget of a 10-minute fit). Every window after the baseline's first is at
        least ``MIN_WINDOW_SECONDS`` and at most as long in seconds as that one (the step count follows from the last
        window's aggregated step time, the same on every rank)."""
        run = self.run
        short = steps <= 2  # the pay-back estimate: three steps, however short
        warmup_steps, steps = self.window_steps(warmup_steps, steps)
        if not short and self._step_seconds:
            # from the last window's aggregated step time, so every rank runs the same number of DDP steps
            # (the count follows from the last window's aggregated step time, the same on every rank)
            steps = min(4 * steps, max(steps, math.ceil(MIN_WINDOW_SECONDS / self._step_seconds)))
            if self._target_seconds:
                # no longer than the baseline's windows: a window averages the machine's noise by its length in
                # seconds, not in steps; after the 4 x 8 -> 32 x 1 jump of bench_autopilot_real.py's GPT-2 the
                # same step count takes 3.2 s instead of 1.4 s, and the next trial (SDPA) would not fit the budget
                steps = min(steps, max(2, math.ceil(self._target_seconds / self._step_seconds)))
        local = run.runner.measure(warmup_steps, steps)
        stages = [local.stage_seconds.get(s, 0.0) for s in MEASURED_STAGES]
        rows = gather_floats(
            run.trainer,
            run.trainer.strategy.root_device,
            [local.samples, local.seconds, local.steps, local.warmup_seconds, *stages],
            what="Autopilot measurement window",
        )
        if rows.shape[0] == 1:
            window = local
        else:  # global samples over the slowest rank's time; stage seconds averaged over ranks
            window = Window(
                samples=int(rows[:, 0].sum()),
                seconds=float(rows[:, 1].max()),
                steps=int(rows[:, 2].min()),
                stage_seconds={s: float(rows[:, 4 + i].mean()) for i, s in enumerate(MEASURED_STAGES)},
                warmup_seconds=float(rows[:, 3].max()),
            )
        self._step_seconds = window.step_seconds
        if not short and self._target_seconds is None:
            self._target_seconds = window.seconds
        return window

    # ------------------------------------------------------------------ numerics
    def reference(self) -> None:
        runner = self.run.runner
        if self._probe_steps is None:
            self._probe_steps = runner.probe_batches(self.autopilot.probe_steps)
        self._reference = runner.probe(self._probe_steps)

    def prepare(self, candidate: Any) -> None:
        self._strategy_reference = None
        if getattr(candidate, "probe_through_strategy", False):  # the reference through the same path, unchanged
            self._strategy_reference = self.run.runner.probe(self._probe_steps, through_strategy=True, digests=False)

    def check(self, candidate: Any) -> NumericsCheck:
        members = candidate.members if isinstance(candidate, Bundle) else [candidate]
        data = any(m.kind == "data" for m in members)
        through = bool(getattr(candidate, "probe_through_strategy", False))
        probe = self.run.runner.probe(self._probe_steps, through_strategy=through, digests=data)
        if not probe.digests:  # a change of another kind delivers the same samples: no loader pass
            probe.digests = list(self._reference.digests)
        reference = self._strategy_reference if through and self._strategy_reference is not None else self._reference
        kind = candidate.kind
        return compare_probes(reference, probe, kind, self.autopilot.tolerances[kind], same_batches=data)

    # ------------------------------------------------------------------ changes
    def apply(self, candidate: Intervention) -> Callable[[], None]:
        run = self.run
        legacy = type(candidate).apply is not Intervention.apply  # a fix written as apply() + revert()
        try:
            result = candidate.apply(run)
        except BaseException:
            if legacy:  # undo what the failed apply may have changed before it raised
                try:
                    candidate.revert(run)
                except Exception:  # noqa: BLE001 - it may have raised before changing anything
                    pass
            raise
        if callable(result):
            return result
        return lambda: candidate.revert(run)

    def setup_seconds(self, candidate: Intervention) -> float:
        return float(candidate.setup_seconds(self.run))

    def changed_nothing(self, candidate: Intervention) -> str | None:
        return candidate.changed_nothing(self.run)

    def judge(self, candidate: Intervention, before: Any, after: Any) -> tuple[bool, str] | None:
        return candidate.judge(self.run, before, after)

    def describe(self, candidate: Intervention) -> str:
        return candidate.describe(self.run)

    def renew(self, candidate: Intervention) -> bool:
        name = candidate.name
        if candidate.repeatable and name in self._builtin and self.candidates.get(name) is candidate:
            self.candidates[name] = INTERVENTIONS[name]()  # e.g. the micro-batch doubled once more
            return True
        return False

    def fall_back(self, candidate: Intervention) -> bool:
        name = candidate.name
        nxt = getattr(candidate, "fallback", None)
        if name in self._builtin and self.candidates.get(name) is candidate and callable(nxt):
            following = nxt()
            if following is not None:
                self.candidates[name] = following  # e.g. bf16 after a refused Top-K
                return True
        return False

    # ------------------------------------------------------------------ what to try
    def offers(self, shares: Mapping[str, float], tried: set[str]) -> list[Offer]:
        from lightning_accel.core.autopilot import prior_confidence, prior_device
        from lightning_accel.core.rules import diagnose, holding_back

        autopilot, run = self.autopilot, self.run
        shares = dict(shares)
        ctx = autopilot._context(run)
        diagnosis = diagnose(shares, ctx)
        bottleneck = holding_back(shares, diagnosis.findings)
        # the measured findings, a larger micro-batch where accumulation leaves room for one, the code smells
        rules = [f.rule for f in diagnosis.findings]
        rules += ["accumulation"] * (run.config.accumulate > 1)
        if self._probe_steps is not None:  # before the baseline (the pay-back estimate) the shares alone decide:
            rules += autopilot._smells(run, ctx)  # the smells' previews cost 0.1-0.3 s of a fit that may be short
            compute = self._compute_findings(shares, ctx)
            rules = [f.rule for f in compute] + rules
        else:
            compute = []
        device = prior_device(run.device.type)  # "cpu+bf16": a CPU with bf16 in hardware
        builtin = {n: c for n, c in self.candidates.items() if n in self._builtin}
        measured = fix_gains(compute)
        names = propose(rules, bottleneck, builtin, tried, shares, autopilot.threshold)
        names = rank_by_expected_gain(names, shares, device, measured)
        names += [n for n in self.candidates if n not in self._builtin and n not in tried and n not in names]
        rows = []
        for name in names:
            candidate = self.candidates[name]
            why = "frozen by Autopilot(freeze=...)" if autopilot._frozen(candidate) else candidate.unavailable(run)
            gain = (measured.get(name) or expected_gain(name, shares, device)) if name in self._builtin else None
            rows.append((name, why, gain, prior_confidence(name, device)))
        if run.trainer.world_size > 1:
            # rank 0's list for every rank: a smell previewed on one rank's clock must not make the ranks diverge
            rows = run.trainer.strategy.broadcast(rows, src=0)
        return [Offer(self.candidates[name], why, gain, confidence) for name, why, gain, confidence in rows]

    def _compute_findings(self, shares: Mapping[str, float], ctx: Any) -> list[Any]:
        """The compute findings of one attribution window (the doctor's, over the trial runner's steps), taken the
        first time forward + backward reach the doctor's compute threshold after the baseline; they order the
        compute fixes by what they would save. Every rank runs the window (its steps all-reduce under DDP)."""
        if self._compute is not None:
            return self._compute
        from dataclasses import replace

        from lightning_accel.core.compute_causes import find_compute_causes, nchw_convolutions
        from lightning_accel.core.rules import Thresholds

        compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
        if compute < Thresholds().compute_share:
            return []
        self._compute = []
        try:
            table = self.run.runner.attribute()
            if ctx is not None:  # read now: a kept fix may have converted the model since the fit started
                ctx = replace(ctx, nchw_convolutions=nchw_convolutions(self.run.module))
            self._compute = find_compute_causes(table, context=ctx, compute_share=min(1.0, compute))
        except Exception as err:  # noqa: BLE001 - the priors order the fixes without it
            self.autopilot.notes.append(f"compute attribution skipped: {short_error(err)}")
        return self._compute
