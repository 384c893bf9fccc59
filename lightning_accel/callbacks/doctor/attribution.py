"""The doctor's compute-attribution window: a few training steps under ``torch.profiler``, with module and stage
ranges, turned into an :class:`~lightning_accel.core.attribution.OpTable`.

Nothing of it exists outside the window: the module hooks are registered when it opens and removed when it closes,
and the profiler is created at the first step and dropped at the last. The first step of the window is the
profiler's warm-up (recorded and discarded: its start-up cost settles), the next ``steps`` are recorded.

Ranges, as ``record_function`` annotations the profiler keeps with the operations:

* ``la.module::<path>`` around every sub-module's ``forward`` (a forward pre-hook opens it, a forward hook with
  ``always_call=True`` closes it, so an exception inside ``forward`` cannot leave it open);
* ``la.stage::forward#<step>`` / ``la.stage::backward#<step>`` from the doctor's hooks (``on_train_batch_start`` →
  ``on_before_zero_grad``/``on_before_backward``, ``on_before_backward`` → ``on_after_backward``).

:func:`table_from_events` reads the profiler's events into records (the rules are in ``core/attribution.py``).

The profiler's own log lines (Kineto's ``USDT: ... profiler_start`` / ``profiler_stop``, its stages and warnings,
written from C++ to the process's stderr) are kept out of the terminal: each profiler call runs under
:func:`profiler_output_dropped` and the lines are kept in :attr:`AttributionWindow.profiler_log` instead (see
``docs/measuring/doctor.md``, "Inside the compute").
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_accel.core.attribution import ACCUMULATE, ENGINE, PSEUDO_MODULES, PYTHON_OP, STEP, OpRecord, OpTable
from lightning_accel.core.compute_causes import MATMUL_OPS

__all__ = [
    "AttributionWindow",
    "DoctorAttribution",
    "compiled_module",
    "profiler_output_dropped",
    "profiling",
    "table_from_events",
]

_MODULE = "la.module::"
_STAGE = "la.stage::"
_EVALUATE = "autograd::engine::evaluate_function: "
_FLOATS = ("float", "double", "c10::Half", "c10::BFloat16", "c10::Float8_e4m3fn", "c10::Float8_e5m2")


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
            pre = _bind(enter, _MODULE + path)
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

            rf = record_function(f"{_STAGE}{name}#{self.step - self.warmup}")
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


# ---------------------------------------------------------------------------------------------- reading the events
def _shapes(event: Any) -> tuple[tuple[int, ...], ...]:
    out = []
    for s in getattr(event, "input_shapes", None) or ():
        if isinstance(s, (list, tuple)) and all(isinstance(d, int) for d in s):
            out.append(tuple(s))
        else:
            out.append(())
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def _first_float(event: Any) -> str | None:
    for d in getattr(event, "input_dtypes", None) or ():
        if d in _FLOATS:
            return str(d)
    return None


def _compute_dtype(event: Any) -> str | None:
    """The dtype the operation's arithmetic ran in: for a matmul, its innermost matmul's (under autocast the
    outer call still sees the fp32 inputs), else its own first floating input's."""
    if event.name in MATMUL_OPS:
        inner, todo = event, list(event.cpu_children)
        while todo:
            child = todo.pop()
            if child.name in MATMUL_OPS:
                inner = child
            todo.extend(child.cpu_children)
        return _first_float(inner) or _first_float(event)
    return _first_float(event)


def _range(event: Any) -> tuple[str, str, int] | None:
    """``(kind, name, step)`` of one of our annotations: ``("module", path, -1)`` / ``("stage", phase, step)``."""
    name = event.name
    if name.startswith(_MODULE):
        return "module", name[len(_MODULE) :], -1
    if name.startswith(_STAGE):
        phase, _, step = name[len(_STAGE) :].partition("#")
        return "stage", phase, int(step) if step.lstrip("-").isdigit() else -1
    return None


def _stage_step(event: Any) -> int:
    """The recorded step of a stage range (``la.stage::forward#2`` → 2)."""
    return int(event.name.rpartition("#")[2])


def _user(event: Any) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("ProfilerStep#")


def table_from_events(events: Sequence[Any], *, steps: int, device_type: str = "cpu") -> OpTable:
    """An :class:`OpTable` from ``torch.profiler`` events (``profiler.events()``) of a window that had the module
    and stage ranges of :class:`AttributionWindow` (see ``core/attribution.py`` for what is charged where)."""
    device = device_type == "cuda"

    def seconds(event: Any) -> float:
        if device:
            return float(event.device_time_total) / 1e6
        return float(event.time_range.elapsed_us()) / 1e6

    def host(event: Any) -> float:
        return float(event.time_range.elapsed_us()) / 1e6

    def nearest(event: Any) -> tuple[Any, Any]:
        """The nearest enclosing operation (not an annotation) and module range of ``event``."""
        op = module = None
        parent = event.cpu_parent
        while parent is not None and module is None:
            kind = _range(parent)
            if kind is None:
                if op is None and not _user(parent):
                    op = parent
            elif kind[0] == "module":
                module = parent
            parent = parent.cpu_parent
        return op, module

    records: list[OpRecord] = []
    stage_seconds = {"forward": 0.0, "backward": 0.0}
    backward_ranges: list[tuple[float, float, int, Any]] = []
    forward_ranges: list[Any] = []
    for e in events:
        kind = _range(e)
        if kind is not None and kind[0] == "stage" and 0 <= kind[2] < steps and kind[1] in stage_seconds:
            stage_seconds[kind[1]] += host(e)
            if kind[1] == "backward":
                backward_ranges.append((e.time_range.start, e.time_range.end, kind[2], e))
            else:
                forward_ranges.append(e)

    # Stage ranges are found by time, not by nesting: Lightning runs the step inside ``optimizer.step(closure)``,
    # whose own annotation starts inside the forward range and ends after it, so the profiler's tree does not put
    # the step's operations under the stage range.
    forward_ranges.sort(key=lambda r: r.time_range.start)

    def forward_of(event: Any) -> Any:
        start = event.time_range.start
        for rng in forward_ranges:
            if rng.time_range.start <= start < rng.time_range.end and rng.thread == event.thread:
                return rng
            if rng.time_range.start > start:
                break
        return None

    # forward: top-level operations and module ranges inside a forward range
    module_own: dict[int, list[Any]] = {}  # id(module range) → [range, path, step, own seconds]
    top_ops: dict[int, tuple[OpRecord, float]] = {}
    orders: dict[int, int] = {}
    seq_to_op: dict[tuple[int, int], OpRecord] = {}
    children_of_stage: dict[int, float] = {}
    pending_seq: list[tuple[Any, Any]] = []
    ordered = sorted(events, key=lambda ev: ev.time_range.start)
    for e in ordered:
        kind = _range(e)
        if kind is not None and kind[0] == "stage":
            continue
        stage = forward_of(e)
        if stage is None:
            continue
        step = _stage_step(stage)
        op, module = nearest(e)
        if kind is not None and kind[0] == "module":
            module_own[id(e)] = [e, kind[1], step, seconds(e) if not device else 0.0]
            if module is not None:
                if id(module) in module_own and not device:
                    module_own[id(module)][3] -= host(e)
            else:
                children_of_stage[id(stage)] = children_of_stage.get(id(stage), 0.0) + host(e)
            continue
        if kind is not None or _user(e):
            continue
        if op is not None:
            pending_seq.append((e, op))
            continue
        order = orders.get(step, 0)
        orders[step] = order + 1
        path = module.name[len(_MODULE) :] if module is not None else STEP
        rec = OpRecord(step, "forward", path, e.name, seconds(e), _shapes(e), _compute_dtype(e), order)
        top_ops[id(e)] = (rec, host(e))
        records.append(rec)
        if e.sequence_nr is not None and e.sequence_nr >= 0:
            seq_to_op[(e.thread, e.sequence_nr)] = rec
        if not device:
            if module is not None and id(module) in module_own:
                module_own[id(module)][3] -= host(e)
            elif module is None:
                children_of_stage[id(stage)] = children_of_stage.get(id(stage), 0.0) + host(e)
    for e, op in pending_seq:  # nested calls share their autograd node's sequence number with the top-level one
        top = op
        while top is not None and id(top) not in top_ops:
            top = top.cpu_parent
        if top is not None and e.sequence_nr is not None and e.sequence_nr >= 0:
            seq_to_op.setdefault((e.thread, e.sequence_nr), top_ops[id(top)][0])
    if not device:
        for _rng, path, step, own in module_own.values():
            if own > 0:
                records.append(OpRecord(step, "forward", path, PYTHON_OP, own))
        for rng in forward_ranges:
            step = _stage_step(rng)
            rest = host(rng) - children_of_stage.get(id(rng), 0.0)
            if rest > 0:
                records.append(OpRecord(step, "forward", STEP, PYTHON_OP, rest))

    # backward: the outermost autograd nodes inside a backward range (by time: CUDA runs them on another thread)
    backward_ranges.sort(key=lambda r: r[0])
    covered: dict[int, float] = {}
    for e in ordered:
        if not e.name.startswith(_EVALUATE):
            continue
        parent = e.cpu_parent
        nested = False
        while parent is not None:
            if parent.name.startswith(_EVALUATE):
                nested = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        start = e.time_range.start
        inside = next((r for r in backward_ranges if r[0] <= start <= r[1]), None)
        if inside is None:
            continue
        step = inside[2]
        node = e.name[len(_EVALUATE) :]
        fwd = seq_to_op.get((getattr(e, "fwd_thread", e.thread), e.sequence_nr))
        if fwd is None and e.sequence_nr is not None and e.sequence_nr >= 0:
            fwd = seq_to_op.get((e.thread, e.sequence_nr))
        if fwd is not None:
            records.append(
                OpRecord(step, "backward", fwd.module, fwd.name, seconds(e), fwd.shapes, fwd.dtype, fwd.order, node)
            )
        else:
            where = ACCUMULATE if "AccumulateGrad" in node else STEP
            records.append(OpRecord(step, "backward", where, node, seconds(e), node=node))
        if e.thread == inside[3].thread:
            covered[id(inside[3])] = covered.get(id(inside[3]), 0.0) + host(e)
    if not device:
        for _, _, step, rng in backward_ranges:
            rest = host(rng) - covered.get(id(rng), 0.0)
            if rest > 0:
                records.append(OpRecord(step, "backward", ENGINE, "(engine)", rest))
    else:
        stage_seconds = {
            phase: sum(r.seconds for r in records if r.phase == phase) for phase in ("forward", "backward")
        }
    return OpTable(records=records, steps=steps, stage_seconds=stage_seconds, device_type=device_type)


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
