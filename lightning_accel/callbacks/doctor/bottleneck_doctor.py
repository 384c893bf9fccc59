"""BottleneckDoctor: which stage of the training step holds the run back, and the change that fixes it. The callback
keeps Lightning's hooks and hands the moments of the step to its measuring object (``doctor/measure.py``); see
``docs/measuring/doctor.md``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._checks import check_int
from lightning_accel.callbacks._fit.trainer_state import gather_floats, rank_zero_print
from lightning_accel.callbacks._fit.window_metrics import log_window
from lightning_accel.callbacks.doctor.facts import precision_stats as _precision_stats
from lightning_accel.callbacks.doctor.facts import read_dataloader_settings, static_context
from lightning_accel.callbacks.doctor.live_log import LiveLog
from lightning_accel.callbacks.doctor.live_warnings import LiveWarnings, warn_smell
from lightning_accel.callbacks.doctor.measure import DoctorMeasure, Gather
from lightning_accel.callbacks.doctor.report import run_identity, window_log_file, write_report_files
from lightning_accel.callbacks.doctor.timers import (
    install_checkpoint_timer,
    install_comm_timer,
    install_instance_wrapper,
    install_optimizer_hooks,
    wrap_strategy_comm_hook,
)
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import RunContext, Thresholds
from lightning_accel.core.verdict import place_finding
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BottleneckDoctor"]


class BottleneckDoctor(Callback):
    """Splits every training step into stages, finds the one that holds the run back, and names the fix.

    The stages (``data``, ``transfer``, ``forward``, ``backward``, ``optimizer``, ``communication``, ``other``) are
    timed from Lightning's hooks, aggregated over windows of ``window`` batches and over ranks (one ``all_gather``
    per window, no device synchronisation per step), and turned into findings by the rules of
    :mod:`lightning_accel.core.rules`: warned on rank 0 while the fit runs, logged as ``doctor/*`` keys, and reported
    at the end of ``fit`` in :attr:`report` (a :class:`~lightning_accel.core.report.DoctorReport`), a printed table
    and the files at ``report_path``. The doctor's page (``docs/measuring/doctor.md``) says how each stage, view
    and key is measured. The measuring itself is :class:`~lightning_accel.callbacks.doctor.measure.DoctorMeasure`.

    Args:
        window: batches per measuring window (logging and warning interval). Closing a window costs ~0.25 ms on a
            CPU (the rules, one logging call for all keys, a CPU sample; plus one gather under DDP); 50 batches
            amortise that to ~10 µs per step (measured by benchmarks/bench_doctor_overhead.py).
        warmup_batches: batches at the start of ``fit`` that are not measured (more if another callback asks with a
            ``warmup_batches`` attribute, as ``MFUMonitor`` does). On CUDA the SDPA kernel is observed on the
            second batch when at least two are warm-up.
        thresholds: a :class:`~lightning_accel.core.rules.Thresholds` or a dict of its fields
            (e.g. ``{"data_share": 0.2}``); defaults documented there.
        report_path: where the JSON report goes; ``None`` → ``bottleneck_report.json`` in the logger's ``log_dir``
            (``trainer.log_dir``), or ``trainer.default_root_dir`` without a logger; ``False`` → no files. A path
            ending in ``.html`` writes the self-contained HTML page there (plots inline; needs matplotlib) and the
            JSON beside it (``lightning-accel report RUN.json --html OUT.html`` makes the same page later).
        plot: also write ``<report_path stem>.png`` (needs matplotlib; skipped with a note if missing).
        warn: warn findings during training (rank 0). A new finding also asks a ``ProfileWindow`` among the
            callbacks (if any) for a ``torch.profiler`` trace of the next steps.
        warn_interval_s: the least time between two warnings of the same rule.
        log_metrics: log the keys above.
        print_report: print the report table at the end of ``fit`` (rank 0).
        utilisation: sample CPU (psutil) and GPU (NVML, when installed and a GPU is used) utilisation per window.
        smells: look for code smells at the start of training (a fraction of a second: the optimizer preview and
            the loading of one batch are timed).
        nvtx: emit the stages (data, transfer, forward, backward, optimizer, and each bucket's communication) as
            NVTX ranges in the ``lightning_accel`` domain, for an ``nsys`` timeline (see ``core/nvtx.py``).
        window_log: the live log ``lightning-accel watch`` follows (rank 0, one JSON line per window: stage
            shares, step time, throughput, MFU, the window's findings); ``None`` → beside the report as
            ``<report stem>.windows.jsonl`` (none when ``report_path=False``); ``False`` → none.
        attribute_compute: profile a short window and attribute forward and backward time to the modules of the
            model, with compute findings that name the module and the fix (``report.attribution``; see "Inside
            the compute" in the doctor's docs page). ``None``: when a measured window finds forward + backward at
            or above ``thresholds.compute_share`` (once per fit, if the fit has the batches left); ``True``: right
            after the warm-up; ``False``: only on :meth:`request_attribution`. The window's batches are left out
            of the stage breakdown; outside it no module hook or profiler is present.
        attribution_steps: steps the window records (after one unrecorded warm-up step of the profiler).
    """

    def __init__(
        self,
        *,
        window: int = 50,
        warmup_batches: int = 3,
        thresholds: Thresholds | Mapping[str, float] | None = None,
        report_path: str | Path | None | bool = None,
        plot: bool = True,
        warn: bool = True,
        warn_interval_s: float = 60.0,
        log_metrics: bool = True,
        print_report: bool = True,
        utilisation: bool = True,
        smells: bool = True,
        nvtx: bool = False,
        window_log: str | Path | bool | None = None,
        attribute_compute: bool | None = None,
        attribution_steps: int = 3,
    ) -> None:
        check_int("BottleneckDoctor", "window", window, unit="batches", example=20)
        check_int("BottleneckDoctor", "warmup_batches", warmup_batches, minimum=0, unit="batches", example=3)
        check_int("BottleneckDoctor", "attribution_steps", attribution_steps, unit="steps", example=3)
        if attribute_compute not in (None, True, False):
            raise ValueError(
                f"BottleneckDoctor(attribute_compute={attribute_compute!r}): use None (when compute-bound), True "
                "(right after the warm-up) or False (only on request_attribution())"
            )
        self.attribute_compute = attribute_compute
        self.attribution_steps = attribution_steps
        self.thresholds = _thresholds(thresholds)
        _check_path("report_path", report_path, "<default_root_dir>/bottleneck_report.json", "no files")
        if (
            not isinstance(warn_interval_s, (int, float))
            or isinstance(warn_interval_s, bool)
            or math.isnan(warn_interval_s)
            or warn_interval_s < 0
        ):
            raise ValueError(f"BottleneckDoctor(warn_interval_s={warn_interval_s!r}): use seconds >= 0, e.g. 60")
        self.window = window
        # Private on purpose: a public ``warmup_batches`` attribute asks MFUMonitor to skip more batches, and the
        # doctor does not disturb the batches it leaves out.
        self._warmup_batches = warmup_batches
        self.report_path = report_path
        self.plot = plot
        self.warn = warn
        self.warn_interval_s = float(warn_interval_s)
        self.log_metrics = log_metrics
        self.print_report = print_report
        self.utilisation = utilisation
        self.smells = smells
        if not isinstance(nvtx, bool):
            raise ValueError(f"BottleneckDoctor(nvtx={nvtx!r}): use True to emit the stages as NVTX ranges, or False")
        self.nvtx = nvtx
        _check_path("window_log", window_log, "<report path stem>.windows.jsonl beside the report", "none")
        self.window_log = window_log
        #: the window log of the current or last fit (rank 0), for ``lightning-accel watch``
        self.window_log_path: Path | None = None
        self.report: DoctorReport | None = None
        #: files written at the end of the last fit (JSON, PNG)
        self.files: list[Path] = []
        self._comm_unwrap: Callable[[], None] | None = None  # takes the timing wrapper off the strategy's hook
        self._restore: list[Callable[[], None]] = []  # the timers' undo, in installation order
        self._warnings = LiveWarnings()
        self._live_log = LiveLog()
        self._measure = self._new_measure(None)

    def _new_measure(self, previous: DoctorMeasure | None) -> DoctorMeasure:
        """A fit's measuring object; the fit's clock and the all-reduce recorder are set up before it (``setup``)."""
        return DoctorMeasure(
            window=self.window,
            thresholds=self.thresholds,
            attribute_compute=self.attribute_compute,
            attribution_steps=self.attribution_steps,
            smells=self.smells,
            nvtx=self.nvtx,
            fit_clock=None if previous is None else previous.fit_clock,
            comm=None if previous is None else previous.comm,
            live_log=self._live_log,
        )

    def _gather(self, trainer: pl.Trainer, what: str) -> Gather | None:
        """The one collective of a window: every rank's row, ``None`` in one process."""
        if trainer.world_size <= 1:
            return None
        return lambda row: gather_floats(trainer, self._measure.device, row, what=what).tolist()

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls callbacks' setup() before strategy.setup(), where the lightning-accel DDP strategies
        # register their comm hook: add the timing wrapper to their wrapper list now.
        if stage != "fit":
            return
        self._measure.setup_fit()
        wrapped = wrap_strategy_comm_hook(trainer.strategy)
        if wrapped is not None:
            self._measure.comm, self._comm_unwrap = wrapped

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure = m = self._new_measure(self._measure)
        self._warnings, self._restore = LiveWarnings(), []
        self.report, self.files = None, []
        self._open_window_log(trainer)
        device = trainer.strategy.root_device
        extra = [getattr(cb, "warmup_batches", 0) for cb in trainer.callbacks if cb is not self]
        from lightning_accel.callbacks.mfu_monitor import MFUMonitor

        try:
            context = static_context(trainer, device)
        except Exception as err:  # noqa: BLE001 - rules that need the missing facts are skipped
            context = RunContext(device_type=device.type, world_size=trainer.world_size)
            m.notes.append(f"run facts incomplete: {err!r}")
        m.start_fit(
            pl_module,
            device=device,
            skip=max([self._warmup_batches, *[int(x) for x in extra if isinstance(x, int)]]),
            context=context,
            manual=not pl_module.automatic_optimization,
            utilisation=self.utilisation,
            mfu_monitor=next((cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)), None),
            timers=lambda: self._install_timers(trainer),
        )

    def _install_timers(self, trainer: pl.Trainer) -> None:
        m = self._measure
        self._restore.append(
            install_instance_wrapper(trainer.strategy, "batch_to_device", m.transfer_begin, m.transfer_end)
        )
        self._restore.extend(
            install_optimizer_hooks(trainer.optimizers, m.before_optimizer_step_hook, m.after_optimizer_step)
        )
        self._restore.extend(install_checkpoint_timer(trainer, m.checkpoint_begin, m.checkpoint_end))
        # The validation loop builds its iterator (worker start-up) and switches the module to eval before
        # on_validation_start: timed from the loop's own entry, that time is validation's, not the next batch's
        # data wait.
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        self._restore.append(
            install_instance_wrapper(
                val_loop,
                "run",
                lambda: trainer.state.fn == "fit" and m.validation_begin(trainer.sanity_checking),
                m.validation_end,
            )
        )
        if m.comm is None and trainer.world_size > 1:
            m.comm = install_comm_timer(trainer, m.device.type == "cuda", m.notes)
        if m.comm is not None:
            m.comm.ranges = m.nvtx_ranges()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if stage == "fit":
            self._live_log.end("finished", self.files)  # still open only when no report was built
        self._measure.attribution.abort(self._measure.machine)
        self._uninstall()

    def _uninstall(self) -> None:
        for restore in reversed(self._restore):
            try:
                restore()
            except Exception:  # noqa: BLE001 - best effort: the objects may be gone already
                pass
        self._restore = []
        if self._comm_unwrap is not None:
            self._comm_unwrap, unwrap = None, self._comm_unwrap
            unwrap()
        self._measure.close_probe()

    # ------------------------------------------------------------------ the training loop
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        m = self._measure
        loader = None
        try:
            loader = read_dataloader_settings(trainer.train_dataloader, m.context)
        except Exception:  # noqa: BLE001 - an unusual loader: the data rule gives the generic fix
            pass
        if self.smells:
            try:
                m.smells.find(trainer, pl_module, loader, m.context)
            except Exception as err:  # noqa: BLE001 - smells are advice: never stop training for them
                m.notes.append(f"code smells not checked: {err!r}")
        m.train_start()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure.epoch_start()
        self._measure.open_data_wait()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._measure.batch_start(pl_module)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._measure.zero_grad()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._measure.backward_start()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure.backward_end(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._measure.optimizer_step_start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        due = self._measure.batch_end(batch)
        if due == "attribution":
            self._finish_attribution(trainer)
        elif due == "window":
            self._close_window(trainer, pl_module, log=self.log_metrics)
        self._measure.next_batch(lambda: _remaining_batches(trainer))

    def _close_window(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, log: bool, final: bool = False
    ) -> None:
        """Close the window on every rank (one collective), then log and warn what it found."""
        m = self._measure
        closed = m.close_window(self._gather(trainer, "BottleneckDoctor window"), final=final, live=self.warn)
        if closed is None:
            return
        try:
            if log:
                log_window(trainer, pl_module, closed.metrics)
            if self.warn:
                for finding in closed.smells:
                    warn_smell(trainer, finding)
                self._warnings.warn(trainer, closed.findings or [], m.clock(), self.warn_interval_s)
        except Exception as err:  # noqa: BLE001
            m.stop(f"aggregating a window: {err!r}")

    # ------------------------------------------------------------------ compute attribution
    def request_attribution(self, reason: str = "requested") -> bool:
        """Profile the attribution window from the next training batch (once per fit; call it on every rank, at
        the same batch). Returns ``False`` when one ran or is under way, or the model is compiled."""
        return self._measure.attribution.request(reason)

    def _finish_attribution(self, trainer: pl.Trainer) -> None:
        """The window's last batch ended (every rank): read it, gather the ranks' module times, warn its findings."""
        m = self._measure
        gather = self._gather(trainer, "BottleneckDoctor attribution")
        findings = m.finish_attribution(gather, findings=self.warn and trainer.is_global_zero)
        try:
            for finding in findings:
                rank_zero_warn(
                    f"BottleneckDoctor: compute: {finding.evidence} Fix: {finding.fix}", category=UserWarning
                )
        except Exception as err:  # noqa: BLE001 - advice only
            m.notes.append(f"compute findings not read: {err!r}")

    # ------------------------------------------------------------------ the live window log
    def _open_window_log(self, trainer: pl.Trainer) -> None:
        self._live_log.end(None, [])
        path = window_log_file(trainer, self.window_log, self.report_path) if trainer.is_global_zero else None
        if path is not None and self._live_log.start(path, world_size=trainer.world_size, window=self.window):
            self.window_log_path = path

    # ------------------------------------------------------------------ pauses
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._measure.validation_start(trainer.sanity_checking)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._measure.validation_stop()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure.epoch_end()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._live_log.end(f"failed: {type(exception).__name__}: {exception}", self.files)
        self._measure.abort()
        self._uninstall()

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        m = self._measure
        if m.attribution.held:  # the fit ended inside the window: read what it recorded (every rank is here)
            self._finish_attribution(trainer)
        if m.measuring and m.window_count > 0:
            self._close_window(trainer, pl_module, log=False, final=True)
        elif m.machine is not None:
            m.machine.cancel()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        m = self._measure
        m.fit_clock.stop()
        try:
            self.report = m.report(world_size=trainer.world_size, precision=_precision_stats(trainer))
            try:
                self.report.run = run_identity(trainer)
            except Exception:  # noqa: BLE001 - an unusual logger: the page keeps its generic title
                pass
        except Exception as err:  # noqa: BLE001 - a report problem must not fail a finished fit
            warnings.warn(f"BottleneckDoctor: could not build the report ({err!r})", stacklevel=2)
            return
        bubble = getattr(trainer.strategy, "bubble_finding", None)  # pp / pp_ddp: the pipeline bubble per rank
        if callable(bubble):
            finding = bubble(skip=min(m.skip, max(0, m.batches_seen - 1)))
            if finding is not None:
                place_finding(self.report, finding)
        if not trainer.is_global_zero:
            return
        if self.print_report:
            rank_zero_print(trainer, self.report.table())
        if self.report_path is not False:
            write_report_files(trainer, self.report, self.report_path, plot=self.plot, files=self.files)
        self._live_log.end("finished", self.files)


def _thresholds(thresholds: Thresholds | Mapping[str, float] | None) -> Thresholds:
    if thresholds is None:
        return Thresholds()
    if isinstance(thresholds, Thresholds):
        return thresholds
    if isinstance(thresholds, Mapping):
        try:
            return Thresholds.from_kwargs(**thresholds)
        except ValueError as err:
            raise ValueError(f"BottleneckDoctor(thresholds=...): {err}") from None
    raise ValueError(
        f"BottleneckDoctor(thresholds={thresholds!r}): pass a Thresholds or a dict such as {{'data_share': 0.2}}"
    )


def _check_path(name: str, value: Any, default: str, off: str) -> None:
    """A file argument: a path, ``None`` (the default place) or ``False`` (off)."""
    if value is True or (value is not None and value is not False and not isinstance(value, (str, Path))):
        raise ValueError(
            f"BottleneckDoctor({name}={value!r}): give a file path, None for {default}, or False for {off}"
        )


def _remaining_batches(trainer: pl.Trainer) -> int | None:
    """Training batches the fit has left (``max_steps``, else the epochs'), ``None`` when unknown."""
    try:
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return (trainer.max_steps - trainer.global_step) * accumulate
        per_epoch = trainer.num_training_batches
        if trainer.max_epochs is None or trainer.max_epochs < 0 or not math.isfinite(per_epoch):
            return None
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return int((trainer.max_epochs - trainer.current_epoch) * per_epoch - done)
    except Exception:  # noqa: BLE001 - an unusual loop: the length is unknown
        return None
