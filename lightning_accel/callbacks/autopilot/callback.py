"""Autopilot: the method's loop run automatically on the user's own run — measure, apply the fix for the slowest
stage, measure again, keep only proven gains (with a numerics check), hand back the configuration."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks.autopilot.arguments import check_numbers, fix_names, own_fixes, tolerances_by_kind
from lightning_accel.callbacks.autopilot.backend import short_error
from lightning_accel.callbacks.autopilot.fit_run import install, make_run, run_identity, unsupported
from lightning_accel.callbacks.autopilot.fixes import INTERVENTIONS, Intervention, Run
from lightning_accel.callbacks.autopilot.output import finish, trials_table
from lightning_accel.callbacks.autopilot.replay import replay
from lightning_accel.core.autopilot import (
    AutopilotPlan,
    Outcome,
    Tolerance,
    TrialRecord,
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
    dataloader) it runs :class:`~lightning_accel.core.autopilot.AutopilotSearch` (the loop, in the core) on this
    fit's Lightning backend (``callbacks/autopilot/backend.py``): a pay-back estimate, a baseline with its A/A noise,
    then the fixes the diagnosis names, each applied, checked by the numerics guard and measured in paired windows
    (A B, A B B A), kept only when faster beyond the noise; small gains are confirmed together; a kept set is measured
    once more against the untouched run, and that paired ratio is the claimed speed-up. The docs' Autopilot page
    explains each step, the fixes and the guarantees.

    **Trial steps are undone**: parameters, gradients, buffers, optimizer, scheduler and precision state and every
    RNG are restored bit for bit, so the training that follows is the run the user would have had with the chosen
    settings from the start, and ``global_step`` and the logs do not count the trials. Under DDP every rank runs the
    same trials in lockstep and applies the identical decision. A fix that raises is undone, reported and skipped;
    the search itself never stops the training.

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
        check_numbers(
            budget=budget,
            budget_seconds=budget_seconds,
            threshold=threshold,
            steps={
                "warmup_steps": (warmup_steps, 1),
                "measure_steps": (measure_steps, 2),
                "probe_steps": (probe_steps, 1),
                "patience": (patience, 1),
            },
        )
        freeze, only = fix_names(freeze, only)
        self.extra = own_fixes(interventions)
        self.tolerances = tolerances_by_kind(tolerances)
        self.plan_path = Path(plan) if plan is not None else None
        if self.plan_path is not None:
            AutopilotPlan.load(self.plan_path)  # a bad plan fails here, before any training
        self.budget, self.budget_seconds, self.threshold = float(budget), budget_seconds, float(threshold)
        self.warmup_steps, self.measure_steps, self.probe_steps = warmup_steps, measure_steps, probe_steps
        self.patience = patience
        self.freeze = freeze
        self.only = only
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
        reason = unsupported(trainer)
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
        run = make_run(trainer, pl_module, source, warmup_steps=self.warmup_steps)
        if self.plan_path is not None or self._restored_plan is not None:
            plan = (
                AutopilotPlan(**self._restored_plan)
                if self._restored_plan is not None and self.plan_path is None
                else AutopilotPlan.load(self.plan_path)  # type: ignore[arg-type]
            )
            self.plan, records, kept = replay(
                run, plan, own=self.extra, frozen=self._frozen, plan_path=self.plan_path, first_index=len(self.records)
            )
            self.records.extend(records)
            self.kept.extend(kept)
        else:
            try:
                self._search(run)
            except Exception as err:  # noqa: BLE001 - the search must not cost the user the training
                note = (
                    f"the search stopped on {type(err).__name__}: {short_error(err)}; training with the "
                    f"{len(self.kept)} change(s) kept before it"
                )
                self.notes.append(note)
                rank_zero_warn(f"Autopilot: {note}")
                if self.plan is not None:
                    self.plan.stopped = note
            self._checkpoint_trial(run)
        self._install(run)
        assert self.plan is not None
        self.yaml, self.python = finish(
            run,
            self.plan,
            kept=self.kept,
            records=self.records,
            notes=self.notes,
            path=self._plan_path(trainer),
            print_summary=self.print_summary,
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if self._prefetcher is not None:
            self._prefetcher.teardown(trainer, pl_module, stage)
            self._prefetcher = None

    def _candidates(self, run: Run) -> dict[str, Intervention]:
        names = self.only if self.only is not None else list(INTERVENTIONS)
        out = {name: INTERVENTIONS[name]() for name in names}
        for extra in self.extra:
            out[extra.name] = extra
        return out

    def _frozen(self, candidate: Intervention) -> bool:
        return candidate.name in self.freeze or any(k in self.freeze for k in candidate.knobs)

    # ------------------------------------------------------------------ the search
    def _search(self, run: Run) -> None:
        """The core loop (:class:`~lightning_accel.core.autopilot.AutopilotSearch`) on this fit's backend."""
        from lightning_accel.callbacks.autopilot.backend import BackendConfig, LightningSearchBackend
        from lightning_accel.callbacks.autopilot.display import SearchDisplay
        from lightning_accel.core.autopilot import AutopilotSearch

        trainer = run.trainer
        plan = AutopilotPlan(model=type(run.module).__name__, **run_identity(run))
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
        config = BackendConfig(
            fixes=self._candidates(run),
            own=frozenset(e.name for e in self.extra),
            freeze=frozenset(self.freeze),
            tolerances=self.tolerances,
            probe_steps=self.probe_steps,
            threshold=self.threshold,
            notes=self.notes,
        )
        search = AutopilotSearch(
            LightningSearchBackend(config, run),
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
        started = time.perf_counter()
        try:
            search.run()
        finally:
            display.close()
            result = search.result
            self.records, self.kept = result.records, [c.fix for c in result.kept]
            self.notes.extend(result.notes)
            result.fill(plan)
            plan.search_seconds = time.perf_counter() - started
            self._step_seconds = result.step_seconds

    def _checkpoint_trial(self, run: Run) -> None:
        """The fix outside the step (``callbacks/autopilot/checkpoint_trial.py``): checkpoints written in a background
        thread, trialled after the step search on a fit whose saves cost enough, kept only when measured faster."""
        from lightning_accel.callbacks.autopilot.checkpoint_trial import trial_async_checkpoint
        from lightning_accel.callbacks.autopilot.display import format_row
        from lightning_accel.core.autopilot import noise_gate

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
        if record is not None:
            self.records.append(record)
            self.kept.extend([candidate] * record.kept)
            self._log_trial(run.trainer, record)
            if self.print_summary and run.trainer.is_global_zero:
                print(format_row(record), flush=True)

    def _log_trial(self, trainer: pl.Trainer, record: TrialRecord) -> None:
        """``autopilot/trial_speedup`` (paired ratio against the configuration it was trialled against) and
        ``autopilot/trial_kept`` of each trial, at step = trial index, when the trial is decided."""
        if not record.index or not Outcome(record.outcome).logged:
            return
        metrics = {"autopilot/trial_kept": 1.0 if record.kept else 0.0}
        if record.ratio is not None:
            metrics["autopilot/trial_speedup"] = float(record.ratio)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.index)

    # ------------------------------------------------------------------ result
    def _install(self, run: Run) -> None:
        self._prefetcher, note = install(run)
        if note is not None:
            self.notes.append(note)

    def _plan_path(self, trainer: pl.Trainer) -> Path | None:
        if self.save_plan is False:
            return None
        if self.save_plan is None or self.save_plan is True:
            return Path(trainer.default_root_dir) / "autopilot_plan.json"
        return Path(self.save_plan)

    def table(self) -> Any:
        """The rich table of the trials (also printed after the search)."""
        return trials_table(self.records, self.plan)


def _is_terminal() -> bool:
    import sys

    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())
