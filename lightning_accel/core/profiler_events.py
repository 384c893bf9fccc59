"""The compute-attribution window's profiler events read into an :class:`~lightning_accel.core.attribution.OpTable`:
each operation charged to the module range and stage range it ran in. Reads the events' attributes only (no torch).
The window that records them is ``callbacks/doctor/attribution.py``; see ``docs/measuring/doctor.md``, "Inside the
compute"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_accel.core.attribution import ACCUMULATE, ENGINE, PYTHON_OP, STEP, OpRecord, OpTable
from lightning_accel.core.compute_causes import MATMUL_OPS

__all__ = ["MODULE_RANGE", "STAGE_RANGE", "table_from_events"]

#: the name prefix of the range around a sub-module's ``forward`` (``la.module::model.blocks.3.attn``)
MODULE_RANGE = "la.module::"
#: the name prefix of a stage range of a recorded step (``la.stage::forward#2``)
STAGE_RANGE = "la.stage::"
_EVALUATE = "autograd::engine::evaluate_function: "
_FLOATS = ("float", "double", "c10::Half", "c10::BFloat16", "c10::Float8_e4m3fn", "c10::Float8_e5m2")


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
    if name.startswith(MODULE_RANGE):
        return "module", name[len(MODULE_RANGE) :], -1
    if name.startswith(STAGE_RANGE):
        phase, _, step = name[len(STAGE_RANGE) :].partition("#")
        return "stage", phase, int(step) if step.lstrip("-").isdigit() else -1
    return None


def _stage_step(event: Any) -> int:
    """The recorded step of a stage range (``la.stage::forward#2`` → 2)."""
    return int(event.name.rpartition("#")[2])


def _user(event: Any) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("ProfilerStep#")


def table_from_events(events: Sequence[Any], *, steps: int, device_type: str = "cpu") -> OpTable:
    """An :class:`OpTable` from ``torch.profiler`` events (``profiler.events()``) of a window that had the module
    and stage ranges of the doctor's attribution window (see ``core/attribution.py`` for what is charged where)."""
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
        path = module.name[len(MODULE_RANGE) :] if module is not None else STEP
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
