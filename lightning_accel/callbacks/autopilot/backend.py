"""The Lightning backend of the Autopilot's search loop (:class:`~lightning_accel.core.autopilot.SearchBackend`):
windows and probes through :class:`~lightning_accel.callbacks.autopilot.windows.TrialRunner`, agreement across
ranks with one ``all_gather``, the doctor's rules and code smells to propose fixes, the fixes' own undo.

It never reads the callback: :class:`BackendConfig` holds what it needs of the user's arguments."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_accel.callbacks._fit.trainer_state import gather_floats, gather_outcomes
from lightning_accel.callbacks.autopilot.fixes import INTERVENTIONS, Intervention, Run
from lightning_accel.callbacks.autopilot.windows import Window
from lightning_accel.core.autopilot import (
    Bundle,
    NumericsCheck,
    Offer,
    Tolerance,
    WindowLength,
    compare_probes,
    proposal,
)
from lightning_accel.core.breakdown import MEASURED_STAGES

__all__ = ["BackendConfig", "FixCandidate", "LightningSearchBackend", "short_error"]


def short_error(err: BaseException | None, chars: int = 240) -> str:
    text = str(err).strip().splitlines()[0] if err is not None and str(err).strip() else repr(err)
    return text if len(text) <= chars else text[:chars] + "…"


@dataclass
class BackendConfig:
    """What the backend needs of the user's arguments.

    Attributes:
        fixes: the fixes it may try, by name: the built-in ones (``Autopilot(only=...)``) and the user's own.
        own: names of the user's own fixes (``Autopilot(interventions=...)``): tried after the built-in ones, with no
            expected gain.
        freeze: fix names and knobs the user froze (``Autopilot(freeze=...)``).
        tolerances: the numerics guard's tolerance per kind.
        probe_steps: optimizer steps of each numerics probe.
        threshold: the least gain a fix must show (the doctor's rules propose against it too).
        notes: where the backend adds what the report should say (the callback's ``notes``).
    """

    fixes: dict[str, Intervention]
    own: frozenset[str] = frozenset()
    freeze: frozenset[str] = frozenset()
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    probe_steps: int = 2
    threshold: float = 0.05
    notes: list[str] = field(default_factory=list)

    def frozen(self, fix: Intervention) -> bool:
        return fix.name in self.freeze or any(k in self.freeze for k in fix.knobs)


class FixCandidate:
    """A fix bound to this fit's :class:`Run`: the loop's :class:`~lightning_accel.core.autopilot.Candidate`."""

    def __init__(self, fix: Intervention, run: Run) -> None:
        self.fix, self.run = fix, run

    @property
    def name(self) -> str:
        return self.fix.name

    @property
    def kind(self) -> str:
        return self.fix.kind

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(self.fix.knobs)

    @property
    def warmup_steps(self) -> int:
        return int(self.fix.warmup_steps)

    @property
    def probe_through_strategy(self) -> bool:
        return bool(self.fix.probe_through_strategy)

    def describe(self) -> str:
        return self.fix.describe(self.run)

    def setup_seconds(self) -> float:
        return float(self.fix.setup_seconds(self.run))

    def judge(self, before: Any, after: Any) -> tuple[bool, str] | None:
        return self.fix.judge(self.run, before, after)

    def __repr__(self) -> str:
        return repr(self.fix)


class LightningSearchBackend:
    """One fit's backend: ``run`` is what the fixes see and change."""

    def __init__(self, config: BackendConfig, run: Run) -> None:
        self.config, self.run = config, run
        self.fixes = dict(config.fixes)
        self._probe_steps: list[list[Any]] | None = None
        self._reference: Any = None
        self._strategy_reference: Any = None
        self._length = WindowLength()
        self._compute: list[Any] | None = None  # the compute findings of the one attribution window

    def _builtin(self, name: str) -> bool:
        return name in INTERVENTIONS and name not in self.config.own

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
        """The configuration now current: its window, and the numerics reference of the trials that follow (the
        current configuration probed on the fixed probe batches)."""
        self.run.current = current
        if baseline is not None:
            self.run.baseline = baseline
        runner = self.run.runner
        if self._probe_steps is None:
            self._probe_steps = runner.probe_batches(self.config.probe_steps)
        self._reference = runner.probe(self._probe_steps)

    # ------------------------------------------------------------------ measuring (aggregated over ranks)
    def measure(self, warmup_steps: int, steps: int) -> Window:
        """One window, aggregated over ranks, as long as :class:`~lightning_accel.core.autopilot.WindowLength` says
        (in optimizer steps: the step count follows from the last aggregated window, the same on every rank)."""
        run = self.run
        warmup, timed = self._length.steps(warmup_steps, steps, run.config.accumulate)
        local = run.runner.measure(warmup, timed)
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
        window.micro_batches = max(1, int(run.config.accumulate))
        self._length.observe(window, steps)
        return window

    # ------------------------------------------------------------------ numerics
    def check(self, candidate: FixCandidate | Bundle) -> NumericsCheck:
        members = candidate.members if isinstance(candidate, Bundle) else [candidate]
        data = any(m.kind == "data" for m in members)
        through = bool(candidate.probe_through_strategy)
        probe = self.run.runner.probe(self._probe_steps, through_strategy=through, digests=data)
        if not probe.digests:  # a change of another kind delivers the same samples: no loader pass
            probe.digests = list(self._reference.digests)
        reference = self._strategy_reference if through and self._strategy_reference is not None else self._reference
        kind = candidate.kind
        check = compare_probes(reference, probe, kind, self.config.tolerances[kind], same_batches=data)
        if not check.ok:
            return check
        void = next(
            (why for m in members if isinstance(m, FixCandidate) and (why := m.fix.changed_nothing(self.run))), None
        )
        return replace(check, changed_nothing=void)

    # ------------------------------------------------------------------ changes
    def apply(self, candidate: FixCandidate) -> Callable[[], None]:
        run, fix = self.run, candidate.fix
        if candidate.probe_through_strategy:  # its reference through the same path, before the change
            self._strategy_reference = run.runner.probe(self._probe_steps, through_strategy=True, digests=False)
        else:
            self._strategy_reference = None
        legacy = type(fix).apply is not Intervention.apply  # a fix written as apply() + revert()
        try:
            result = fix.apply(run)
        except BaseException:
            if legacy:  # undo what the failed apply may have changed before it raised
                try:
                    fix.revert(run)
                except Exception:  # noqa: BLE001 - it may have raised before changing anything
                    pass
            raise
        if callable(result):
            return result
        return lambda: fix.revert(run)

    def follow_up(self, candidate: FixCandidate, kept: bool) -> bool:
        """A kept repeatable fix is offered once more (the micro-batch doubled again); a refused one with a
        ``fallback`` offers that (bf16 after a refused Top-K). The user's own fixes have neither."""
        fix = candidate.fix
        name = fix.name
        if not self._builtin(name) or self.fixes.get(name) is not fix:
            return False
        if kept:
            if fix.repeatable:
                self.fixes[name] = INTERVENTIONS[name]()
                return True
            return False
        nxt = getattr(fix, "fallback", None)
        following = nxt() if callable(nxt) else None
        if following is not None:
            self.fixes[name] = following
            return True
        return False

    # ------------------------------------------------------------------ what to try
    def offers(self, shares: Mapping[str, float], tried: set[str]) -> list[Offer]:
        """The core's :func:`~lightning_accel.core.autopilot.proposal` for this run: the doctor's rules, and after
        the baseline its code smells and compute findings; each with why it cannot be tried (frozen, or the fix's
        own reason), rank 0's list on every rank."""
        config, run = self.config, self.run
        ctx = run_context(run)
        smells: list[str] = []
        compute: list[Any] = []
        if self._probe_steps is not None:  # before the baseline (the pay-back estimate) the shares alone decide:
            smells = smell_rules(run, ctx)  # the smells' previews cost 0.1-0.3 s of a fit that may be short
            compute = self._compute_findings(shares, ctx)
        ranked = proposal(
            shares,
            ctx,
            builtin=[n for n in self.fixes if self._builtin(n)],
            extras=[n for n in self.fixes if not self._builtin(n)],
            tried=tried,
            device_type=run.device.type,
            threshold=config.threshold,
            accumulate=run.config.accumulate,
            smells=smells,
            compute=compute,
        )
        rows = []
        for name, gain, confidence in ranked:
            fix = self.fixes[name]
            why = "frozen by Autopilot(freeze=...)" if config.frozen(fix) else fix.unavailable(run)
            rows.append((name, why, gain, confidence))
        if run.trainer.world_size > 1:
            # rank 0's list for every rank: a smell previewed on one rank's clock must not make the ranks diverge
            rows = run.trainer.strategy.broadcast(rows, src=0)
        return [Offer(FixCandidate(self.fixes[name], run), why, gain, conf) for name, why, gain, conf in rows]

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
            self.config.notes.append(f"compute attribution skipped: {short_error(err)}")
        return self._compute


def run_context(run: Run) -> Any:
    """The doctor's run facts (``doctor.facts.static_context``) with the current configuration's loader settings and
    accumulation."""
    from lightning_accel.callbacks.doctor.facts import static_context

    ctx = static_context(run.trainer, run.device)
    settings = run.source.current()
    ctx.accumulate_grad_batches = run.config.accumulate
    ctx.num_workers, ctx.pin_memory = settings["num_workers"], settings["pin_memory"]
    ctx.prefetch_factor, ctx.persistent_workers = settings["prefetch_factor"], settings["persistent_workers"]
    ctx.loader, ctx.batch_size = "DataLoader", settings["batch_size"]
    return ctx


def smell_rules(run: Run, ctx: Any) -> list[str]:
    """Rule names of the doctor's code smells (``find_smells``, its previews capped at 0.1 s) for the current
    configuration; none if they cannot be read (they only reorder what is tried, never decide)."""
    from lightning_accel.core.smells import find_smells

    settings = run.source.current()
    try:
        found = find_smells(
            run.module,
            run.trainer.optimizers,
            device_type=run.device.type,
            device_capability=ctx.device_capability,
            compute_dtype=ctx.compute_dtype,
            accumulate_grad_batches=run.config.accumulate,
            cpu_count=ctx.cpu_count,
            loader={k: settings[k] for k in ("num_workers", "pin_memory", "persistent_workers", "batch_size")},
        )
    except Exception:  # noqa: BLE001
        return []
    return [f.rule for f in found.findings]
