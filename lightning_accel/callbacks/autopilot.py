"""Autopilot: the method's loop run automatically on the user's own run — measure, apply the fix for the slowest
stage, measure again, keep only proven gains (with a numerics check), hand back the configuration."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel._atomic import atomic_write_text
from lightning_accel._checks import check_int
from lightning_accel.callbacks._autopilot_trials import RunConfig, TrialRunner
from lightning_accel.callbacks.interventions import INTERVENTIONS, Intervention, Run, knob_names
from lightning_accel.core.autopilot import (
    DEFAULT_TOLERANCES,
    NUMERICS_KINDS,
    AutopilotPlan,
    Tolerance,
    TrialRecord,
    render_python,
    render_yaml,
)
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["Autopilot"]

#: when the fit's length is unknown (no max_steps, no max_epochs), the search gets this many seconds
UNKNOWN_LENGTH_BUDGET_SECONDS = 60.0


class Autopilot(Callback):
    """Runs the method's loop before training: measure a baseline, diagnose the slowest stage with the doctor's
    rules, trial the fix for it, keep it only if it is measurably faster and computes the same numbers, diagnose
    again, until no finding or candidate is left or the time budget is spent; then train with the result.

    ``Trainer(callbacks=[la.Autopilot()])`` needs nothing else. At ``on_fit_start`` (before the fit loop builds its
    dataloader) it runs :class:`~lightning_accel.core.autopilot_search.AutopilotSearch` (the loop, in the core;
    its module docstring argues each step from measured noise) with this callback as its Lightning backend:

    1. **Pay-back**: with a fit length and the fractional ``budget``, three steps estimate the step time and its
       stage shares; a fit too short for the best fix on offer to repay a baseline and a trial — with the default
       windows, or the shortest that average the noise out (2 + 0.25 s) — is not searched (one line says why) and
       trains untouched. Once measured, the budget follows the baseline's step time.
    2. **Baseline**: two windows of the run as configured (``warmup_steps`` untimed optimizer steps, then
       ``measure_steps`` timed), each step split into the doctor's stages with its :class:`StageTimer`; their
       spread is the noise floor (A/A); a spread above ``BASELINE_RETRY_NOISE`` × the threshold gets a third
       window, and the closest two count.
    3. **Diagnosis**: the doctor's rules (:func:`~lightning_accel.core.rules.diagnose`), its code smells
       (:func:`~lightning_accel.core.smells.find_smells`), a larger micro-batch where ``accumulate_grad_batches > 1``,
       the stage holding the run back and the other stages name the fixes
       (:data:`~lightning_accel.core.autopilot.RULE_FIXES`, ``STAGE_FIXES``), ordered by expected gain (stage share
       × :data:`~lightning_accel.core.autopilot.EXPECTED_REMOVAL`, per device: a CPU with bf16 in hardware has its
       own precision prior, ``prior_device``): DataLoader workers (``DataLoaderTuner``'s
       search), ``pin_memory`` (CUDA), ``DevicePrefetcher``, a larger micro-batch with the global batch fixed,
       fused / foreach optimizer steps, mixed precision (``AutoMixedPrecision`` installed from Lightning's
       default ``32-true``, or another dtype of the user's plugin), TF32 (CUDA), ``TorchCompile`` (kept only if it
       pays back its compile time), fused attention, activation checkpointing with a larger micro-batch. When
       forward + backward reach the doctor's compute threshold after the baseline, one profiled window (the
       doctor's compute attribution, :mod:`lightning_accel.core.compute_causes`) adds its findings' fixes, and
       what they would save replaces those fixes' priors (:func:`~lightning_accel.core.autopilot.fix_gains`).
    4. **Trial**: each candidate is applied (its undo kept), checked by the **numerics guard** — on fixed probe
       batches at the same weights, its loss, gradient direction and optimizer update against the current
       configuration's, within the tolerance of its kind (bit-identical batches for data-loading changes;
       ``DEFAULT_TOLERANCES``) — and measured in a window paired with one of the current configuration right
       before it; a ratio above ``1 + max(threshold, noise)`` is confirmed by a second pair in reverse order
       (A B B A). A change
       measured faster but below the gate is held; the held ones are confirmed together as a bundle (split on a
       numerics failure). After a kept change the run is diagnosed again (the bottleneck moves).
    5. **Result**: the kept changes stay applied for the real training; a live line and each trial's row are
       printed while it searches, then the table (trial, change, samples/s, × baseline, kept, reason);
       ``autopilot/*`` keys are logged, and the plan is written as JSON (``save_plan``) with the configuration as
       a LightningCLI YAML fragment (next to it, ``.yaml``) and a Python snippet (:attr:`yaml`, :attr:`python`).
       ``Autopilot(plan="autopilot_plan.json")`` replays a plan without searching.

    **Trial steps are undone.** Every trial runs real training steps (the module's ``training_step``, backward and
    optimizer step, as the fit loop runs them) outside the fit loop, and the parameters, gradients, buffers,
    optimizer and scheduler state, precision-plugin state and every RNG are restored bit for bit afterwards, as the
    tuners do. So the training that follows is exactly the run the user would have had with the chosen settings
    from the start — same initial weights, same sample order — and ``global_step``, loop progress and logged
    metrics do not count the trials. Callback hooks do not fire during trials (the doctor and MFUMonitor see only
    real training). Under DDP every rank runs the same trials in lockstep through the DDP wrapper (the gradient
    all-reduce is part of each measured step); decisions come from measurements aggregated over ranks (global
    samples ÷ the slowest rank's time; mean stage seconds), so every rank applies the identical decision.

    **Faults.** A change that raises while being applied or trialled (a compile error, a loader that cannot be
    rebuilt, a missing attribute) is reverted, reported in the table and skipped; the search goes on from the last
    good configuration. Ctrl-C during a trial reverts that trial's change and restores the training state before
    the interrupt propagates. A budget too small for one trial after the baseline changes nothing and says so.
    ``freeze`` pins settings the search must never touch.

    Logged through every logger (``logger.log_metrics``): per trial when it is decided (step = trial index), then
    once at the end:

    =======================================  ==========  =========================================================
    key                                      unit        meaning
    =======================================  ==========  =========================================================
    ``autopilot/trial_speedup``              ratio       per trial: mean paired ratio against the configuration it
                                                         was trialled against (only when measured)
    ``autopilot/trial_kept``                 0/1         per trial: whether it was kept
    ``autopilot/baseline_samples_per_sec``   samples/s   global, the run as configured (median of its windows)
    ``autopilot/final_samples_per_sec``      samples/s   global, with the kept changes (median of its windows)
    ``autopilot/speedup``                    ratio       the kept set ÷ the untouched configuration, from the
                                                         final check's paired windows (B A, A B, B A after the
                                                         search; 1.0 when nothing is kept)
    ``autopilot/speedup_low``, ``_high``     ratio       its 90 % interval (from the pairs' spread)
    ``autopilot/trials``                     count       candidates trialled
    ``autopilot/kept``                       count       changes kept
    ``autopilot/noise``                      fraction    (max - min) / median of the baseline's repeated windows
    ``autopilot/search_seconds``             s           wall time of the search (this rank)
    =======================================  ==========  =========================================================

    Args:
        budget: the search's share of the fit's expected wall time (steps × the estimated step time), e.g. 0.05;
            raised to a baseline and one trial when the best fix on offer is expected to repay them; a fit whose
            best fix cannot repay a search is not searched.
        budget_seconds: an absolute budget in seconds instead (overrides ``budget``; no pay-back estimate).
        threshold: smallest relative gain worth keeping (0.05 = 5 %, DeepSpeed Autotuning's plateau); the
            measured noise raises it.
        warmup_steps / measure_steps: untimed and timed optimizer steps per window.
        probe_steps: optimizer steps' worth of batches in the numerics probe.
        patience: stop after this many measured candidates in a row that were not kept (a change rejected before
            measuring, by the numerics guard or as void, costs only its probe and does not count; nor does a small
            gain held for a bundle).
        freeze: settings never to touch: intervention names (``"dataloader"``, ``"precision"``, ...) or knobs
            (``"num_workers"``, ``"batch_size"``, ``"accumulate_grad_batches"``, ``"optimizer"``, ...).
        interventions: extra :class:`Intervention` objects to trial (fixes of your own), tried after the built-in
            fixes the diagnosis names.
        only: trial only these built-in fixes (names), e.g. ``["dataloader", "micro_batch"]``.
        tolerances: per numerics kind (``data``, ``exact``, ``reorder``, ``low_precision``) a
            :class:`~lightning_accel.core.autopilot.Tolerance` replacing the default.
        plan: path of a plan to replay instead of searching.
        save_plan: where to write the plan (default ``<default_root_dir>/autopilot_plan.json``; ``False``: nowhere).
        print_summary: on rank 0, show the search while it runs (a live line on a terminal with the progress bar,
            plain lines otherwise; each trial's row when decided) and print the table and the configuration.
        nvtx: each phase of the search as an NVTX range in the ``lightning_accel`` domain (``autopilot/<phase>
            <candidate>``: baseline, numerics probe, measuring, confirmation, ...), for an nsys timeline of the
            search; off by default, no cost when off (:mod:`lightning_accel.core.nvtx`).

    After ``on_fit_start``: :attr:`records` (the table's rows), :attr:`plan` (:class:`AutopilotPlan`),
    :attr:`yaml` and :attr:`python` (the configuration), :attr:`kept` (the kept interventions).
    """

    def __init__(
        self,
        *,
        budget: float = 0.05,
        budget_seconds: float | None = None,
        threshold: float = 0.05,
        warmup_steps: int = 5,
        measure_steps: int = 20,
        probe_steps: int = 2,
        patience: int = 4,
        freeze: Sequence[str] = (),
        interventions: Sequence[Intervention] = (),
        only: Sequence[str] | None = None,
        tolerances: Mapping[str, Tolerance] | None = None,
        plan: str | os.PathLike[str] | None = None,
        save_plan: str | os.PathLike[str] | bool | None = None,
        print_summary: bool = True,
        nvtx: bool = False,
    ) -> None:
        if not (isinstance(budget, (int, float)) and 0 < budget <= 1):
            raise ValueError(f"Autopilot(budget={budget!r}): give the search's share of the fit in (0, 1], e.g. 0.05")
        if budget_seconds is not None and not (isinstance(budget_seconds, (int, float)) and budget_seconds >= 0):
            raise ValueError(f"Autopilot(budget_seconds={budget_seconds!r}): give seconds >= 0, e.g. 60")
        if not (isinstance(threshold, (int, float)) and 0 <= threshold < 1):
            raise ValueError(f"Autopilot(threshold={threshold!r}): give a relative gain in [0, 1), e.g. 0.05")
        for name, value, low in (
            ("warmup_steps", warmup_steps, 1),
            ("measure_steps", measure_steps, 2),
            ("probe_steps", probe_steps, 1),
            ("patience", patience, 1),
        ):
            check_int("Autopilot", name, value, minimum=low)
        valid = set(INTERVENTIONS) | set(knob_names())
        freeze = [freeze] if isinstance(freeze, str) else list(freeze)
        unknown = sorted(set(freeze) - valid)
        if unknown:
            raise ValueError(
                f"Autopilot(freeze={freeze!r}): {unknown} unknown; freeze fix names {sorted(INTERVENTIONS)} "
                f"or settings {knob_names()}"
            )
        if only is not None:
            only = [only] if isinstance(only, str) else list(only)
            bad = sorted(set(only) - set(INTERVENTIONS))
            if bad:
                raise ValueError(f"Autopilot(only={only!r}): {bad} unknown; fixes are {sorted(INTERVENTIONS)}")
        for extra in interventions:
            if not isinstance(extra, Intervention) or not extra.name:
                raise ValueError(f"Autopilot(interventions=...): {extra!r} is not an Intervention with a `name`")
            if extra.kind not in NUMERICS_KINDS:
                raise ValueError(
                    f"Autopilot(interventions=...): {type(extra).__name__}.kind={extra.kind!r}; kinds "
                    f"are {list(NUMERICS_KINDS)}"
                )
        self.tolerances = dict(DEFAULT_TOLERANCES)
        for kind, tol in (tolerances or {}).items():
            if kind not in NUMERICS_KINDS or not isinstance(tol, Tolerance):
                raise ValueError(
                    f"Autopilot(tolerances={{{kind!r}: {tol!r}}}): keys are {list(NUMERICS_KINDS)}, "
                    "values Tolerance(max_loss_rel, min_grad_cosine, min_update_cosine)"
                )
            self.tolerances[kind] = tol
        self.plan_path = Path(plan) if plan is not None else None
        if self.plan_path is not None:
            AutopilotPlan.load(self.plan_path)  # a bad plan fails here, before any training
        self.budget, self.budget_seconds, self.threshold = float(budget), budget_seconds, float(threshold)
        self.warmup_steps, self.measure_steps, self.probe_steps = warmup_steps, measure_steps, probe_steps
        self.patience = patience
        self.freeze = freeze
        self.only = only
        self.extra = list(interventions)
        self.save_plan = save_plan
        self.print_summary = print_summary
        if not isinstance(nvtx, bool):
            raise ValueError(f"Autopilot(nvtx={nvtx!r}): give True or False")
        self.nvtx = nvtx
        self.records: list[TrialRecord] = []
        self.kept: list[Intervention] = []
        self.plan: AutopilotPlan | None = None
        self.yaml = ""
        self.python = ""
        self.notes: list[str] = []
        self._done = False
        self._restored_plan: dict[str, Any] | None = None
        self._prefetcher: Any = None
        self._source: Any = None  # the fit's train-loader source, once a search or a replay ran
        self._step_seconds: float | None = None  # of the configuration the search ended with

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._restored_plan is not None and self.plan_path is None:
            # a resumed fit saves the plan it resumed with, unchanged (its search's numbers included), so every
            # later resume replays the same plan and reports the same search
            return {"plan": self._restored_plan}
        return {"plan": self.plan.to_dict()} if self.plan is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a resumed fit replays the plan it trained with instead of searching again
        self._restored_plan = state_dict.get("plan")

    # ------------------------------------------------------------------ hooks
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._done:
            return
        self._done = True
        reason = self._unsupported(trainer)
        if reason is not None:
            rank_zero_warn(f"Autopilot: {reason}; training as configured")
            self.notes.append(reason)
            return
        from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource

        try:
            source = TrainLoaderSource(trainer, pl_module)
        except ValueError as err:
            rank_zero_warn(f"Autopilot: {err}; it needs one torch DataLoader to measure with; training as configured")
            self.notes.append(str(err))
            return
        self._source = source
        run = self._make_run(trainer, pl_module, source)
        if self.plan_path is not None or self._restored_plan is not None:
            plan = (
                AutopilotPlan(**self._restored_plan)
                if self._restored_plan is not None and self.plan_path is None
                else AutopilotPlan.load(self.plan_path)  # type: ignore[arg-type]
            )
            self._replay(run, plan)
        else:
            try:
                self._search(run)
            except Exception as err:  # noqa: BLE001 - the search must not cost the user the training
                note = (
                    f"the search stopped on {type(err).__name__}: {_short(err)}; training with the "
                    f"{len(self.kept)} change(s) kept before it"
                )
                self.notes.append(note)
                rank_zero_warn(f"Autopilot: {note}")
                if self.plan is not None:
                    self.plan.stopped = note
            self._checkpoint_trial(run)
        self._install(run)
        self._finish(run)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if self._prefetcher is not None:
            self._prefetcher.teardown(trainer, pl_module, stage)
            self._prefetcher = None

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _unsupported(trainer: pl.Trainer) -> str | None:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        if isinstance(trainer.strategy, DeepSpeedStrategy):
            return (
                "under DeepSpeed the engine owns backward and the optimizer step, which the Autopilot's trial "
                "steps cannot run and undo"
            )
        if len(trainer.optimizers) == 0:
            return "the LightningModule has no optimizer"
        return None

    def _make_run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, source: Any) -> Run:
        from lightning_accel.callbacks._fit.step_runner import TrainingState

        state = TrainingState(trainer, pl_module)
        config = RunConfig(accumulate=int(trainer.accumulate_grad_batches))
        runner = TrialRunner(trainer, pl_module, source, config, state)
        run = Run(trainer, pl_module, source, config, runner)
        run.steps_left = self._fit_steps(trainer, source)
        run.extras["warmup_steps"] = self.warmup_steps
        return run

    @staticmethod
    def _fit_steps(trainer: pl.Trainer, source: Any) -> int | None:
        """Optimizer steps the fit will run (``max_steps``, else epochs × batches ÷ accumulation), ``None`` if
        unbounded or unknown."""
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        epochs = trainer.max_epochs
        if epochs is None or epochs < 0:
            return None
        from lightning_accel.callbacks._fit.trainer_state import steps_per_epoch

        try:
            batches = source.batches()
        except TypeError:
            return None
        return max(1, epochs * steps_per_epoch(trainer, batches, trainer.accumulate_grad_batches))

    def _candidates(self, run: Run) -> dict[str, Intervention]:
        names = self.only if self.only is not None else list(INTERVENTIONS)
        out = {name: INTERVENTIONS[name]() for name in names}
        for extra in self.extra:
            out[extra.name] = extra
        return out

    def _frozen(self, candidate: Intervention) -> bool:
        return candidate.name in self.freeze or any(k in self.freeze for k in candidate.knobs)

    # ------------------------------------------------------------------ the search
    def _context(self, run: Run) -> Any:
        """The doctor's run facts (``doctor.facts.static_context``) with the current configuration's loader
        settings and accumulation."""
        from lightning_accel.callbacks.doctor.facts import static_context

        ctx = static_context(run.trainer, run.device)
        settings = run.source.current()
        ctx.accumulate_grad_batches = run.config.accumulate
        ctx.num_workers, ctx.pin_memory = settings["num_workers"], settings["pin_memory"]
        ctx.prefetch_factor, ctx.persistent_workers = settings["prefetch_factor"], settings["persistent_workers"]
        ctx.loader, ctx.batch_size = "DataLoader", settings["batch_size"]
        return ctx

    # ------------------------------------------------------------------ the search
    def _search(self, run: Run) -> None:
        """The core loop (:class:`~lightning_accel.core.autopilot_search.AutopilotSearch`) on this fit's backend."""
        from lightning_accel.callbacks._autopilot_backend import LightningSearchBackend
        from lightning_accel.callbacks._autopilot_display import SearchDisplay
        from lightning_accel.core.autopilot_search import AutopilotSearch

        trainer = run.trainer
        plan = AutopilotPlan(world_size=trainer.world_size, model=type(run.module).__name__)
        self.plan = plan
        live = trainer.progress_bar_callback is not None and _is_terminal()
        display = SearchDisplay(
            enabled=self.print_summary and trainer.is_global_zero,
            live=live,
            on_record=lambda record: self._log_trial(trainer, record),
        )
        if self.nvtx:
            from lightning_accel.core.nvtx import SearchPhaseRanges, nvtx_unavailable

            why = nvtx_unavailable()
            if why is None:
                display = SearchPhaseRanges(display)
            else:  # a diagnostics flag never takes the search or the training down
                rank_zero_warn(f"Autopilot(nvtx=True): no NVTX ranges: {why}. The search runs without them.")
        search = AutopilotSearch(
            LightningSearchBackend(self, run),
            threshold=self.threshold,
            warmup_steps=self.warmup_steps,
            measure_steps=self.measure_steps,
            patience=self.patience,
            budget=self.budget,
            budget_seconds=self.budget_seconds,
            steps_left=run.steps_left,
            unknown_length_seconds=UNKNOWN_LENGTH_BUDGET_SECONDS,
            progress=display,
        )
        self._searching = search
        started = time.perf_counter()
        try:
            result = search.run()
        finally:
            display.close()
            result = search.result
            self.records, self.kept = result.records, result.kept
            self.notes.extend(result.notes)
            plan.baseline_samples_per_sec = result.baseline_samples_per_sec
            plan.final_samples_per_sec = result.final_samples_per_sec
            plan.speedup, plan.speedup_source = result.speedup, result.speedup_source
            plan.speedup_low, plan.speedup_high = result.speedup_low, result.speedup_high
            plan.noise = result.noise
            plan.stopped = result.stopped or None
            plan.search_seconds = time.perf_counter() - started
            self._step_seconds = result.step_seconds

    def _checkpoint_trial(self, run: Run) -> None:
        """The fix outside the step (``callbacks/_autopilot_checkpoint.py``): checkpoints written in a background
        thread, trialled after the step search on a fit whose saves cost enough, kept only when measured faster."""
        from lightning_accel.callbacks._autopilot_checkpoint import trial_async_checkpoint
        from lightning_accel.core.autopilot_search import noise_gate

        candidate = INTERVENTIONS["async_checkpoint"]()
        if self._frozen(candidate) or (self.only is not None and candidate.name not in self.only):
            return
        noise = self.plan.noise if self.plan is not None and self.plan.noise is not None else 0.0
        record = trial_async_checkpoint(
            run,
            candidate,
            index=len(self.records),
            gate=noise_gate(self.threshold, noise),
            steps=self.measure_steps,
            steps_left=run.steps_left,
            step_seconds=self._step_seconds,
        )
        if record is None:
            return
        self.records.append(record)
        if record.kept:
            self.kept.append(candidate)
        self._log_trial(run.trainer, record)
        if self.print_summary and run.trainer.is_global_zero:
            from lightning_accel.callbacks._autopilot_display import format_row

            print(format_row(record), flush=True)

    def _log_trial(self, trainer: pl.Trainer, record: TrialRecord) -> None:
        """``autopilot/trial_speedup`` (paired ratio against the configuration it was trialled against) and
        ``autopilot/trial_kept`` of each trial, at step = trial index, when the trial is decided."""
        if not record.index or record.reason.startswith(("not applicable", "not trialled")):
            return
        metrics = {"autopilot/trial_kept": 1.0 if record.kept else 0.0}
        if record.ratio is not None:
            metrics["autopilot/trial_speedup"] = float(record.ratio)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.index)

    @staticmethod
    def _smells(run: Run, ctx: Any) -> list[str]:
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

    # ------------------------------------------------------------------ replay
    def _replay(self, run: Run, plan: AutopilotPlan) -> None:
        self.plan = AutopilotPlan(
            world_size=run.trainer.world_size,
            model=type(run.module).__name__,
            stopped=f"replayed {self.plan_path or 'the checkpoint'}",
            baseline_samples_per_sec=plan.baseline_samples_per_sec,
            final_samples_per_sec=plan.final_samples_per_sec,
            speedup=plan.speedup,
            speedup_low=plan.speedup_low,
            speedup_high=plan.speedup_high,
            speedup_source=plan.speedup_source,
            noise=plan.noise,
            trials=plan.trials,
        )
        if plan.model and plan.model != type(run.module).__name__:
            rank_zero_warn(
                f"Autopilot: the plan was made for {plan.model}, this run trains "
                f"{type(run.module).__name__}; replaying it anyway"
            )
        extras = {e.name: e for e in self.extra}
        for entry in plan.kept:
            name, params = entry["name"], dict(entry.get("params", {}))
            if name in INTERVENTIONS:
                candidate = INTERVENTIONS[name](**params)
            elif name in extras:
                candidate = extras[name]
                candidate.params = params
            else:
                raise ValueError(
                    f"Autopilot(plan={str(self.plan_path)!r}): unknown change {name!r}; built-in changes "
                    f"are {sorted(INTERVENTIONS)} (pass your own with interventions=[...])"
                )
            record = TrialRecord(
                len(self.records),
                name,
                candidate.describe(run),
                entry.get("samples_per_sec"),
                None,
                False,
                "replayed from the plan",
            )
            self.records.append(record)
            if self._frozen(candidate):
                record.reason = "not replayed: frozen by Autopilot(freeze=...)"
                continue
            why = candidate.unavailable(run)
            if why is not None:
                record.reason = f"not replayed: {why}"
                rank_zero_warn(f"Autopilot: plan entry {name} does not apply to this run ({why}); skipped")
                continue
            try:
                candidate.apply(run)
            except Exception as err:  # noqa: BLE001
                record.reason = f"not replayed: {type(err).__name__}: {_short(err)}"
                try:
                    candidate.revert(run)
                except Exception:  # noqa: BLE001
                    pass
                rank_zero_warn(f"Autopilot: replaying {name} failed ({err!r}); skipped")
                continue
            record.kept = True
            record.change = candidate.describe(run)
            self.kept.append(candidate)
        run.runner.state.restore()

    # ------------------------------------------------------------------ result
    def _install(self, run: Run) -> None:
        trainer = run.trainer
        run.source.install()
        trainer.accumulate_grad_batches = run.config.accumulate
        if run.config.prefetch:
            from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

            self._prefetcher = DevicePrefetcher(depth=run.config.prefetch_depth)
            self._prefetcher.setup(trainer, run.module, "fit")
        self._validation_loader(run)

    def _validation_loader(self, run: Run) -> None:
        """The kept loader settings (workers, prefetch, pinned memory) also for the validation DataLoader, when it
        delivers the same batches with them; how often the user validates is never changed."""
        from lightning_accel.callbacks._fit.loader_source import VALIDATION_KEYS, apply_to_validation_loader

        source = run.source
        changed = {k: v for k, v in source.current().items() if k in VALIDATION_KEYS and source.initial.get(k) != v}
        if not changed:
            return
        try:
            note = apply_to_validation_loader(run.trainer, changed)
        except Exception as err:  # noqa: BLE001 - validation stays as the user built it
            note = f"validation DataLoader left alone: {type(err).__name__}: {_short(err)}"
        self.notes.append(note)

    def _finish(self, run: Run) -> None:
        plan = self.plan
        assert plan is not None
        yaml: list[tuple[str, Any]] = []
        python: list[str] = []
        for candidate in self.kept:
            y, p = candidate.config(run)
            yaml.extend(y)
            python.extend(p)
        self.yaml = render_yaml(yaml)
        self.python = render_python(python)
        plan.kept = [{"name": c.name, "params": _jsonable(c.params), "change": c.describe(run)} for c in self.kept]
        if not plan.trials or not plan.stopped or not plan.stopped.startswith("replayed"):
            plan.trials = [r.to_dict() for r in self.records]
        plan.yaml, plan.python = self.yaml, self.python
        trainer = run.trainer
        if plan.baseline_samples_per_sec and plan.final_samples_per_sec:
            metrics = {
                "autopilot/baseline_samples_per_sec": plan.baseline_samples_per_sec,
                "autopilot/final_samples_per_sec": plan.final_samples_per_sec,
                "autopilot/speedup": plan.speedup if plan.speedup is not None and self.kept else 1.0,
                "autopilot/trials": float(
                    sum(
                        1
                        for r in self.records[1:]
                        if r.samples_per_sec is not None or r.reason.startswith(("could not", "failed"))
                    )
                ),
                "autopilot/kept": float(len(self.kept)),
                "autopilot/noise": float(plan.noise or 0.0),
                "autopilot/search_seconds": float(plan.search_seconds or 0.0),
            }
            if plan.speedup_low is not None and plan.speedup_high is not None and self.kept:
                metrics["autopilot/speedup_low"] = plan.speedup_low
                metrics["autopilot/speedup_high"] = plan.speedup_high
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        path = self._plan_path(trainer)
        if path is not None and trainer.is_global_zero:
            plan.save(path)
            if self.yaml:
                atomic_write_text(path.with_suffix(".yaml"), self.yaml)
        summary = (
            f"Autopilot: kept {len(self.kept)} change(s)"
            + (_claim_text(plan) if self.kept and plan.speedup is not None else "")
            + (f" ({plan.stopped})" if plan.stopped else "")
        )
        rank_zero_info(summary)
        for note in self.notes:
            rank_zero_info(f"Autopilot: {note}")
        if self.print_summary and trainer.is_global_zero and self.records:
            from rich.console import Console

            console = Console()
            console = Console(width=max(console.width, 130))
            console.print(self.table())
            if self.yaml:
                console.print("[bold]Autopilot configuration[/bold] (LightningCLI YAML):", markup=True)
                console.print(self.yaml, markup=False, highlight=False)
            if self.python:
                console.print("[bold]Autopilot configuration[/bold] (Python):", markup=True)
                console.print(self.python, markup=False, highlight=False)
            if path is not None:
                console.print(
                    f"Plan: {path}  (replay without searching: Autopilot(plan={str(path)!r}))",
                    markup=False,
                    highlight=False,
                )

    def _plan_path(self, trainer: pl.Trainer) -> Path | None:
        if self.save_plan is False:
            return None
        if self.save_plan is None or self.save_plan is True:
            return Path(trainer.default_root_dir) / "autopilot_plan.json"
        return Path(self.save_plan)

    def table(self) -> Any:
        """The rich table of the trials (also printed after the search)."""
        from rich.table import Table

        plan = self.plan
        title = "Autopilot (rank 0): global samples/s, each change trialled against the configuration before it"
        if plan is not None and plan.stopped:
            title += f"; stopped: {plan.stopped}"
        table = Table(title=title, header_style="bold")
        for col, justify in (
            ("trial", "right"),
            ("change", "left"),
            ("samples/s", "right"),
            ("× baseline", "right"),
            ("kept", "center"),
            ("reason", "left"),
        ):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for r in self.records:
            table.add_row(
                str(r.index),
                r.change if r.index else "baseline (as configured)",
                f"{r.samples_per_sec:,.1f}" if r.samples_per_sec else "—",
                f"{r.vs_baseline:.2f}" if r.vs_baseline else "—",
                "✓" if r.kept and r.index else ("" if r.index else "·"),
                r.reason,
            )
        return table


def _short(err: BaseException | None, chars: int = 240) -> str:
    from lightning_accel.callbacks._autopilot_backend import short_error

    return short_error(err, chars)


def _is_terminal() -> bool:
    import sys

    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _claim_text(plan: AutopilotPlan) -> str:
    """The claimed speed-up as the summary line says it, with how it was measured."""
    assert plan.speedup is not None
    if plan.speedup_source == "trials":
        return f", {plan.speedup:.2f}x the untouched configuration (product of the kept trials' paired ratios)"
    interval = (
        f", 90 % interval {plan.speedup_low:.2f}-{plan.speedup_high:.2f}"
        if plan.speedup_low is not None and plan.speedup_high is not None
        else ""
    )
    return f", {plan.speedup:.2f}x the untouched configuration (final paired A/B{interval})"
