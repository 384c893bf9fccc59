"""BottleneckDoctor: which stage of the training step holds the run back, and the change that fixes it."""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._checks import check_int
from lightning_accel.attention import SDPABackendRecorder
from lightning_accel.callbacks._fit.trainer_state import gather_floats, rank_zero_print
from lightning_accel.callbacks._fit.window_metrics import log_window
from lightning_accel.callbacks.doctor.attribution import DoctorAttribution
from lightning_accel.callbacks.doctor.facts import precision_stats as _precision_stats
from lightning_accel.callbacks.doctor.facts import read_dataloader_settings, static_context
from lightning_accel.callbacks.doctor.live_warnings import LiveWarnings, warn_smell
from lightning_accel.callbacks.doctor.report import report_dir, run_identity, write_report_files
from lightning_accel.callbacks.doctor.smells import DoctorSmells
from lightning_accel.callbacks.doctor.timers import (
    install_checkpoint_timer,
    install_comm_timer,
    install_instance_wrapper,
    install_optimizer_hooks,
    wrap_strategy_comm_hook,
)
from lightning_accel.callbacks.doctor.utilisation import UtilisationSamplers
from lightning_accel.core.attribution import attribute
from lightning_accel.core.batch import samples_in_batch
from lightning_accel.core.comm import CommRecorder
from lightning_accel.core.compute_causes import find_compute_causes, nchw_convolutions
from lightning_accel.core.fit_windows import FitWindows, window_metrics
from lightning_accel.core.phases import FitClock
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import RunContext, Thresholds, diagnose
from lightning_accel.core.stages import StageMachine, StageWindow
from lightning_accel.core.verdict import build_report, place_finding
from lightning_accel.core.window_log import WINDOW_LOG_SUFFIX, WindowLogWriter
from lightning_accel.core.window_row import RankWindow
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BottleneckDoctor"]


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook body; a measuring problem warns once and stops the stage timing, never the training."""

    @functools.wraps(fn)
    def wrapper(self: BottleneckDoctor, *args: Any, **kwargs: Any) -> Any:
        if self._broken:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - measuring must never stop training
            self._break(f"{fn.__name__}: {err!r}")
            return None

    return wrapper


class BottleneckDoctor(Callback):
    """Splits every training step into stages, finds the one that holds the run back, and names the fix.

    Stages per batch (``lightning_accel.core.rules.STAGES``):

    =================  =========================================================================================
    stage              measured as
    =================  =========================================================================================
    ``data``           end of the previous ``on_train_batch_end`` → the batch is fetched (host clock; validation
                       and the epoch's end are not counted). It also holds what Lightning does between two batches
                       (its logging bookkeeping, callbacks after this one in ``on_train_batch_end``; under DDP the
                       per-batch SIGTERM broadcast, where a rank waits for slower ranks): well under 1 ms per batch
                       on an idle machine
    ``transfer``       the strategy's ``batch_to_device`` (your ``transfer_batch_to_device`` included); the doctor
                       wraps the strategy instance's public method for the duration of ``fit``
    ``forward``        ``on_train_batch_start`` → ``on_before_zero_grad``/``on_before_backward`` (in manual
                       optimization: all ``training_step`` code outside backward and optimizer steps)
    ``backward``       ``on_before_backward`` → ``on_after_backward``, minus ``communication``
    ``optimizer``      ``on_before_zero_grad`` → ``on_before_backward`` and ``on_before_optimizer_step`` → the
                       optimizer's step post-hook of the outermost ``step`` (``register_step_post_hook``)
    ``communication``  gradient all-reduce not hidden behind backward: from the launch of the last bucket (local
                       backward done) to the completion of every bucket (``lightning_accel.core.comm``), timed by
                       a DDP comm-hook wrapper; DDP only
    ``other``          the rest of the wall time (Lightning, logging, other callbacks)
    =================  =========================================================================================

    The stage logic is :class:`~lightning_accel.core.stages.StageMachine` (pure, driven by these hooks); the timer
    installers live in ``doctor.timers``, the run facts in ``doctor.facts``. On CUDA the device stages are CUDA
    events, read when a window closes (one synchronisation per window, none per step). Shares are aggregated over
    each window of ``window`` batches and over ranks (one ``all_gather`` per window). Rules
    (``lightning_accel.core.rules``) turn the shares, utilisation and run facts into findings: each
    names the stage, the evidence and the fix; they are warned on rank 0 during training (each once, again only if
    its fix changes or it comes back, at most every ``warn_interval_s``), and reported at the end of ``fit``: a rich
    table (rank 0), the JSON at ``report_path`` and a PNG of the stacked shares over time next to it (with the
    ``plots`` extra). After ``fit``, :attr:`report` (a :class:`~lightning_accel.core.report.DoctorReport`) has
    ``bottleneck``, ``shares`` and ``findings``: the step's, the fit's and the pipeline bubble reconciled into one
    list (:func:`~lightning_accel.core.verdict.build_report`: no two findings count the same seconds, e.g. a
    straggler's cost is not the network's too), each with the share of the fit its fix would save (``saving``),
    largest first. Beside the step breakdown:

    * **the whole fit** (``report.fit``, ``report.fit_findings``): wall time split into start-up (set-up and the
      warm-up batches: FLOP counting, compilation), training batches, validation (sanity check included),
      checkpoint saving (``trainer.save_checkpoint`` and ``strategy.remove_checkpoint``, wrapped for the duration
      of ``fit``) and the rest, with the
      ``validation_heavy`` / ``checkpoint_heavy`` findings (:mod:`lightning_accel.core.phases`); rank 0's clock;
    * **every rank** (``report.rank_shares``, ``report.rank_stage_seconds``): the ``straggler`` finding names a
      rank whose batch takes longer outside the all-reduce than the others', its stage and the fix; the others'
      communication wait is attributed to it (:mod:`lightning_accel.core.ranks`);
    * **variability** (``report.variability``, one entry per rank): p5/p50/p95 of the batch times, spikes and the
      ``step_variability`` finding with the likely cause (:mod:`lightning_accel.core.variability`);
    * **inside the compute** (``report.attribution``): when forward + backward hold the step, a short profiled
      window charges their time to the model's modules, with the costliest operations and their shapes, and the
      compute findings name the module and the fix (``kind="compute"``; ``attribute_compute`` below;
      :mod:`lightning_accel.core.attribution`, :mod:`lightning_accel.core.compute_causes`);
    * **code smells** (``report.smells``): found at ``on_train_start`` before the first step by
      :func:`~lightning_accel.core.smells.find_smells` and warned once each (rank 0) when the first window says
      what fixing it would save: below 3 % of the step (:func:`~lightning_accel.core.smells.gate_smells`) it is
      listed in the report only.

    One collective per window: the gather of every rank's row, at the same batch count on every rank (counted even
    on a rank whose measuring broke: it sends a row of NaN, which the aggregate leaves out). Nothing else is
    collective (the report, ``log_dir`` and the smells are rank-local), so a rank that dies mid-window makes the
    others fail at the process group's timeout, in this gather or in the next gradient all-reduce, exactly as
    without the doctor; the doctor adds no wait of its own.

    Logged when a window closes, to every logger and ``trainer.callback_metrics`` as ``pl_module.log(on_step=True)``
    would, in one call per window (``_fit.window_metrics.log_window``):

    ==========================================  =========  ====================================================
    key                                         unit       scope
    ==========================================  =========  ====================================================
    ``doctor/share_{stage}`` (7 keys)           fraction   share of step time; time-weighted over the window
                                                           and all ranks
    ``doctor/data_wait_pct``                    %          ``share_data`` × 100
    ``doctor/step_ms``                          ms         mean batch time per device, over ranks
    ``doctor/cpu_process_pct``                  % of core  training process CPU, mean over ranks
    ``doctor/cpu_workers_pct``                  % of core  DataLoader worker processes' CPU, mean over ranks
    ``doctor/gpu_util_pct``                     %          NVML GPU utilisation, mean over ranks (GPU + NVML)
    ``doctor/memory_peak_pct``                  %          peak allocated ÷ device capacity, max over ranks
                                                           (GPU)
    ==========================================  =========  ====================================================

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
        if thresholds is None:
            self.thresholds = Thresholds()
        elif isinstance(thresholds, Thresholds):
            self.thresholds = thresholds
        elif isinstance(thresholds, Mapping):
            try:
                self.thresholds = Thresholds.from_kwargs(**thresholds)
            except ValueError as err:
                raise ValueError(f"BottleneckDoctor(thresholds=...): {err}") from None
        else:
            raise ValueError(
                f"BottleneckDoctor(thresholds={thresholds!r}): pass a Thresholds or a dict such as "
                "{'data_share': 0.2}"
            )
        if report_path is True or (
            report_path is not None and report_path is not False and not isinstance(report_path, (str, Path))
        ):
            raise ValueError(
                f"BottleneckDoctor(report_path={report_path!r}): give a file path, None for "
                "<default_root_dir>/bottleneck_report.json, or False for no files"
            )
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
        if window_log is True or (
            window_log is not None and window_log is not False and not isinstance(window_log, (str, Path))
        ):
            raise ValueError(
                f"BottleneckDoctor(window_log={window_log!r}): give a file path, None for "
                "<report path stem>.windows.jsonl beside the report, or False for none"
            )
        self.window_log = window_log
        #: the window log of the current or last fit (rank 0), for ``lightning-accel watch``
        self.window_log_path: Path | None = None
        self._window_log: WindowLogWriter | None = None
        self.report: DoctorReport | None = None
        #: files written at the end of the last fit (JSON, PNG)
        self.files: list[Path] = []
        self._comm_unwrap: Callable[[], None] | None = None  # takes the timing wrapper off the strategy's hook
        self._comm: CommRecorder | None = None
        self._fit_clock = FitClock()
        self._reset_run_state()

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        self._broken = False
        self._machine: StageMachine | None = None
        self._clock: Callable[[], float] = time.perf_counter
        self._manual = False
        self._step_depth = 0
        self._windows = FitWindows()
        self._batches_seen = 0
        self._skip = self._warmup_batches
        self._measuring = False
        self._window_count = 0  # batches in the open window, counted on every rank even after a measuring problem
        self._samplers = UtilisationSamplers()
        self._device = torch.device("cpu")
        self._context = RunContext()
        self._notes: list[str] = []
        self._warnings = LiveWarnings()
        self._probe: SDPABackendRecorder | None = None
        self._probe_batch = 1
        self._restore: list[Callable[[], None]] = []
        self._mfu_monitor: Any = None
        self._smells = DoctorSmells(check_gradients=self.smells)
        self._epoch_paused = False
        self._ranges: Any = None
        self._nvtx_missing = False  # nvtx=True where no range can be emitted: warned once per fit
        self._comm_failure_noted = False
        self._in_validation = False
        self._validation_hooks_only = False
        self._attribution = DoctorAttribution(self.attribute_compute, self.attribution_steps, self._clock)
        self._last_shares: dict[str, float] = {}

    def _break(self, what: str) -> None:
        self._broken = True
        if self._machine is not None:
            self._machine.cancel()
        self._close_probe()
        note = f"stage timing stopped after a measuring problem ({what}); training went on"
        self._notes.append(note)
        warnings.warn(f"BottleneckDoctor: {note}. Please report it with the traceback of the error.", stacklevel=2)

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls callbacks' setup() before strategy.setup(), where the lightning-accel DDP strategies
        # register their comm hook: add the timing wrapper to their wrapper list now.
        if stage != "fit":
            return
        self._fit_clock = FitClock(self._clock)
        self._fit_clock.start()
        self._fit_clock.enter("startup")
        self._comm = None
        wrapped = wrap_strategy_comm_hook(trainer.strategy)
        if wrapped is not None:
            self._comm, self._comm_unwrap = wrapped

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run_state()
        self.report, self.files = None, []
        self._open_window_log(trainer)
        strategy = trainer.strategy
        self._device = strategy.root_device
        self._manual = not pl_module.automatic_optimization
        extra = [getattr(cb, "warmup_batches", 0) for cb in trainer.callbacks if cb is not self]
        self._skip = max([self._warmup_batches, *[int(x) for x in extra if isinstance(x, int)]])
        # The attention-kernel rule is a GPU rule: observe SDPA on CUDA only, on a warm-up batch (MFUMonitor counts
        # FLOPs with its own dispatch mode on batch 0).
        self._probe_batch = 1 if self._skip >= 2 and self._device.type == "cuda" else -1
        from lightning_accel.callbacks.mfu_monitor import MFUMonitor

        self._mfu_monitor = next((cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)), None)
        try:
            self._context = static_context(trainer, self._device)
        except Exception as err:  # noqa: BLE001 - rules that need the missing facts are skipped
            self._context = RunContext(device_type=self._device.type, world_size=trainer.world_size)
            self._notes.append(f"run facts incomplete: {err!r}")
        # read once, before the fit: a conversion the user makes later is not seen (the Autopilot re-reads it)
        self._context.nchw_convolutions = nchw_convolutions(pl_module)
        try:
            self._install_timers(trainer)
        except Exception as err:  # noqa: BLE001 - measuring must never stop training
            self._break(f"installing the timers: {err!r}")
        try:
            self._attribution.start_fit(pl_module)
        except Exception as err:  # noqa: BLE001 - diagnostics never stop training
            self._attribution.state = "off"
            self._notes.append(f"no compute attribution: {err!r}")
        if self.utilisation:
            self._samplers.create(self._device, self._notes)

    def _install_timers(self, trainer: pl.Trainer) -> None:
        self._restore.append(
            install_instance_wrapper(trainer.strategy, "batch_to_device", self._transfer_begin, self._transfer_end)
        )
        self._restore.extend(
            install_optimizer_hooks(trainer.optimizers, self._before_optimizer_step_hook, self._after_optimizer_step)
        )
        self._restore.extend(install_checkpoint_timer(trainer, self._checkpoint_begin, self._checkpoint_end))
        # The validation loop builds its iterator (worker start-up) and switches the module to eval before
        # on_validation_start: timed from the loop's own entry, that time is validation's, not the next batch's
        # data wait.
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        self._restore.append(
            install_instance_wrapper(val_loop, "run", lambda: self._validation_begin(trainer), self._validation_end)
        )
        if self._comm is None and trainer.world_size > 1:
            self._comm = install_comm_timer(trainer, self._device.type == "cuda", self._notes)
        if self._comm is not None:
            self._comm.ranges = self._nvtx_ranges()

    def _nvtx_ranges(self) -> Any:
        """The fit's NVTX emitter (``nvtx=True``), shared by the stage machine and the comm recorder; else None."""
        if not self.nvtx or self._nvtx_missing:
            return None
        if self._ranges is None:
            from lightning_accel.core.nvtx import StageRanges, nvtx_unavailable

            why = nvtx_unavailable()
            if why is not None:  # a diagnostics flag never takes the training down: say so once, run without
                self._nvtx_missing = True
                warnings.warn(
                    f"BottleneckDoctor(nvtx=True): no NVTX ranges: {why}. Training and measuring go on without them.",
                    stacklevel=2,
                )
                return None
            self._ranges = StageRanges()
        return self._ranges

    def _transfer_begin(self) -> bool:
        machine = self._machine
        if machine is None or self._broken or not machine.awaiting_batch:
            return False
        try:
            machine.stage_start("transfer")
        except Exception as err:  # noqa: BLE001
            self._break(f"batch_to_device: {err!r}")
            return False
        return True

    def _transfer_end(self, timed: bool) -> None:
        if timed and not self._broken and self._machine is not None:
            try:
                self._machine.stage_end("transfer")
            except Exception as err:  # noqa: BLE001
                self._break(f"batch_to_device: {err!r}")

    def _checkpoint_begin(self, save: bool) -> None:
        try:
            self._fit_clock.enter("checkpoint", count=save)
            if self._machine is not None and not self._broken:
                self._machine.pause()
        except Exception as err:  # noqa: BLE001
            self._break(f"save_checkpoint: {err!r}")

    def _checkpoint_end(self, _token: Any) -> None:
        try:
            if self._machine is not None and not self._broken:
                self._machine.resume()
            self._fit_clock.exit("checkpoint")
        except Exception as err:  # noqa: BLE001
            self._break(f"save_checkpoint: {err!r}")

    def _before_optimizer_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # An optimizer whose step() calls super().step() runs the step hooks once per hooked class in the chain
        # (torch wraps every Optimizer subclass's step the first time one is built): count the depth with the
        # pre-hook and end the stage when the outermost step returns.
        self._step_depth += 1

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_depth = max(0, self._step_depth - 1)
        machine = self._machine
        if self._step_depth > 0 or self._broken or machine is None or machine.stage != "optimizer":
            return
        try:
            if self._manual:
                machine.stage_start("forward")
            else:
                machine.stage_end()
        except Exception as err:  # noqa: BLE001
            self._break(f"optimizer step post-hook: {err!r}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if stage == "fit":
            self._close_window_log("finished")  # still open only when the report could not be built
        self._attribution.abort(self._machine)
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
        self._close_probe()

    # ------------------------------------------------------------------ the training loop
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = None
        try:
            loader = read_dataloader_settings(trainer.train_dataloader, self._context)
        except Exception:  # noqa: BLE001 - an unusual loader: the data rule gives the generic fix
            pass
        if self._context.num_workers == 0 or self._context.threaded_pipeline:
            self._samplers.skip_workers()
        if self.smells:
            try:
                self._smells.find(trainer, pl_module, loader, self._context)
            except Exception as err:  # noqa: BLE001 - smells are advice: never stop training for them
                self._notes.append(f"code smells not checked: {err!r}")
        self._machine = StageMachine(
            clock=self._clock, warmup_batches=self._skip, device=self._device, ranges=self._nvtx_ranges()
        )
        if self._skip == 0:
            self._start_measuring()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resume_after_epoch()
        self._open_data_wait()

    @_guarded
    def _resume_after_epoch(self) -> None:
        if self._epoch_paused and self._machine is not None:  # the gap between two epochs is not part of any batch
            self._epoch_paused = False
            self._machine.resume()

    @override
    @_guarded
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._machine is not None:
            self._machine.stage_start("forward")
        self._attribution.batch_start(pl_module, self._device.type)
        if self._batches_seen == self._probe_batch:
            self._probe = SDPABackendRecorder().__enter__()

    @override
    @_guarded
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._machine is not None:
            self._machine.stage_start("optimizer")
        self._attribution.mark(None)

    @override
    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._machine is not None:
            self._machine.stage_start("backward")
        self._attribution.mark("backward")

    @override
    @_guarded
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        machine = self._machine
        if machine is not None:
            if self._manual:
                machine.stage_start("forward")
            else:
                machine.stage_end()
        self._attribution.mark("forward" if self._manual else None)
        if self._comm is not None:
            self._comm.end_backward()
        if not self._smells.grads_checked:
            self._smells.check_unused_parameters(pl_module)

    @override
    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._machine is not None:
            self._machine.stage_start("optimizer")

    def _close_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            probe.__exit__(None, None, None)
            if probe.backend is not None:
                self._context.sdpa_backend = probe.backend

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Window accounting runs even after a measuring problem: every rank must join the same gathers.
        self._batches_seen += 1
        measured = self._measuring
        held = self._attribution.held  # a batch of the attribution window: in no stage window
        self._end_batch(batch, measured and not held)
        if held:
            if self._attribution.batch_end(self._batches_seen):
                self._finish_attribution(trainer)
        elif not measured:
            if self._batches_seen >= self._skip:
                self._start_measuring()
        else:
            self._window_count += 1
            if self._window_count >= self.window:
                self._close_window(trainer, pl_module, log=self.log_metrics)
        if self._measuring and not self._attribution.held:
            self._attribution.schedule(self._machine, self._batches_seen, _remaining_batches(trainer))
        self._open_data_wait()

    @_guarded
    def _end_batch(self, batch: Any, measured: bool) -> None:
        n = samples_in_batch(batch) if measured else 0
        if self._machine is not None:
            self._machine.step_end(samples=n)
        self._close_probe()
        if measured:
            self._windows.record_batch_size(n)

    @_guarded
    def _open_data_wait(self) -> None:
        if self._machine is not None:
            self._machine.batch_requested()

    def _start_measuring(self) -> None:
        self._measuring = True
        self._fit_clock.exit("startup")
        try:
            if self._comm is not None:
                self._comm.flush()
            self._samplers.start()
        except Exception as err:  # noqa: BLE001
            self._break(f"starting the first window: {err!r}")

    # ------------------------------------------------------------------ windows
    def _local_row(self, window: StageWindow | None) -> RankWindow:
        if self._broken or window is None or window.batches == 0:
            return RankWindow.unmeasured()
        try:
            comm, passes = self._comm.flush() if self._comm is not None else (0.0, 0)
            if self._comm is not None and self._comm.failed is not None and not self._comm_failure_noted:
                self._comm_failure_noted = True
                message = (
                    f"timing the all-reduce stopped ({self._comm.failed}): the all-reduces run untimed and "
                    "communication is not measured from here on"
                )
                self._notes.append(message)
                warnings.warn(f"BottleneckDoctor: {message}", stacklevel=2)
            return self._windows.local_row(window, comm, passes, self._samplers.sample, self._device)
        except Exception as err:  # noqa: BLE001
            self._break(f"closing a window: {err!r}")
            return RankWindow.unmeasured()

    def _close_window(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, log: bool, final: bool = False
    ) -> None:
        """Gather every rank's row (one collective), add the window, log, warn. Called on every rank.

        Windows tile the time: the next one starts where this one's wall time was read, so the cost of closing a
        window (gather, logging, rules) is counted, as ``other``, in the next window.
        """
        window = None
        machine = self._machine
        if machine is not None and not self._broken:
            try:
                window = machine.finish() if final else machine.close_window()
            except Exception as err:  # noqa: BLE001
                self._break(f"closing a window: {err!r}")
        row = self._local_row(window)
        # one process: no collective, and no tensor round trip (~50 µs of the flush)
        rows = (
            [row]
            if trainer.world_size <= 1
            else [
                RankWindow.from_floats(r)
                for r in gather_floats(trainer, self._device, row.to_floats(), what="BottleneckDoctor window").tolist()
            ]
        )
        self._window_count = 0
        try:
            self._after_gather(trainer, pl_module, rows, log=log)
        except Exception as err:  # noqa: BLE001
            self._break(f"aggregating a window: {err!r}")

    def _after_gather(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, rows: list[RankWindow], *, log: bool
    ) -> None:
        added = self._windows.add(rows)
        if added is None:
            return
        window, util = added
        self._last_shares = dict(window.shares)
        self._attribution.compute_bound(window.shares, self.thresholds.compute_share)
        if log:
            log_window(trainer, pl_module, window_metrics(window.shares, window.step_seconds, util))
        if self._smells.pending:
            for finding in self._smells.take_live(window.shares):
                if self.warn:
                    warn_smell(trainer, finding)
        if self.warn or self._window_log is not None:
            ranks = [r for r in window.per_rank_seconds if r is not None]
            context = self._live_context()
            diagnosis = diagnose(
                window.shares, context, self.thresholds, rank_seconds=ranks if len(ranks) > 1 else None
            )
            if self.warn:
                self._warnings.warn(trainer, diagnosis.findings, self._clock(), self.warn_interval_s)
            if self._window_log is not None:
                self._window_log.write(
                    "window",
                    batch=self._windows.breakdown.batches,
                    shares=window.shares,
                    step_ms=1e3 * window.step_seconds,
                    samples_per_sec=window.samples_per_sec,
                    mfu=context.mfu,
                    findings=[
                        {"stage": f.stage, "rule": f.rule, "evidence": f.evidence, "fix": f.fix, "value": f.value}
                        for f in diagnosis.findings
                    ],
                )

    # ------------------------------------------------------------------ compute attribution
    def request_attribution(self, reason: str = "requested") -> bool:
        """Profile the attribution window from the next training batch (once per fit; call it on every rank, at
        the same batch). Returns ``False`` when one ran or is under way, or the model is compiled."""
        return self._attribution.request(reason)

    def _finish_attribution(self, trainer: pl.Trainer) -> None:
        """The window's last batch ended (every rank): read it, gather the ranks' module times, warn its findings."""
        attr = self._attribution

        def gather(row: list[float]) -> list[list[float]]:
            if trainer.world_size <= 1:
                return [row]
            return gather_floats(trainer, self._device, row, what="BottleneckDoctor attribution").tolist()

        attr.finish(gather, self._machine, self._batches_seen)
        # the window's batches trained the model: the fit's training time (reading the events is not)
        self._windows.train_wall += attr.window_s
        if attr.table is None or not self.warn or not trainer.is_global_zero:
            return
        try:
            compute = self._last_shares.get("forward", 0.0) + self._last_shares.get("backward", 0.0)
            for finding in find_compute_causes(
                attr.table, context=self._context, compute_share=compute if self._last_shares else 1.0
            ):
                rank_zero_warn(
                    f"BottleneckDoctor: compute: {finding.evidence} Fix: {finding.fix}", category=UserWarning
                )
        except Exception as err:  # noqa: BLE001 - advice only
            self._notes.append(f"compute findings not read: {err!r}")

    def _attribution_report(self, report: DoctorReport, trainer: pl.Trainer) -> None:
        """Put the window's attribution and its findings into ``report``."""
        attr = self._attribution
        report.notes.extend(attr.notes)
        if attr.table is None:
            return
        result = attribute(attr.table, rank_tables=attr.rank_tables)
        step = report.step_seconds
        result.window = {
            "reason": attr.reason,
            "first_batch": attr.first_batch,
            "batches": attr.held_batches,
            "recorded_steps": attr.table.steps,
            "ranks": max(1, len(attr.rank_tables)),
        }
        result.overhead = {
            "window_s": attr.window_s,
            "analysis_s": attr.analysis_s,
            "extra_s": None if step is None else max(0.0, attr.window_s - attr.held_batches * step) + attr.analysis_s,
        }
        report.attribution = result.to_dict()
        if report.context.device_type == "cuda" and not any(r.dtype for r in attr.table.records):
            report.notes.append(
                "the fp32_matmul and nchw_convolution compute rules were skipped: the profiler recorded no input "
                "dtypes for the window's operations"
            )
        compute = report.shares.get("forward", 0.0) + report.shares.get("backward", 0.0) if report.shares else 1.0
        findings = find_compute_causes(attr.table, context=report.context, compute_share=compute)
        if any(f.rule == "fp32_matmul" for f in findings):  # the module-level finding replaces the stage-level one
            report.findings = [f for f in report.findings if f.rule != "fp32_compute"]
        for finding in findings:
            place_finding(report, finding)

    # ------------------------------------------------------------------ the live window log
    def _open_window_log(self, trainer: pl.Trainer) -> None:
        self._close_window_log(None)
        if not trainer.is_global_zero or self.window_log is False:
            return
        if self.window_log is None:
            if self.report_path is False:
                return
            report = Path(self.report_path) if self.report_path else report_dir(trainer) / "bottleneck_report.json"
            path = report.with_name(report.stem + WINDOW_LOG_SUFFIX)
        else:
            path = Path(self.window_log)
        try:
            self._window_log = WindowLogWriter(path)
            self._window_log.write("start", world_size=trainer.world_size, window=self.window, pid=os.getpid())
            self.window_log_path = path
        except OSError as err:  # a live view must not stop the fit
            self._window_log = None
            warnings.warn(f"BottleneckDoctor: no window log at {path} ({err})", stacklevel=2)

    def _close_window_log(self, status: str | None) -> None:
        log, self._window_log = self._window_log, None
        if log is None:
            return
        try:
            if status is not None:  # the page when one was written, else the JSON
                pages = [f for f in self.files if f.suffix == ".html"] + self.files
                log.write("end", status=status, report=str(pages[0]) if pages else None)
        finally:
            log.close()

    def _live_context(self) -> RunContext:
        ctx = self._windows.live_context(self._context)
        monitor = self._mfu_monitor
        if monitor is not None:
            mfu = (monitor.summary or {}).get("mfu")
            if mfu is None and monitor.history:
                mfu = monitor.history[-1].get("mfu")
            ctx.mfu = mfu
        return ctx

    # ------------------------------------------------------------------ pauses
    def _validation_begin(self, trainer: pl.Trainer) -> bool:
        """The validation loop's ``run`` starts: open the phase (its run is counted at ``on_validation_start``,
        which a loop with no batches never reaches)."""
        if trainer.state.fn != "fit" or self._in_validation:  # only validation inside fit is a fit phase
            return False
        self._in_validation = True
        self._fit_clock.enter("validation", sanity=trainer.sanity_checking, count=False)
        self._pause()
        return True

    def _validation_end(self, opened: bool) -> None:
        if opened:
            self._in_validation = False
            self._fit_clock.exit("validation")
            self._resume()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit":
            return
        if self._in_validation:  # opened by the loop's run: count the run
            self._fit_clock.count_run("validation", sanity=trainer.sanity_checking)
            return
        # the loop's run was not wrapped (timers not installed): time from the hooks
        self._in_validation = self._validation_hooks_only = True
        self._fit_clock.enter("validation", sanity=trainer.sanity_checking)
        self._pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or not self._validation_hooks_only:
            return
        self._in_validation = self._validation_hooks_only = False
        self._fit_clock.exit("validation")
        self._resume()

    @_guarded
    def _pause(self) -> None:
        if self._machine is not None:
            self._machine.pause()

    @_guarded
    def _resume(self) -> None:
        if self._machine is not None:
            self._machine.resume()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The time between epochs (epoch-end checkpoints, a new iterator) is not a batch's data wait: the clock
        # pauses until on_train_epoch_start.
        if not self._epoch_paused and self._machine is not None:
            self._epoch_paused = True
            self._pause()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_window_log(f"failed: {type(exception).__name__}: {exception}")
        self._attribution.abort(self._machine)
        if self._machine is not None:
            self._machine.cancel()
        if self._comm is not None:
            self._comm.discard()
        self._uninstall()

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._attribution.held:  # the fit ended inside the window: read what it recorded (every rank is here)
            self._finish_attribution(trainer)
        if self._measuring and self._window_count > 0:
            self._close_window(trainer, pl_module, log=False, final=True)
        elif self._machine is not None:
            self._machine.cancel()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_clock.stop()
        try:
            self.report = self._build_report(trainer)
        except Exception as err:  # noqa: BLE001 - a report problem must not fail a finished fit
            warnings.warn(f"BottleneckDoctor: could not build the report ({err!r})", stacklevel=2)
            return
        bubble = getattr(trainer.strategy, "bubble_finding", None)  # pp / pp_ddp: the pipeline bubble per rank
        if callable(bubble):
            finding = bubble(skip=min(self._skip, max(0, self._batches_seen - 1)))
            if finding is not None:
                place_finding(self.report, finding)
        if not trainer.is_global_zero:
            return
        if self.print_report:
            rank_zero_print(trainer, self.report.table())
        if self.report_path is not False:
            write_report_files(trainer, self.report, self.report_path, plot=self.plot, files=self.files)
        self._close_window_log("finished")

    def _build_report(self, trainer: pl.Trainer) -> DoctorReport:
        measured = max(0, self._batches_seen - self._skip)
        report = build_report(
            self._windows.breakdown,
            context=self._live_context(),
            thresholds=self.thresholds,
            world_size=trainer.world_size,
            fit=self._fit_clock.breakdown(self._windows.train_wall, self._batches_seen),
            smells=self._smells.diagnosis,
            variability_rows=self._windows.var_rows,
            utilisation=self._windows.util_sums,
            window=self.window,
            timeline=self._windows.timeline,
            precision=_precision_stats(trainer),
            notes=self._notes,
            empty_note=(
                f"too little data to diagnose: {self._batches_seen} batches ran, {self._skip} were warm-up "
                f"and {measured} measured, with no complete measurement; train longer or lower "
                "warmup_batches"
            ),
        )
        try:
            self._attribution_report(report, trainer)
        except Exception as err:  # noqa: BLE001 - a finished fit keeps its report
            report.notes.append(f"compute attribution not reported: {err!r}")
        try:
            report.run = run_identity(trainer)
        except Exception:  # noqa: BLE001 - an unusual logger: the page keeps its generic title
            pass
        return report


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
