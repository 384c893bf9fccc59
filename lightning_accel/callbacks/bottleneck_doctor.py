"""BottleneckDoctor: which stage of the training step holds the run back, and the change that fixes it."""

from __future__ import annotations

import functools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel.callbacks._trainer import compute_dtype, gather_floats, rank_zero_print
from lightning_accel.core.batch import samples_in_batch
from lightning_accel.core.breakdown import MEASURED_STAGES, ROW_FIELDS, Breakdown
from lightning_accel.core.comm import CommRecorder, timed_comm_hook
from lightning_accel.core.report import DoctorReport, plot_timeline
from lightning_accel.core.rules import STAGES, Finding, RunContext, Thresholds, diagnose, holding_back
from lightning_accel.attention import SDPABackendRecorder
from lightning_accel.core.timing import StageTimer

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BottleneckDoctor"]

# Utilisation columns gathered with each window's stage row (NaN where a rank has no value).
_UTIL_FIELDS = ("cpu_process_pct", "cpu_workers_pct", "gpu_util_pct", "gpu_mem_used_frac", "gpu_sm_clock_mhz",
                "memory_peak_frac")


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook body; a measuring problem warns once and stops the stage timing, never the training."""

    @functools.wraps(fn)
    def wrapper(self: BottleneckDoctor, *args: Any, **kwargs: Any) -> Any:
        if self._broken:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as err:  # measuring must never stop training
            self._break(f"{fn.__name__}: {err!r}")
            return None

    return wrapper


class BottleneckDoctor(Callback):
    """Splits every training step into stages, finds the one that holds the run back, and names the fix.

    Stages per batch (``lightning_accel.core.rules.STAGES``):

    ================  =========================================================================================
    stage             measured as
    ================  =========================================================================================
    ``data``          end of the previous ``on_train_batch_end`` → the batch is fetched (host clock; validation
                      and the epoch's end are not counted). It also holds what Lightning does between two batches
                      (its logging bookkeeping, callbacks after this one in ``on_train_batch_end``; under DDP the
                      per-batch SIGTERM broadcast, where a rank waits for slower ranks): well under 1 ms per batch
                      on an idle machine
    ``transfer``      the strategy's ``batch_to_device`` (your ``transfer_batch_to_device`` included); the doctor
                      wraps the strategy instance's public method for the duration of ``fit``
    ``forward``       ``on_train_batch_start`` → ``on_before_zero_grad``/``on_before_backward`` (in manual
                      optimization: all ``training_step`` code outside backward and optimizer steps)
    ``backward``      ``on_before_backward`` → ``on_after_backward``, minus ``communication``
    ``optimizer``     ``on_before_zero_grad`` → ``on_before_backward`` and ``on_before_optimizer_step`` → the
                      optimizer's step post-hook of the outermost ``step`` (``register_step_post_hook``)
    ``communication`` gradient all-reduce not hidden behind backward: from the launch of the last bucket (local
                      backward done) to the completion of every bucket (``lightning_accel.core.comm``), timed by
                      a DDP comm-hook wrapper; DDP only
    ``other``         the rest of the wall time (Lightning, logging, other callbacks)
    ================  =========================================================================================

    On CUDA the device stages are CUDA events, read when a window closes (one synchronisation per window, none per
    step). Shares are aggregated over each window of ``window`` batches and over ranks (one ``all_gather`` per
    window). Rules (``lightning_accel.core.rules``) turn the shares, utilisation and run facts into findings: each
    names the stage, the evidence and the fix; they are warned on rank 0 during training (each once, again only if
    its fix changes or it comes back, at most every ``warn_interval_s``), and reported at the end of ``fit``: a rich
    table (rank 0), the JSON at ``report_path`` and a PNG of the stacked shares over time next to it (with the
    ``plots`` extra). After ``fit``, :attr:`report` (a :class:`~lightning_accel.core.report.DoctorReport`) has
    ``bottleneck``, ``shares`` and ``findings``.

    Logged when a window closes, through ``pl_module.log`` (``on_step=True``):

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
        window: batches per measuring window (logging and warning interval). Closing a window costs a few ms
            (one gather, ~12 ``pl_module.log`` calls at ~0.3-1.5 ms each in Lightning, a psutil sample); 50 batches
            amortise that to well under 1 % for steps of 10 ms or more.
        warmup_batches: batches at the start of ``fit`` that are not measured (more if another callback asks with a
            ``warmup_batches`` attribute, as ``MFUMonitor`` does). On CUDA the SDPA kernel is observed on the
            second batch when at least two are warm-up.
        thresholds: a :class:`~lightning_accel.core.rules.Thresholds` or a dict of its fields
            (e.g. ``{"data_share": 0.2}``); defaults documented there.
        report_path: where the JSON report goes; ``None`` → ``<trainer.default_root_dir>/bottleneck_report.json``;
            ``False`` → no files.
        plot: also write ``<report_path stem>.png`` (needs matplotlib; skipped with a note if missing).
        warn: warn findings during training (rank 0). A new finding also asks a ``ProfileWindow`` among the
            callbacks (if any) for a ``torch.profiler`` trace of the next steps.
        warn_interval_s: the least time between two warnings of the same rule.
        log_metrics: log the keys above.
        print_report: print the report table at the end of ``fit`` (rank 0).
        utilisation: sample CPU (psutil) and GPU (NVML, when installed and a GPU is used) utilisation per window.
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
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"BottleneckDoctor(window={window!r}): window must be a positive number of batches, "
                             "e.g. 20")
        if not isinstance(warmup_batches, int) or isinstance(warmup_batches, bool) or warmup_batches < 0:
            raise ValueError(f"BottleneckDoctor(warmup_batches={warmup_batches!r}): use a number of batches >= 0, "
                             "e.g. 3")
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
            raise ValueError(f"BottleneckDoctor(thresholds={thresholds!r}): pass a Thresholds or a dict such as "
                             "{'data_share': 0.2}")
        if report_path is True or (report_path is not None and report_path is not False
                                   and not isinstance(report_path, (str, Path))):
            raise ValueError(f"BottleneckDoctor(report_path={report_path!r}): give a file path, None for "
                             "<default_root_dir>/bottleneck_report.json, or False for no files")
        if (not isinstance(warn_interval_s, (int, float)) or isinstance(warn_interval_s, bool)
                or math.isnan(warn_interval_s) or warn_interval_s < 0):
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
        self.report: DoctorReport | None = None
        #: files written at the end of the last fit (JSON, PNG)
        self.files: list[Path] = []
        self._comm_wrapper: Callable[[Any], Any] | None = None
        self._comm_strategy: Any = None
        self._comm: CommRecorder | None = None
        self._reset_run_state()

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        self._broken = False
        self._timer: StageTimer | None = None
        self._clock: Callable[[], float] = time.perf_counter
        self._stage: str | None = None
        self._awaiting_batch = False
        self._manual = False
        self._breakdown = Breakdown()
        self._batches_seen = 0
        self._skip = self._warmup_batches
        self._measuring = False
        self._window_batches = 0
        self._window_samples = 0.0
        self._window_start = 0.0
        self._edge: float | None = None
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._batch_sizes: list[int] = []
        self._util_sums: dict[str, list[float]] = {}
        self._cpu: Any = None
        self._gpu: Any = None
        self._device = torch.device("cpu")
        self._context = RunContext()
        self._notes: list[str] = []
        self._active: set[str] = set()  # rules found in the last window
        self._warned: dict[str, tuple[str, float]] = {}  # rule -> (fix, time) of its last warning
        self._timeline: list[dict[str, Any]] = []
        self._probe: SDPABackendRecorder | None = None
        self._probe_batch = 1
        self._comm_passes = 0
        self._restore: list[Callable[[], None]] = []
        self._mfu_monitor: Any = None

    def _break(self, what: str) -> None:
        self._broken = True
        if self._timer is not None:
            self._timer.cancel()
        self._stage = None
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
        self._comm = None
        strategy = trainer.strategy
        wrappers = getattr(strategy, "comm_hook_wrappers", None)
        if isinstance(wrappers, list):
            recorder = CommRecorder(cuda=strategy.root_device.type == "cuda")

            def wrap(hook: Any) -> Any:
                return timed_comm_hook(hook, recorder)

            wrappers.append(wrap)
            self._comm, self._comm_wrapper, self._comm_strategy = recorder, wrap, strategy

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run_state()
        self.report, self.files = None, []
        strategy = trainer.strategy
        self._device = strategy.root_device
        self._timer = StageTimer(self._device)
        self._manual = not pl_module.automatic_optimization
        extra = [getattr(cb, "warmup_batches", 0) for cb in trainer.callbacks if cb is not self]
        self._skip = max([self._warmup_batches, *[int(x) for x in extra if isinstance(x, int)]])
        # The attention-kernel rule is a GPU rule: observe SDPA on CUDA only, on a warm-up batch (MFUMonitor counts
        # FLOPs with its own dispatch mode on batch 0).
        self._probe_batch = 1 if self._skip >= 2 and self._device.type == "cuda" else -1
        from lightning_accel.callbacks.mfu_monitor import MFUMonitor

        self._mfu_monitor = next((cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)), None)
        try:
            self._context = self._static_context(trainer)
        except Exception as err:  # noqa: BLE001 - rules that need the missing facts are skipped
            self._context = RunContext(device_type=self._device.type, world_size=trainer.world_size)
            self._notes.append(f"run facts incomplete: {err!r}")
        try:
            self._install_transfer_timer(strategy)
            self._install_optimizer_hooks(trainer)
            self._install_comm_timer(trainer)
        except Exception as err:  # noqa: BLE001 - measuring must never stop training
            self._break(f"installing the timers: {err!r}")
        if self.utilisation:
            self._start_utilisation_samplers()

    def _static_context(self, trainer: pl.Trainer) -> RunContext:
        from lightning_accel.core.utilisation import usable_cpu_count

        device = self._device
        ctx = RunContext(device_type=device.type, device_name=str(device), world_size=trainer.world_size,
                         cpu_count=usable_cpu_count(), accumulate_grad_batches=trainer.accumulate_grad_batches)
        if device.type == "cuda":
            ctx.device_name = torch.cuda.get_device_name(device)
            ctx.device_capability = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
        try:
            ctx.compute_dtype = compute_dtype(trainer)
        except Exception:  # noqa: BLE001 - an exotic precision plugin: the dtype rules are skipped
            ctx.compute_dtype = None
        if trainer.optimizers:
            opt = trainer.optimizers[0]
            ctx.optimizer = type(opt).__name__
            defaults = getattr(opt, "defaults", {}) or {}
            if "fused" in defaults:
                ctx.optimizer_fused = bool(defaults["fused"])
            if "foreach" in defaults:
                ctx.optimizer_foreach = defaults["foreach"] if defaults["foreach"] is None else bool(
                    defaults["foreach"])
        return ctx

    def _install_transfer_timer(self, strategy: Any) -> None:
        original = strategy.batch_to_device
        had_instance_attr = "batch_to_device" in vars(strategy)

        @functools.wraps(original)
        def timed_batch_to_device(*args: Any, **kwargs: Any) -> Any:
            if not self._awaiting_batch or self._broken:
                return original(*args, **kwargs)
            self._begin_batch("transfer")
            out = original(*args, **kwargs)
            self._switch(None)
            return out

        strategy.batch_to_device = timed_batch_to_device

        def restore() -> None:
            if had_instance_attr:
                strategy.batch_to_device = original
            else:
                vars(strategy).pop("batch_to_device", None)

        self._restore.append(restore)

    def _install_optimizer_hooks(self, trainer: pl.Trainer) -> None:
        # An optimizer whose step() calls super().step() runs the step hooks once per hooked class in the chain
        # (torch wraps every Optimizer subclass's step the first time one is built): count the depth with the
        # pre-hook and end the stage when the outermost step returns.
        for opt in trainer.optimizers:
            register_pre = getattr(opt, "register_step_pre_hook", None)
            register_post = getattr(opt, "register_step_post_hook", None)
            if register_pre is not None and register_post is not None:
                self._restore.append(register_pre(self._before_optimizer_step_hook).remove)
                self._restore.append(register_post(self._after_optimizer_step).remove)

    def _before_optimizer_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_depth = getattr(self, "_step_depth", 0) + 1

    def _install_comm_timer(self, trainer: pl.Trainer) -> None:
        """Plain ``DDPStrategy``: time DDP's default all-reduce through our own comm hook (see module docstring)."""
        if self._comm is not None or trainer.world_size <= 1:
            return
        model = trainer.strategy.model
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            self._notes.append(f"communication not timed: {type(trainer.strategy).__name__} does not expose DDP comm "
                               "hooks (its all-reduce time is part of backward)")
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        recorder = CommRecorder(cuda=self._device.type == "cuda")
        try:
            model.register_comm_hook(None, timed_comm_hook(default_hooks.allreduce_hook, recorder))
        except RuntimeError as err:  # a hook is registered already (DDPStrategy(ddp_comm_hook=...)): DDP allows one
            self._notes.append(f"communication not timed: the model already has a DDP comm hook ({err}); use a "
                               "lightning-accel DDP strategy (ddp_bf16_compress, ...) whose hook the doctor can wrap")
            return
        self._comm = recorder

    def _start_utilisation_samplers(self) -> None:
        from lightning_accel._imports import is_available
        from lightning_accel.core.utilisation import CpuUtilisation, GpuUtilisation

        try:
            self._cpu = CpuUtilisation()
        except Exception as err:  # noqa: BLE001 - e.g. psutil missing or restricted /proc
            self._notes.append(f"CPU utilisation not sampled: {err!r}")
        if self._device.type != "cuda":
            return
        if not is_available("pynvml"):
            self._notes.append("GPU utilisation not sampled: NVML not installed (pip install "
                               "'lightning-accel[nvml]')")
            return
        try:
            index = self._device.index if self._device.index is not None else torch.cuda.current_device()
            self._gpu = GpuUtilisation(_nvml_index(index))
        except Exception as err:  # noqa: BLE001 - NVML present but unusable (container, MIG)
            self._notes.append(f"GPU utilisation not sampled: NVML failed ({err!r})")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        for restore in reversed(self._restore):
            try:
                restore()
            except Exception:  # noqa: BLE001,S110 - best effort: the objects may be gone already
                pass
        self._restore = []
        if self._comm_wrapper is not None:
            wrappers = getattr(self._comm_strategy, "comm_hook_wrappers", [])
            if self._comm_wrapper in wrappers:
                wrappers.remove(self._comm_wrapper)
            self._comm_wrapper = self._comm_strategy = None
        self._close_probe()

    # ------------------------------------------------------------------ stage switching
    def _switch(self, stage: str | None) -> None:
        timer = self._timer
        if timer is None:
            return
        if self._stage is not None:
            timer.stop(self._stage)
        self._stage = stage
        if stage is not None:
            timer.start(stage, host=stage == "data")

    def _begin_batch(self, stage: str) -> None:
        self._awaiting_batch = False
        self._switch(stage)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_depth = max(0, getattr(self, "_step_depth", 1) - 1)
        if self._step_depth > 0 or self._broken or self._stage != "optimizer":
            return
        try:
            self._switch("forward" if self._manual else None)
        except Exception as err:  # noqa: BLE001
            self._break(f"optimizer step post-hook: {err!r}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            _read_dataloader_settings(trainer.train_dataloader, self._context)
        except Exception:  # noqa: BLE001 - an unusual loader: the data rule gives the generic fix
            pass
        no_workers = self._context.num_workers == 0 or self._context.threaded_pipeline
        if self._cpu is not None and no_workers:
            self._cpu.track_workers = False  # no worker processes (or a threaded pipeline): skip the /proc walk

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._paused_at is not None:  # the gap between two epochs is not part of any batch
            self._paused_total += self._clock() - self._paused_at
            self._paused_at = None
        self._open_data_wait()

    @override
    @_guarded
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._begin_batch("forward")
        if self._batches_seen == self._probe_batch:
            self._probe = SDPABackendRecorder().__enter__()

    @override
    @_guarded
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._switch("optimizer")

    @override
    @_guarded
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._switch("backward")

    @override
    @_guarded
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch("forward" if self._manual else None)
        if self._comm is not None:
            self._comm.end_backward()

    @override
    @_guarded
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._switch("optimizer")

    def _close_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            probe.__exit__(None, None, None)
            if probe.backend is not None:
                self._context.sdpa_backend = probe.backend

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Window accounting runs even after a measuring problem: every rank must join the same gathers.
        self._batches_seen += 1
        self._stage_end_of_batch(batch)
        if not self._measuring:
            if self._batches_seen >= self._skip:
                self._start_measuring()
        elif self._window_batches >= self.window:
            self._close_window(trainer, pl_module, log=self.log_metrics)
        self._open_data_wait()

    @_guarded
    def _stage_end_of_batch(self, batch: Any) -> None:
        self._switch(None)
        self._close_probe()
        if self._measuring:
            self._window_batches += 1
            n = samples_in_batch(batch)
            self._window_samples += n
            if len(self._batch_sizes) < 1000:
                self._batch_sizes.append(n)

    @_guarded
    def _open_data_wait(self) -> None:
        self._awaiting_batch = True
        self._switch("data")

    def _start_measuring(self) -> None:
        self._measuring = True
        try:
            if self._timer is not None:
                self._timer.flush()  # drop the warm-up batches' times
            if self._comm is not None:
                self._comm.flush()
            if self._cpu is not None:
                self._cpu.start()
            if self._gpu is not None:
                self._gpu.start()
        except Exception as err:  # noqa: BLE001
            self._break(f"starting the first window: {err!r}")
        self._window_start = self._clock()
        self._paused_total, self._paused_at = 0.0, None

    # ------------------------------------------------------------------ windows
    def _local_row(self) -> list[float]:
        nan = math.nan
        row = [nan] * (len(ROW_FIELDS) + len(_UTIL_FIELDS) + 1)
        if self._broken or self._timer is None or self._window_batches == 0:
            return row
        try:
            seconds = self._timer.flush()
            comm, passes = self._comm.flush() if self._comm is not None else (0.0, 0)
            self._edge = self._clock()
            wall = self._edge - self._window_start - self._paused_total
            measured = {**{s: seconds.get(s, 0.0) for s in MEASURED_STAGES}, "communication": comm}
            values = {"wall": wall, **measured, "samples": self._window_samples, "batches": self._window_batches}
            util: dict[str, float] = {}
            if self._cpu is not None:
                util.update(self._cpu.sample() or {})
            if self._gpu is not None:
                util.update(self._gpu.sample())
            if self._device.type == "cuda":
                total = torch.cuda.get_device_properties(self._device).total_memory
                util["memory_peak_frac"] = torch.cuda.max_memory_allocated(self._device) / total
            return ([float(values[f]) for f in ROW_FIELDS] + [float(util.get(f, nan)) for f in _UTIL_FIELDS]
                    + [float(passes)])
        except Exception as err:  # noqa: BLE001
            self._break(f"closing a window: {err!r}")
            return row

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, log: bool) -> None:
        """Gather every rank's row (one collective), add the window, log, warn. Called on every rank.

        Windows tile the time: the next one starts where this one's wall time was read, so the cost of closing a
        window (gather, logging, rules) is counted, as ``other``, in the next window.
        """
        self._edge = None
        row = self._local_row()
        rows = gather_floats(trainer, self._device, row)
        self._window_batches, self._window_samples = 0, 0.0
        try:
            self._after_gather(trainer, pl_module, rows, log=log)
        except Exception as err:  # noqa: BLE001
            self._break(f"aggregating a window: {err!r}")
        self._window_start = self._edge if self._edge is not None else self._clock()
        self._paused_total, self._paused_at = 0.0, None

    def _after_gather(self, trainer: pl.Trainer, pl_module: pl.LightningModule, rows: torch.Tensor, *,
                      log: bool) -> None:
        n = len(ROW_FIELDS)
        all_rows = rows.tolist()
        finite = [r for r in all_rows if all(math.isfinite(v) for v in r[:n])]
        if not finite:
            return
        window = self._breakdown.add(all_rows)
        if window is None:
            return
        util_cols = {f: [r[n + i] for r in finite if math.isfinite(r[n + i])] for i, f in enumerate(_UTIL_FIELDS)}
        util = {f: (max(v) if f == "memory_peak_frac" else sum(v) / len(v)) for f, v in util_cols.items() if v}
        for f, v in util.items():
            self._util_sums.setdefault(f, []).append(v)
        self._comm_passes += int(sum(r[-1] for r in finite if math.isfinite(r[-1])))
        self._timeline.append({"batch": self._breakdown.batches, "shares": window.shares,
                               "step_seconds": window.step_seconds})
        if log:
            self._log(pl_module, window.shares, window.step_seconds, util)
        if self.warn:
            diagnosis = diagnose(window.shares, self._live_context(), self.thresholds)
            self._warn_findings(trainer, diagnosis.findings)

    def _log(self, pl_module: pl.LightningModule, shares: dict[str, float], step_seconds: float,
             util: dict[str, float]) -> None:
        values = {f"doctor/share_{s}": shares[s] for s in STAGES}
        values["doctor/data_wait_pct"] = 100.0 * shares["data"]
        values["doctor/step_ms"] = 1000.0 * step_seconds
        for key in ("cpu_process_pct", "cpu_workers_pct", "gpu_util_pct"):
            if key in util:
                values[f"doctor/{key}"] = util[key]
        if "memory_peak_frac" in util:
            values["doctor/memory_peak_pct"] = 100.0 * util["memory_peak_frac"]
        for key, value in values.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def _live_context(self) -> RunContext:
        ctx = self._context
        util = {f: v for f, v in self._util_sums.items() if v}
        ctx.gpu_utilisation = (statistics.fmean(util["gpu_util_pct"]) / 100.0 if "gpu_util_pct" in util else None)
        ctx.memory_peak_fraction = max(util["memory_peak_frac"]) if "memory_peak_frac" in util else None
        ctx.batch_size = int(statistics.median(self._batch_sizes)) if self._batch_sizes else None
        ctx.communication_measured = self._comm_passes > 0
        monitor = self._mfu_monitor
        if monitor is not None:
            mfu = (monitor.summary or {}).get("mfu")
            if mfu is None and monitor.history:
                mfu = monitor.history[-1].get("mfu")
            ctx.mfu = mfu
        return ctx

    def _warn_findings(self, trainer: pl.Trainer, findings: list[Finding]) -> None:
        """Warn a finding when it is new, came back, or its fix changed — at most every ``warn_interval_s``."""
        now = self._clock()
        current = {f.rule: f for f in findings}
        for f in findings:
            last = self._warned.get(f.rule)
            changed = f.rule not in self._active or (last is not None and last[0] != f.fix)
            if not changed or (last is not None and now - last[1] < self.warn_interval_s):
                continue
            self._warned[f.rule] = (f.fix, now)
            self._request_trace(trainer, f)
            if trainer.is_global_zero:
                rank_zero_warn(f"BottleneckDoctor: {f.stage} is holding the run back: {f.evidence} Fix: {f.fix}",
                               category=UserWarning)
        self._active = set(current)

    @staticmethod
    def _request_trace(trainer: pl.Trainer, finding: Finding) -> None:
        """Ask a ``ProfileWindow`` among the callbacks for a trace of the next steps (every rank sees the same
        gathered findings, so every rank asks): the numbers say which stage, the trace says which ops."""
        from lightning_accel.callbacks.profile_window import ProfileWindow

        for cb in trainer.callbacks:
            if isinstance(cb, ProfileWindow):
                cb.request(f"BottleneckDoctor finding: {finding}")

    # ------------------------------------------------------------------ pauses
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":  # only validation inside fit pauses the clock
            return
        if self._timer is not None and self._stage == "data":
            self._timer.cancel()  # the data wait restarts after validation
            self._stage = None
        if self._paused_at is None:
            self._paused_at = self._clock()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or self._paused_at is None:
            return
        self._paused_total += self._clock() - self._paused_at
        self._paused_at = None
        if self._awaiting_batch and not self._broken:
            self._switch("data")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The time between epochs (epoch-end validation, checkpoints, a new iterator) is not a batch's data wait:
        # the next epoch's wait starts at on_train_epoch_start.
        if self._stage == "data" and self._timer is not None:
            self._timer.cancel()
            self._stage = None
        self._paused_at = self._clock() if self._measuring else None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._comm is not None:
            self._comm.discard()
        self._stage = None
        self._uninstall()

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stage == "data" and self._timer is not None:
            self._timer.cancel()
            self._stage = None
        if self._paused_at is not None:  # an epoch ended (pause opened) and training stopped
            self._paused_total += self._clock() - self._paused_at
            self._paused_at = None
        if self._measuring and self._window_batches > 0:
            self._close_window(trainer, pl_module, log=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.report = self._build_report(trainer)
        except Exception as err:  # noqa: BLE001 - a report problem must not fail a finished fit
            warnings.warn(f"BottleneckDoctor: could not build the report ({err!r})", stacklevel=2)
            return
        if not trainer.is_global_zero:
            return
        if self.print_report:
            rank_zero_print(trainer, self.report.table())
        self._write_files(trainer)

    def _build_report(self, trainer: pl.Trainer) -> DoctorReport:
        ctx = self._live_context()
        bd = self._breakdown
        shares = bd.shares()
        notes = list(self._notes)
        report = DoctorReport(world_size=trainer.world_size, context=ctx, thresholds=vars(self.thresholds).copy(),
                              precision=_precision_stats(trainer), notes=notes, timeline=list(self._timeline),
                              windows=len(bd.windows), batches=bd.batches)
        if shares is None:
            measured = max(0, self._batches_seen - self._skip)
            notes.append(f"too little data to diagnose: {self._batches_seen} batches ran, {self._skip} were warm-up "
                         f"and {measured} measured, with no complete measurement; train longer or lower "
                         "warmup_batches")
            return report
        report.shares = shares
        report.stage_seconds = bd.stage_seconds() or {}
        report.rank_shares = bd.rank_shares() if trainer.world_size > 1 else []
        report.step_seconds = bd.step_seconds()
        report.samples_per_sec = bd.samples_per_sec()
        report.mfu = ctx.mfu
        report.utilisation = {f: (max(v) if f == "memory_peak_frac" else statistics.fmean(v))
                              for f, v in self._util_sums.items() if v}
        if bd.batches < self.window:
            notes.append(f"only {bd.batches} batches measured (window={self.window}): the shares are noisy")
        diagnosis = diagnose(shares, ctx, self.thresholds)
        report.findings, report.skipped = diagnosis.findings, diagnosis.skipped
        report.bottleneck = holding_back(shares, diagnosis.findings)
        return report

    def _write_files(self, trainer: pl.Trainer) -> None:
        if self.report_path is False or self.report is None:
            return
        path = Path(self.report_path) if self.report_path else Path(trainer.default_root_dir) / "bottleneck_report.json"
        try:
            if self.plot and self.report.timeline:
                png = path.with_suffix(".png")
                try:
                    self.files.append(plot_timeline(self.report, png))
                except ImportError as err:
                    self.report.notes.append(f"no PNG: {err}")
            self.files.insert(0, self.report.save(path))
        except OSError as err:
            warnings.warn(f"BottleneckDoctor: could not write the report to {path} ({err})", stacklevel=2)
            return
        rank_zero_print(trainer, f"BottleneckDoctor: report written to {', '.join(str(f) for f in self.files)}")


def _nvml_index(cuda_index: int) -> int:
    """NVML numbers all GPUs; CUDA only the visible ones. Map through CUDA_VISIBLE_DEVICES when it lists indices."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if cuda_index < len(parts) and parts[cuda_index].isdigit():
            return int(parts[cuda_index])
    return cuda_index


def _read_dataloader_settings(loaders: Any, ctx: RunContext) -> None:
    """Settings of the (first) training loader into ``ctx``; loaders may be nested in lists/dicts.

    A ``DataLoader``'s workers and prefetching, or the ``pipeline_settings`` mapping a non-DataLoader pipeline
    publishes (``DALIImageDataModule``'s loader: ``loader``, ``decode_device``, ``loader_threads``,
    ``prefetch_queue_depth``), so that the data finding names that pipeline's own knobs.
    """
    from torch.utils.data import DataLoader

    stack = [loaders]
    while stack:
        item = stack.pop(0)
        settings = getattr(item, "pipeline_settings", None)
        if isinstance(settings, Mapping):
            for key in ("loader", "decode_device", "loader_threads", "prefetch_queue_depth"):
                if key in settings:
                    setattr(ctx, key, settings[key])
            return
        if isinstance(item, DataLoader):
            ctx.loader = "DataLoader"
            ctx.num_workers = item.num_workers
            ctx.pin_memory = bool(item.pin_memory)
            ctx.prefetch_factor = item.prefetch_factor if item.num_workers > 0 else None
            ctx.persistent_workers = bool(item.persistent_workers) if item.num_workers > 0 else None
            return
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _precision_stats(trainer: pl.Trainer) -> dict[str, Any]:
    """``loss_scale``, ``skipped_steps``, ``total_steps`` of the precision plugin when it exposes them
    (``AutoMixedPrecision`` does)."""
    plugin = trainer.precision_plugin
    out: dict[str, Any] = {}
    for name in ("loss_scale", "skipped_steps", "total_steps"):
        value = getattr(plugin, name, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out
