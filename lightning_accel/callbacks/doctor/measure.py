"""The doctor's measuring object: one fit's stage timing, windows, rank gather and report, with no Lightning in it.
:class:`~lightning_accel.callbacks.doctor.bottleneck_doctor.BottleneckDoctor` hands it the moments of the step from
its hooks, as Lightning's ``ThroughputMonitor`` hands them to ``Throughput``. See ``docs/measuring/doctor.md``."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from lightning_accel.attention import SDPABackendRecorder
from lightning_accel.callbacks.doctor.attribution import DoctorAttribution
from lightning_accel.callbacks.doctor.live_log import LiveLog
from lightning_accel.callbacks.doctor.pauses import FitPauses, guarded
from lightning_accel.callbacks.doctor.smells import DoctorSmells
from lightning_accel.callbacks.doctor.utilisation import UtilisationSamplers
from lightning_accel.core.batch import samples_in_batch
from lightning_accel.core.comm import CommRecorder
from lightning_accel.core.compute_causes import nchw_convolutions
from lightning_accel.core.fit_windows import FitWindows, window_metrics
from lightning_accel.core.phases import FitClock
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import Finding, RunContext, Thresholds, diagnose
from lightning_accel.core.stages import StageMachine, StageWindow
from lightning_accel.core.verdict import build_report
from lightning_accel.core.window_row import RankWindow

__all__ = ["ClosedWindow", "DoctorMeasure", "Gather"]

#: one collective over the ranks: this rank's row in, every rank's row out (rank order)
Gather = Callable[[list[float]], list[list[float]]]


def _one_rank(row: list[float]) -> list[list[float]]:
    return [row]


@dataclass
class ClosedWindow:
    """What a gathered window asks of the callback: the metrics to log and the findings to warn (rank 0)."""

    metrics: dict[str, float]
    #: code smells the first window found worth a warning
    smells: list[Finding] = field(default_factory=list)
    #: the window's findings; ``None`` when not diagnosed (no warnings and no window log)
    findings: list[Finding] | None = None


class DoctorMeasure(FitPauses):
    """One fit's measurement: the stage machine, the fit's phases, the windows and their gather, the attribution
    window, the code smells, and the report built from them.

    Each method is a moment of the training step (a batch starts, backward begins, a window closes); the caller
    keeps the moments in the order Lightning's hooks run them and hands over what only the Trainer knows (the run
    facts, the collective, the batches left). A measuring problem stops the stage timing (:meth:`stop`), never the
    caller; the window accounting goes on, so that every rank joins the same gathers.

    Args:
        window: batches per measuring window.
        thresholds: the rules' thresholds.
        attribute_compute: when the attribution window opens (``None``: when compute-bound; ``True``: after the
            warm-up; ``False``: only on request).
        attribution_steps: steps the attribution window records.
        smells: check for the unused-parameter smell after the first backward.
        nvtx: emit the stages as NVTX ranges.
        clock: the host clock of the stages and phases.
        fit_clock: the fit's phase clock, when :meth:`setup_fit` already started it.
        comm: the all-reduce recorder, when the strategy's comm hook is already wrapped.
        live_log: the window log each gathered window writes a line to, when open.
    """

    def __init__(
        self,
        *,
        window: int = 50,
        thresholds: Thresholds | None = None,
        attribute_compute: bool | None = None,
        attribution_steps: int = 3,
        smells: bool = True,
        nvtx: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        fit_clock: FitClock | None = None,
        comm: CommRecorder | None = None,
        live_log: LiveLog | None = None,
    ) -> None:
        self.window = window
        self.thresholds = thresholds if thresholds is not None else Thresholds()
        self.nvtx = nvtx
        self.clock = clock
        self.fit_clock = fit_clock if fit_clock is not None else FitClock()
        self.comm = comm
        self.broken = False
        self.machine: StageMachine | None = None
        self.manual = False
        self.step_depth = 0
        self.windows = FitWindows()
        self.batches_seen = 0
        self.skip = 0
        self.measuring = False
        self.window_count = 0  # batches in the open window, counted on every rank even after a measuring problem
        self.samplers = UtilisationSamplers()
        self.device = torch.device("cpu")
        self.context = RunContext()
        self.notes: list[str] = []
        self.probe: SDPABackendRecorder | None = None
        self.probe_batch = 1
        self.mfu_monitor: Any = None  # an MFUMonitor: its ``summary`` / ``history`` give the live MFU
        self.smells = DoctorSmells(check_gradients=smells)
        self.epoch_paused = False
        self.ranges: Any = None
        self.nvtx_missing = False  # nvtx=True where no range can be emitted: warned once per fit
        self.comm_failure_noted = False
        self.in_validation = False
        self.validation_hooks_only = False
        self.attribution = DoctorAttribution(attribute_compute, attribution_steps, clock)
        self.last_shares: dict[str, float] = {}
        self.live_log = live_log if live_log is not None else LiveLog()

    @override
    def stop(self, what: str) -> None:
        """A measuring problem: stop the stage timing for the rest of the fit, with one warning and a note."""
        self.broken = True
        if self.machine is not None:
            self.machine.cancel()
        self.close_probe()
        note = f"stage timing stopped after a measuring problem ({what}); training went on"
        self.notes.append(note)
        warnings.warn(f"BottleneckDoctor: {note}. Please report it with the traceback of the error.", stacklevel=2)

    # ------------------------------------------------------------------ the fit
    def setup_fit(self) -> None:
        """Before the strategy's set-up: the fit's clock starts, in its start-up phase."""
        self.fit_clock = FitClock(self.clock)
        self.fit_clock.start()
        self.fit_clock.enter("startup")
        self.comm = None

    def start_fit(
        self,
        module: nn.Module,
        *,
        device: torch.device,
        skip: int,
        context: RunContext,
        manual: bool = False,
        utilisation: bool = True,
        mfu_monitor: Any = None,
        timers: Callable[[], None] | None = None,
    ) -> None:
        """The fit starts: ``skip`` warm-up batches are not measured; ``context`` holds the run facts; ``timers``
        installs the caller's timers, which call this object's moments."""
        self.device, self.skip, self.manual, self.mfu_monitor = device, skip, manual, mfu_monitor
        # The attention-kernel rule is a GPU rule: observe SDPA on CUDA only, on a warm-up batch (MFUMonitor counts
        # FLOPs with its own dispatch mode on batch 0).
        self.probe_batch = 1 if skip >= 2 and device.type == "cuda" else -1
        self.context = context
        # read once, before the fit: a conversion the user makes later is not seen (the Autopilot re-reads it)
        self.context.nchw_convolutions = nchw_convolutions(module)
        try:
            if timers is not None:
                timers()
        except Exception as err:  # noqa: BLE001 - measuring must never stop training
            self.stop(f"installing the timers: {err!r}")
        try:
            self.attribution.start_fit(module)
        except Exception as err:  # noqa: BLE001 - diagnostics never stop training
            self.attribution.state = "off"
            self.notes.append(f"no compute attribution: {err!r}")
        if utilisation:
            self.samplers.create(device, self.notes)

    def train_start(self) -> None:
        """Training starts (after the run facts and smells are read): the stage machine starts."""
        if self.context.num_workers == 0 or self.context.threaded_pipeline:
            self.samplers.skip_workers()
        self.machine = StageMachine(
            clock=self.clock, warmup_batches=self.skip, device=self.device, ranges=self.nvtx_ranges()
        )
        if self.skip == 0:
            self.start_measuring()

    def nvtx_ranges(self) -> Any:
        """The fit's NVTX emitter (``nvtx=True``), shared by the stage machine and the comm recorder; else None."""
        if not self.nvtx or self.nvtx_missing:
            return None
        if self.ranges is None:
            from lightning_accel.core.nvtx import StageRanges, nvtx_unavailable

            why = nvtx_unavailable()
            if why is not None:  # a diagnostics flag never takes the training down: say so once, run without
                self.nvtx_missing = True
                warnings.warn(
                    f"BottleneckDoctor(nvtx=True): no NVTX ranges: {why}. Training and measuring go on without them.",
                    stacklevel=2,
                )
                return None
            self.ranges = StageRanges()
        return self.ranges

    # ------------------------------------------------------------------ the timers' moments
    @guarded("batch_to_device")
    def transfer_begin(self) -> bool:
        machine = self.machine
        if machine is None or not machine.awaiting_batch:
            return False
        machine.stage_start("transfer")
        return True

    @guarded("batch_to_device")
    def transfer_end(self, timed: bool) -> None:
        if timed and self.machine is not None:
            self.machine.stage_end("transfer")

    def before_optimizer_step_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # An optimizer whose step() calls super().step() runs the step hooks once per hooked class in the chain
        # (torch wraps every Optimizer subclass's step the first time one is built): count the depth with the
        # pre-hook and end the stage when the outermost step returns.
        self.step_depth += 1

    def after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step_depth = max(0, self.step_depth - 1)
        machine = self.machine
        if self.step_depth > 0 or self.broken or machine is None or machine.stage != "optimizer":
            return
        try:
            if self.manual:
                machine.stage_start("forward")
            else:
                machine.stage_end()
        except Exception as err:  # noqa: BLE001
            self.stop(f"optimizer step post-hook: {err!r}")

    # ------------------------------------------------------------------ the step's moments
    @guarded("on_train_batch_start")
    def batch_start(self, module: nn.Module) -> None:
        if self.machine is not None:
            self.machine.stage_start("forward")
        self.attribution.batch_start(module, self.device.type)
        if self.batches_seen == self.probe_batch:
            self.probe = SDPABackendRecorder().__enter__()

    @guarded("on_before_zero_grad")
    def zero_grad(self) -> None:
        if self.machine is not None:
            self.machine.stage_start("optimizer")
        self.attribution.mark(None)

    @guarded("on_before_backward")
    def backward_start(self) -> None:
        if self.machine is not None:
            self.machine.stage_start("backward")
        self.attribution.mark("backward")

    @guarded("on_after_backward")
    def backward_end(self, module: nn.Module) -> None:
        machine = self.machine
        if machine is not None:
            if self.manual:
                machine.stage_start("forward")
            else:
                machine.stage_end()
        self.attribution.mark("forward" if self.manual else None)
        if self.comm is not None:
            self.comm.end_backward()
        if not self.smells.grads_checked:
            self.smells.check_unused_parameters(module)

    @guarded("on_before_optimizer_step")
    def optimizer_step_start(self) -> None:
        if self.machine is not None:
            self.machine.stage_start("optimizer")

    def close_probe(self) -> None:
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe.__exit__(None, None, None)
            if probe.backend is not None:
                self.context.sdpa_backend = probe.backend

    def batch_end(self, batch: Any) -> Literal["attribution", "window"] | None:
        """A training batch ended (every rank, also after a measuring problem: every rank joins the same gathers).

        Returns ``"attribution"`` when it was the attribution window's last (then :meth:`finish_attribution`),
        ``"window"`` when the measuring window is full (then :meth:`close_window`); then :meth:`next_batch`.
        """
        self.batches_seen += 1
        measured = self.measuring
        held = self.attribution.held  # a batch of the attribution window: in no stage window
        self._end_batch(batch, measured and not held)
        if held:
            return "attribution" if self.attribution.batch_end(self.batches_seen) else None
        if not measured:
            if self.batches_seen >= self.skip:
                self.start_measuring()
            return None
        self.window_count += 1
        return "window" if self.window_count >= self.window else None

    def next_batch(self, remaining: Callable[[], int | None]) -> None:
        """Between two batches: open the attribution window at the next one when wanted (``remaining``: the
        training batches the fit has left, ``None`` when unknown), and start the next batch's data wait."""
        if self.measuring and not self.attribution.held:
            self.attribution.schedule(self.machine, self.batches_seen, remaining())
        self.open_data_wait()

    @guarded("_end_batch")
    def _end_batch(self, batch: Any, measured: bool) -> None:
        n = samples_in_batch(batch) if measured else 0
        if self.machine is not None:
            self.machine.step_end(samples=n)
        self.close_probe()
        if measured:
            self.windows.record_batch_size(n)

    @guarded("_open_data_wait")
    def open_data_wait(self) -> None:
        if self.machine is not None:
            self.machine.batch_requested()

    def start_measuring(self) -> None:
        self.measuring = True
        self.fit_clock.exit("startup")
        try:
            if self.comm is not None:
                self.comm.flush()
            self.samplers.start()
        except Exception as err:  # noqa: BLE001
            self.stop(f"starting the first window: {err!r}")

    # ------------------------------------------------------------------ windows
    def _local_row(self, window: StageWindow | None) -> RankWindow:
        if self.broken or window is None or window.batches == 0:
            return RankWindow.unmeasured()
        try:
            comm, passes = self.comm.flush() if self.comm is not None else (0.0, 0)
            if self.comm is not None and self.comm.failed is not None and not self.comm_failure_noted:
                self.comm_failure_noted = True
                message = (
                    f"timing the all-reduce stopped ({self.comm.failed}): the all-reduces run untimed and "
                    "communication is not measured from here on"
                )
                self.notes.append(message)
                warnings.warn(f"BottleneckDoctor: {message}", stacklevel=2)
            return self.windows.local_row(window, comm, passes, self.samplers.sample, self.device)
        except Exception as err:  # noqa: BLE001
            self.stop(f"closing a window: {err!r}")
            return RankWindow.unmeasured()

    def close_window(self, gather: Gather | None, *, final: bool = False, live: bool = True) -> ClosedWindow | None:
        """Close the open window, gather every rank's row (``gather``: one collective; ``None`` in one process) and
        add the window. Called on every rank at the same batch count; ``None`` when no rank measured the window.
        ``live``: diagnose the window for the live warnings (it is diagnosed for the window log anyway).

        Windows tile the time: the next one starts where this one's wall time was read, so the cost of closing a
        window (gather, logging, rules) is counted, as ``other``, in the next window.
        """
        window = None
        machine = self.machine
        if machine is not None and not self.broken:
            try:
                window = machine.finish() if final else machine.close_window()
            except Exception as err:  # noqa: BLE001
                self.stop(f"closing a window: {err!r}")
        row = self._local_row(window)
        # one process: no collective, and no tensor round trip (~50 µs of the flush)
        rows = [row] if gather is None else [RankWindow.from_floats(r) for r in gather(row.to_floats())]
        self.window_count = 0
        try:
            return self._add_window(rows, live)
        except Exception as err:  # noqa: BLE001
            self.stop(f"aggregating a window: {err!r}")
            return None

    def _add_window(self, rows: list[RankWindow], live: bool) -> ClosedWindow | None:
        added = self.windows.add(rows)
        if added is None:
            return None
        window, util = added
        self.last_shares = dict(window.shares)
        self.attribution.compute_bound(window.shares, self.thresholds.compute_share)
        closed = ClosedWindow(window_metrics(window.shares, window.step_seconds, util))
        if self.smells.pending:
            closed.smells = self.smells.take_live(window.shares)
        if live or self.live_log.is_open:
            ranks = [r for r in window.per_rank_seconds if r is not None]
            context = self.live_context()
            diagnosis = diagnose(
                window.shares, context, self.thresholds, rank_seconds=ranks if len(ranks) > 1 else None
            )
            closed.findings = diagnosis.findings
            self.live_log.window(
                batch=self.windows.breakdown.batches, window=window, mfu=context.mfu, findings=diagnosis.findings
            )
        return closed

    def live_context(self) -> RunContext:
        """The run facts with what the windows measured so far, and the MFU when an ``MFUMonitor`` has one."""
        ctx = self.windows.live_context(self.context)
        monitor = self.mfu_monitor
        if monitor is not None:
            mfu = (monitor.summary or {}).get("mfu")
            if mfu is None and monitor.history:
                mfu = monitor.history[-1].get("mfu")
            ctx.mfu = mfu
        return ctx

    # ------------------------------------------------------------------ compute attribution
    def finish_attribution(self, gather: Gather | None, *, findings: bool) -> list[Finding]:
        """The attribution window's last batch ended (every rank): read it and gather the ranks' module times.
        Returns its compute findings when ``findings`` (for the live warnings)."""
        attr = self.attribution
        attr.finish(gather if gather is not None else _one_rank, self.machine, self.batches_seen)
        # the window's batches trained the model: the fit's training time (reading the events is not)
        self.windows.train_wall += attr.window_s
        if not findings:
            return []
        try:
            return attr.live_findings(self.context, self.last_shares)
        except Exception as err:  # noqa: BLE001 - advice only
            self.notes.append(f"compute findings not read: {err!r}")
            return []

    # ------------------------------------------------------------------ end
    def abort(self) -> None:
        """The fit failed: drop the open windows without reading them."""
        self.attribution.abort(self.machine)
        if self.machine is not None:
            self.machine.cancel()
        if self.comm is not None:
            self.comm.discard()

    def report(self, *, world_size: int, precision: dict[str, Any] | None = None) -> DoctorReport:
        """The fit's report: the step breakdown, the fit's phases, ranks, variability, smells and attribution."""
        measured = max(0, self.batches_seen - self.skip)
        report = build_report(
            self.windows.breakdown,
            context=self.live_context(),
            thresholds=self.thresholds,
            world_size=world_size,
            fit=self.fit_clock.breakdown(self.windows.train_wall, self.batches_seen),
            smells=self.smells.diagnosis,
            variability_rows=self.windows.var_rows,
            utilisation=self.windows.util_sums,
            window=self.window,
            timeline=self.windows.timeline,
            precision=precision,
            notes=self.notes,
            empty_note=(
                f"too little data to diagnose: {self.batches_seen} batches ran, {self.skip} were warm-up "
                f"and {measured} measured, with no complete measurement; train longer or lower "
                "warmup_batches"
            ),
        )
        try:
            self.attribution.add_to_report(report)
        except Exception as err:  # noqa: BLE001 - a finished fit keeps its report
            report.notes.append(f"compute attribution not reported: {err!r}")
        return report
