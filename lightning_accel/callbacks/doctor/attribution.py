"""The doctor's compute-attribution window: a few training steps under ``torch.profiler``, with module and stage
ranges, read into an :class:`~lightning_accel.core.attribution.OpTable` (``core/profiler_events.py``), and the
doctor's side of it: when it opens, its gather and its part of the report. See ``docs/measuring/doctor.md``,
"Inside the compute"."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_accel.core.attribution import PSEUDO_MODULES, OpTable, attribute
from lightning_accel.core.compute_causes import find_compute_causes
from lightning_accel.core.profiler_events import MODULE_RANGE, STAGE_RANGE, table_from_events
from lightning_accel.core.verdict import place_finding

if TYPE_CHECKING:
    from lightning_accel.core.findings import Finding, RunContext
    from lightning_accel.core.report import DoctorReport

__all__ = [
    "AttributionWindow",
    "DoctorAttribution",
    "compiled_module",
    "profiler_output_dropped",
    "profiling",
    "table_from_events",
]

_OPEN: list[AttributionWindow] = []  # windows open in this process (one profiler at a time)

# Kineto's log line: ``USDT:2026-01-01 12:00:00 4357:4357 SyncActivityProfilerHandler.cpp:52] profiler_start``
_KINETO_LINE = re.compile(
    rb"^(?:VERBOSE|INFO|WARNING|STAGE|ERROR|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] "
)


@contextlib.contextmanager
def profiler_output_dropped(log: list[str]) -> Iterator[None]:
    """Run the block with file descriptors 1 and 2 on temporary files, then restore them and write back to each
    what was not the profiler's: Kineto's log lines (and the indented lines of its configuration printed with them)
    go to ``log`` instead.

    Kineto writes from C++ straight to fd 2, so neither ``sys.stderr`` nor a Python logger sees the lines, and its
    level (``KINETO_LOG_LEVEL``) is read once per process, when Kineto starts: only the descriptors scope it to the
    profiler's calls. Whatever else the block printed (another thread's output, Python warnings) is written back.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream: nothing buffered to lose
            stream.flush()
    saved: list[int] = []
    sinks: list[Any] = []
    try:
        for fd in (1, 2):
            saved.append(os.dup(fd))
            sinks.append(tempfile.TemporaryFile())
    except OSError:  # no such descriptor (a daemon) or no temporary file: run the block as it is
        for fd in saved:
            os.close(fd)
        for sink in sinks:
            sink.close()
        yield
        return
    try:
        for fd, sink in zip((1, 2), sinks):
            os.dup2(sink.fileno(), fd)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # what Python printed in the block goes to the sink, read below
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        for fd, sink in zip((1, 2), sinks):
            sink.seek(0)
            data = sink.read()
            sink.close()
            if data:
                kept = memoryview(_drop_profiler_lines(data, log))
                while kept:  # a pipe may take part of it at a time
                    kept = kept[os.write(fd, kept) :]


def _drop_profiler_lines(data: bytes, log: list[str]) -> bytes:
    lines = data.splitlines(keepends=True)
    ours = [bool(_KINETO_LINE.match(line)) for line in lines]
    if any(ours):  # Kineto prints its configuration as indented lines next to its log lines
        ours = [o or line[:2] == b"  " for o, line in zip(ours, lines)]
    log.extend(line.decode(errors="replace").rstrip("\n") for line, o in zip(lines, ours) if o)
    return b"".join(line for line, o in zip(lines, ours) if not o)


def profiling() -> bool:
    """Whether a ``torch.profiler`` records in this process, or an attribution window holds one (in its warm-up
    step the profiler does not record yet): another profiler must wait."""
    from lightning_accel._compat import profiler_recording

    return bool(_OPEN) or profiler_recording()


def compiled_module(module: nn.Module) -> bool:
    """Whether ``module`` or a sub-module is a ``torch.compile`` wrapper: its operations are fused kernels with no
    module, and a hook on it would make it recompile."""
    from lightning_accel._compat import is_compile_wrapper

    return any(is_compile_wrapper(m) for m in module.modules())


class AttributionWindow:
    """One profiled window over ``steps`` training steps (after one warm-up step) of ``module``.

    Args:
        module: the LightningModule; paths are relative to it (``model.blocks.3.attn``).
        steps: recorded steps.
        device_type: ``"cuda"`` records the kernels and charges device time; anything else host time.
        clock: the host clock the stages are also timed with on the CPU (the check that the records add up); on
            CUDA they are timed with events on the current stream, as the kernels are.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        steps: int,
        device_type: str = "cpu",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.module = module
        self.steps = steps
        self.device_type = "cuda" if device_type == "cuda" else "cpu"
        self.clock = clock
        self.step = 0  # steps ended in this window, warm-up included
        self.measured: dict[str, float] = {"forward": 0.0, "backward": 0.0}
        self._spans: list[tuple[str, Any, Any]] = []  # CUDA: (stage, start event, end event), read at close
        self._profiler: Any = None
        self._handles: list[Any] = []
        self._stack: list[Any] = []
        self._stage: tuple[str, Any, float] | None = None
        self.profiler_log: list[str] = []  # the profiler's own lines, kept out of the terminal

    @property
    def warmup(self) -> int:
        return 1

    @property
    def done(self) -> bool:
        return self.step >= self.warmup + self.steps

    def open(self) -> None:
        """Register the module ranges and start the profiler (the window's first step follows)."""
        from torch.autograd.profiler import record_function

        stack = self._stack

        def enter(mod: nn.Module, args: Any, name: str = "") -> None:
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)

        def leave(mod: nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        for path, sub in self.module.named_modules():
            if not path:
                continue  # the LightningModule itself: its work is the step's
            pre = _bind(enter, MODULE_RANGE + path)
            self._handles.append(sub.register_forward_pre_hook(pre))
            self._handles.append(sub.register_forward_hook(leave, always_call=True))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.steps, repeat=1),
            record_shapes=True,
        )
        with profiler_output_dropped(self.profiler_log):
            self._profiler.start()
        _OPEN.append(self)

    def stage(self, name: str | None) -> None:
        """Close the open stage range and open ``name`` (``forward``/``backward``), or none."""
        now = self._mark()
        if self._stage is not None:
            stage, rf, start = self._stage
            self._stage = None
            rf.__exit__(None, None, None)
            if self.step >= self.warmup:
                if self.device_type == "cuda":
                    self._spans.append((stage, start, now))
                else:
                    self.measured[stage] += now - start
        if name is not None:
            from torch.autograd.profiler import record_function

            rf = record_function(f"{STAGE_RANGE}{name}#{self.step - self.warmup}")
            rf.__enter__()
            self._stage = (name, rf, now)  # one point ends a stage and starts the next

    def _mark(self) -> Any:
        """A point of the stage clock. On CUDA an event on the current stream: the kernels are charged in device
        time, and the host clock around an asynchronous launch measures the launching, not the work."""
        if self.device_type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def step_end(self) -> bool:
        """A training step ended; ``True`` when the window is complete."""
        self.stage(None)
        self.step += 1
        if self._profiler is not None:
            with profiler_output_dropped(self.profiler_log):  # the trace starts and stops in a step
                self._profiler.step()
        return self.done

    def close(self) -> OpTable:
        """Stop, drop the hooks and the profiler, and read the recorded steps."""
        from lightning_accel._compat import profiler_event_dtypes

        profiler = self._remove()
        if profiler is None:
            return OpTable(device_type=self.device_type)
        with profiler_output_dropped(self.profiler_log):
            profiler.stop()
            events = profiler.events() or []
        recorded = max(0, min(self.steps, self.step - self.warmup))
        profiler_event_dtypes(profiler, events)
        table = table_from_events(events, steps=recorded, device_type=self.device_type)
        if self._spans:
            self._spans[-1][2].synchronize()
            for stage, start, end in self._spans:
                self.measured[stage] += start.elapsed_time(end) / 1e3
            self._spans = []
        table.measured_seconds = dict(self.measured)
        return table

    def abort(self) -> None:
        """Stop without reading (an exception in the step, the fit ended): hooks and profiler are dropped."""
        profiler = self._remove()
        if profiler is not None:
            try:
                with profiler_output_dropped(self.profiler_log):
                    profiler.stop()
            except Exception:  # noqa: BLE001 - stopping a profiler that failed: nothing left to save
                pass

    def _remove(self) -> Any:
        while self._stack:
            self._stack.pop().__exit__(None, None, None)
        if self._stage is not None:
            self._stage[1].__exit__(None, None, None)
            self._stage = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        profiler, self._profiler = self._profiler, None
        if self in _OPEN:
            _OPEN.remove(self)
        return profiler


def _bind(fn: Callable[..., None], name: str) -> Callable[[nn.Module, Any], None]:
    def hook(mod: nn.Module, args: Any) -> None:
        fn(mod, args, name)

    return hook


# ---------------------------------------------------------------------------------------------- the doctor's side
class DoctorAttribution:
    """When the doctor's attribution window opens, the stage marks from its hooks, and the gather at its end.

    ``mode``: ``True`` opens the window once the warm-up is over; ``None`` when a measured window finds forward +
    backward at or above the compute threshold (and the fit has the batches left for it); ``False`` never.
    :meth:`request` asks for one at the next batch (call it on every rank). The window is the same batches on
    every rank: it opens after a gathered window or at a batch count, and ends ``1 + steps`` batches later, where
    every rank joins one gather of its module times (a rank whose profiling failed sends NaN).
    """

    def __init__(self, mode: bool | None, steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.mode = mode
        self.steps = steps
        self.clock = clock
        self.state = "off"
        self.reason = ""
        self.window: AttributionWindow | None = None
        self.table: OpTable | None = None
        self.rank_tables: list[dict[str, dict[str, float]]] = []
        self.notes: list[str] = []
        self.first_batch = 0
        self.end_batch = -1
        self.held_batches = 0
        self.window_s = 0.0
        self.analysis_s = 0.0
        self._held_at = 0.0
        self._paths: list[str] = []
        self._blocked = False

    @property
    def held(self) -> bool:
        """The batches of the window (the warm-up step included): the stage breakdown leaves them out."""
        return self.state in ("pending", "active")

    def start_fit(self, pl_module: nn.Module) -> None:
        self.state = "off"
        self._paths = [p for p, _ in pl_module.named_modules() if p]
        self._blocked = compiled_module(pl_module)
        if self._blocked:
            if self.mode is not False:
                self.notes.append(
                    "no compute attribution: the model is compiled (torch.compile), its operations are fused "
                    "kernels that belong to no module"
                )
            return
        if self.mode is True:
            self.state, self.reason = "wanted", "attribute_compute=True"
        elif self.mode is None:
            self.state = "auto"

    def request(self, reason: str) -> bool:
        """Open the window at the next batch (once per fit). ``False`` when one ran, is under way, or is off."""
        if self._blocked or self.state not in ("off", "auto", "wanted"):
            return False
        self.state, self.reason = "wanted", str(reason)
        return True

    def compute_bound(self, shares: dict[str, float], threshold: float) -> None:
        """A gathered window's shares: in automatic mode, forward + backward at or above ``threshold`` asks for
        the window."""
        compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
        if self.state == "auto" and compute >= threshold:
            self.state = "wanted"
            self.reason = f"forward + backward take {compute:.1%} of the step (threshold {threshold:.0%})"

    def schedule(self, machine: Any, batches_seen: int, remaining: int | None) -> None:
        """Between batches: hold the stage breakdown and open the window at the next batch, when wanted."""
        if self.state != "wanted":
            return
        if remaining is not None and remaining < 1 + self.steps and self.mode is None:
            return  # automatic: the fit ends before the window would
        if machine is not None:
            machine.hold()
        self._held_at = self.clock()
        self.state = "pending"
        self.first_batch = batches_seen
        self.end_batch = batches_seen + 1 + self.steps

    def batch_start(self, pl_module: nn.Module, device_type: str) -> None:
        """A training batch starts: the window opens at its first batch; every batch's forward range opens."""
        if self.state == "active":
            self.mark("forward")
            return
        if self.state != "pending":
            return
        self.state = "active"
        if profiling():  # one profiler at a time: another one is recording
            self.notes.append("no compute attribution: another torch.profiler was recording at the window's start")
            return
        try:
            self.window = AttributionWindow(pl_module, steps=self.steps, device_type=device_type, clock=self.clock)
            self.window.open()
            self.window.stage("forward")
        except Exception as err:  # noqa: BLE001 - diagnostics never stop training
            self.fail(f"opening the window: {err!r}")

    def mark(self, stage: str | None) -> None:
        """A stage boundary from the doctor's hooks (``forward``, ``backward`` or none)."""
        if self.window is None:
            return
        try:
            self.window.stage(stage)
        except Exception as err:  # noqa: BLE001
            self.fail(f"marking {stage}: {err!r}")

    def batch_end(self, batches_seen: int) -> bool:
        """A batch of the window ended; ``True`` when it was the last (then call :meth:`finish` on every rank)."""
        if self.window is not None:
            try:
                self.window.step_end()
            except Exception as err:  # noqa: BLE001
                self.fail(f"ending a step: {err!r}")
        # pending too: a rank that never opened the window (its measuring broke) still ends it with the others
        return self.held and batches_seen >= self.end_batch

    def fail(self, what: str) -> None:
        window, self.window = self.window, None
        if window is not None:
            window.abort()
        self.notes.append(f"compute attribution stopped after a problem ({what}); training went on")

    def finish(self, gather: Callable[[list[float]], list[list[float]]], machine: Any, batches_seen: int) -> None:
        """Close the window (every rank, at the same batch): read it, gather every rank's module times, release the
        stage breakdown."""
        start = self.clock()
        window, self.window = self.window, None
        table = None
        if window is not None:
            try:
                table = window.close()
            except Exception as err:  # noqa: BLE001
                self.notes.append(f"compute attribution not read ({err!r})")
        self.held_batches = batches_seen - self.first_batch
        self.window_s = start - self._held_at
        # the profiler's events are garbage now: collect them while the breakdown is held, not in a measured step
        gc.collect()
        names: tuple[str, ...] = (*PSEUDO_MODULES, *self._paths)
        own = table.by_module() if table is not None and table.records else None
        try:
            # ranks that hold different modules (pipeline stages) send their totals only
            if len({r[0] for r in gather([float(len(names))])}) > 1:
                names = ("(rank total)",)
                own = (
                    {names[0]: {p: sum(v.get(p, 0.0) for v in own.values()) for p in ("forward", "backward")}}
                    if own is not None
                    else None
                )
            row = [float("nan")] * (2 * len(names))
            if own is not None:
                row = [
                    v for p in names for v in (own.get(p, {}).get("forward", 0.0), own.get(p, {}).get("backward", 0.0))
                ]
            rows = gather(row)
        finally:
            if machine is not None:
                machine.release()
            self.state = "done"
        self.rank_tables = [
            {
                p: {"forward": r[2 * i], "backward": r[2 * i + 1]}
                for i, p in enumerate(names)
                if r[2 * i] > 0 or r[2 * i + 1] > 0
            }
            for r in rows
            if all(v == v for v in r)  # NaN: a rank whose profiling failed
        ]
        if len(rows) > 1 and len(self.rank_tables) < len(rows):
            self.notes.append(f"{len(rows) - len(self.rank_tables)} rank(s) recorded no attribution")
        self.table = table if table is not None and table.records else None
        if self.table is None and not self.notes:
            self.notes.append("the attribution window recorded no operation")
        self.analysis_s = self.clock() - start

    def abort(self, machine: Any = None) -> None:
        """The fit stopped (exception, teardown): drop the window without reading it."""
        window, self.window = self.window, None
        if window is not None:
            window.abort()
        if self.held:
            self.state = "done"
            if machine is not None:
                machine.release()

    def live_findings(self, context: RunContext, shares: Mapping[str, float]) -> list[Finding]:
        """The window's compute findings, as warned when it ends: ``shares`` are the last gathered window's (none
        yet: the compute is the whole step)."""
        if self.table is None:
            return []
        compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
        return find_compute_causes(self.table, context=context, compute_share=compute if shares else 1.0)

    def add_to_report(self, report: DoctorReport) -> None:
        """Put the window's attribution and its findings into ``report``."""
        report.notes.extend(self.notes)
        if self.table is None:
            return
        result = attribute(self.table, rank_tables=self.rank_tables)
        step = report.step_seconds
        result.window = {
            "reason": self.reason,
            "first_batch": self.first_batch,
            "batches": self.held_batches,
            "recorded_steps": self.table.steps,
            "ranks": max(1, len(self.rank_tables)),
        }
        result.overhead = {
            "window_s": self.window_s,
            "analysis_s": self.analysis_s,
            "extra_s": None if step is None else max(0.0, self.window_s - self.held_batches * step) + self.analysis_s,
        }
        report.attribution = result.to_dict()
        if report.context.device_type == "cuda" and not any(r.dtype for r in self.table.records):
            report.notes.append(
                "the fp32_matmul and nchw_convolution compute rules were skipped: the profiler recorded no input "
                "dtypes for the window's operations"
            )
        findings = self.live_findings(report.context, report.shares)
        if any(f.rule == "fp32_matmul" for f in findings):  # the module-level finding replaces the stage-level one
            report.findings = [f for f in report.findings if f.rule != "fp32_compute"]
        for finding in findings:
            place_finding(report, finding)
