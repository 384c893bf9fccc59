"""Compute attribution: a profiled window's operations → forward and backward time per module of the model.

Pure (no Lightning, no profiler): :func:`attribute` turns an :class:`OpTable` (one :class:`OpRecord` per operation
call) into an :class:`Attribution`, the module tree by time with each module's costliest operations. How time is
charged to a module: ``docs/measuring/doctor.md``, "Inside the compute" and "The core, module by module".
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACCUMULATE",
    "ENGINE",
    "OWN",
    "PHASES",
    "PSEUDO_MODULES",
    "PYTHON_OP",
    "STEP",
    "Attribution",
    "ModuleTime",
    "OpRecord",
    "OpTable",
    "OpTime",
    "attribute",
    "format_shapes",
    "module_pattern",
]

PHASES: tuple[str, ...] = ("forward", "backward")
#: forward work in ``training_step`` outside every sub-module (and what autograd does for it)
STEP = "<training_step>"
#: backward time outside every autograd node: the engine itself, the loss's seed gradient
ENGINE = "<autograd engine>"
#: accumulating gradients into the parameters' ``.grad``
ACCUMULATE = "<accumulate grad>"
PSEUDO_MODULES: tuple[str, ...] = (STEP, ENGINE, ACCUMULATE)
#: a module's own forward interval outside its operations: the Python between them (CPU only)
PYTHON_OP = "(python)"
#: the suffix of a row above the first branching level that holds only that module's own work
OWN = "(own)"

_TOP_OPS = 5  # operations listed per module row
_LEAVES = 12  # modules listed by own time


@dataclass(frozen=True)
class OpRecord:
    """One operation call in the profiled window.

    Attributes:
        step: index of the recorded step (0-based).
        phase: ``"forward"`` or ``"backward"``.
        module: the innermost module path that ran it (one of :data:`PSEUDO_MODULES` outside every module).
        name: the forward operation (``aten::linear``); a backward record names the forward operation whose
            autograd node it ran, so forward and backward of one operation share a name and shapes;
            :data:`PYTHON_OP` for a module's Python.
        seconds: its time (host time on a CPU, device time on a GPU).
        shapes: the forward operation's input shapes.
        dtype: the dtype its arithmetic ran in (``float``, ``c10::BFloat16``, ...), when known.
        order: the forward operation's position in its step (its backward record carries the same), ``-1`` for
            records that are no operation.
        node: the autograd node that ran (backward records), e.g. ``AddmmBackward0``.
    """

    step: int
    phase: str
    module: str
    name: str
    seconds: float
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str | None = None
    order: int = -1
    node: str | None = None


@dataclass
class OpTable:
    """Every operation call of a profiled window, and what the window measured.

    Attributes:
        records: the calls (:class:`OpRecord`).
        steps: the number of recorded steps (times are divided by it to give per-step figures).
        stage_seconds: ``forward`` / ``backward`` seconds of the recorded steps as the profiler's stage ranges
            measured them (the sum over the steps).
        device_type: ``"cpu"`` (host time) or ``"cuda"`` (device time).
        measured_seconds: the same stages timed around the profiled steps, when known: by the host clock on the
            CPU, by CUDA events on the stream on CUDA (the kernels' time then adds up to at most this: the device
            idles while the host launches). The check that the records add up to what was measured.
    """

    records: list[OpRecord] = field(default_factory=list)
    steps: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    device_type: str = "cpu"
    measured_seconds: dict[str, float] = field(default_factory=dict)

    def by_module(self) -> dict[str, dict[str, float]]:
        """Module → phase → seconds per step, of the module's own records."""
        out: dict[str, dict[str, float]] = {}
        n = max(1, self.steps)
        for r in self.records:
            row = out.setdefault(r.module, {p: 0.0 for p in PHASES})
            row[r.phase] = row.get(r.phase, 0.0) + r.seconds / n
        return out


@dataclass(frozen=True)
class OpTime:
    """One operation of a module, per step: forward and backward seconds, calls, input shapes."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    forward_s: float
    backward_s: float
    calls: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class ModuleTime:
    """One module (with everything below it, or only its own records for a leaf row), per step."""

    module: str
    depth: int
    forward_s: float
    backward_s: float
    ops: tuple[OpTime, ...] = ()
    rank_seconds: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclass
class Attribution:
    """Forward and backward time per module (per step), the rows outside every module, and their sources.

    Attributes:
        forward_s / backward_s: the attributed seconds per step (module rows and pseudo rows together).
        modules: the tree by time: its first branching level and one level below (each row includes its
            sub-modules), then the pseudo rows (:data:`PSEUDO_MODULES`), each with its costliest operations.
        leaves: the modules with the most *own* time (their operations, not their sub-modules').
        steps / device_type: from the :class:`OpTable`.
        stage_seconds / measured_seconds: per step, the stage ranges' and the stage clock's forward/backward
            (host clock on the CPU, CUDA events on CUDA).
        ranks: per rank, ``forward_s`` / ``backward_s`` per step (rank 0 first), when several ranks recorded.
        window / overhead / notes: where the window ran and what it cost (filled by the caller).
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    modules: list[ModuleTime] = field(default_factory=list)
    leaves: list[ModuleTime] = field(default_factory=list)
    steps: int = 0
    device_type: str = "cpu"
    stage_seconds: dict[str, float] = field(default_factory=dict)
    measured_seconds: dict[str, float] = field(default_factory=dict)
    ranks: list[dict[str, float]] = field(default_factory=list)
    window: dict[str, Any] = field(default_factory=dict)
    overhead: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    def share(self, seconds: float) -> float:
        """``seconds`` (per step) as a share of the attributed forward + backward time."""
        return seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form in the doctor's report (``report.attribution``); times in ms per step, shares of the
        attributed forward + backward time."""
        return {
            "device": self.device_type,
            "steps": self.steps,
            "forward_ms": 1e3 * self.forward_s,
            "backward_ms": 1e3 * self.backward_s,
            "measured_ms": {k: 1e3 * v for k, v in self.measured_seconds.items()},
            "modules": [self._row(m) for m in self.modules],
            "leaves": [self._row(m) for m in self.leaves],
            "ranks": [
                {"rank": int(r["rank"]), "forward_ms": 1e3 * r["forward_s"], "backward_ms": 1e3 * r["backward_s"]}
                for r in self.ranks
            ],
            "window": dict(self.window),
            "overhead": dict(self.overhead),
            "notes": list(self.notes),
        }

    def _row(self, m: ModuleTime) -> dict[str, Any]:
        row: dict[str, Any] = {
            "module": m.module,
            "depth": m.depth,
            "share": self.share(m.seconds),
            "forward_ms": 1e3 * m.forward_s,
            "backward_ms": 1e3 * m.backward_s,
            "ops": [
                {
                    "name": o.name,
                    "share": self.share(o.seconds),
                    "ms": round(1e3 * o.seconds, 4),
                    "forward_ms": 1e3 * o.forward_s,
                    "backward_ms": 1e3 * o.backward_s,
                    "calls": o.calls,
                    "shapes": format_shapes(o.shapes),
                }
                for o in m.ops
            ],
        }
        if m.rank_seconds:
            row["rank_ms"] = [1e3 * s for s in m.rank_seconds]
        return row


def format_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """``((8, 64), (64,))`` → ``"[8, 64], [64]"`` (scalars and non-tensor arguments left out)."""
    return ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes if len(s))


def module_pattern(path: str) -> str:
    """A module path with its list indices as ``*``: ``model.h.3.attn`` → ``model.h.*.attn`` (the same part of
    every layer of a stack)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def _depth(path: str) -> int:
    return 0 if not path else path.count(".") + 1


def _ancestors(path: str) -> list[str]:
    """``a.b.c`` → ``["a", "a.b", "a.b.c"]``."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _ops(records: Iterable[OpRecord], steps: int, limit: int = _TOP_OPS) -> tuple[OpTime, ...]:
    """The costliest operations (by forward + backward), grouped by name and shapes, per step."""
    acc: dict[tuple[str, tuple[tuple[int, ...], ...]], list[float]] = {}
    for r in records:
        entry = acc.setdefault((r.name, r.shapes), [0.0, 0.0, 0.0])
        entry[0 if r.phase == "forward" else 1] += r.seconds
        if r.phase == "forward":
            entry[2] += 1
    n = max(1, steps)
    ops = [OpTime(name, shapes, f / n, b / n, c / n) for (name, shapes), (f, b, c) in acc.items()]
    ops.sort(key=lambda o: -o.seconds)
    return tuple(ops[:limit])


def _first_branch(paths: Iterable[str], seconds: Mapping[str, float]) -> int:
    """The depth where the tree first splits into more than one child with time (1 when it does at once)."""
    depth = 1
    while True:
        children = {p for p in paths if _depth(p) == depth and seconds.get(p, 0.0) > 0}
        deeper = any(_depth(p) > depth for p in paths)
        if len(children) != 1 or not deeper:
            return depth
        depth += 1


def attribute(table: OpTable, *, rank_tables: Sequence[Mapping[str, Mapping[str, float]]] = ()) -> Attribution:
    """The module tree by time from an :class:`OpTable` (docs/measuring/doctor.md, Compute attribution and findings).

    Args:
        table: this rank's records (rank 0's on a multi-rank run).
        rank_tables: every rank's :meth:`OpTable.by_module` (rank 0 first) when several ranks recorded: each
            module row then carries its seconds per rank (``rank_seconds``) and :attr:`Attribution.ranks` each
            rank's forward/backward.
    """
    if table.device_type not in ("cpu", "cuda"):
        raise ValueError(f"OpTable.device_type={table.device_type!r}: use 'cpu' or 'cuda'")
    unknown = {r.phase for r in table.records} - set(PHASES)
    if unknown:
        raise ValueError(f"OpTable: phase(s) {sorted(unknown)} are not {list(PHASES)}")
    steps = max(1, table.steps)
    own: dict[str, dict[str, float]] = table.by_module()
    # every module's time with its sub-modules'
    total: dict[str, list[float]] = {}
    for module, phases in own.items():
        paths = [module] if module in PSEUDO_MODULES or not module else _ancestors(module)
        for p in paths:
            acc = total.setdefault(p, [0.0, 0.0])
            acc[0] += phases.get("forward", 0.0)
            acc[1] += phases.get("backward", 0.0)
    records_of: dict[str, list[OpRecord]] = {}
    for r in table.records:
        paths = [r.module] if r.module in PSEUDO_MODULES or not r.module else _ancestors(r.module)
        for p in paths:
            records_of.setdefault(p, []).append(r)

    def ranks_of(path: str, exact: bool = False) -> tuple[float, ...]:
        if len(rank_tables) < 2:
            return ()
        out = []
        found = False
        for rt in rank_tables:
            s = 0.0
            for module, phases in rt.items():
                below = not exact and path not in PSEUDO_MODULES and module.startswith(path + ".")
                if module == path or below:
                    s += sum(phases.values())
                    found = True
            out.append(s)
        return tuple(out) if found else ()  # ranks that sent totals only (pipeline stages): no row of theirs

    real = [p for p in total if p not in PSEUDO_MODULES and p]
    seconds = {p: sum(v) for p, v in total.items()}
    top = _first_branch(real, seconds)
    rows: list[ModuleTime] = []
    for p in sorted((p for p in real if _depth(p) == top), key=lambda p: -seconds[p]):
        f, b = total[p]
        rows.append(ModuleTime(p, top, f, b, _ops(records_of[p], steps), ranks_of(p)))
        children = [c for c in real if _depth(c) == top + 1 and c.startswith(p + ".")]
        for c in sorted(children, key=lambda c: -seconds[c]):
            cf, cb = total[c]
            rows.append(ModuleTime(c, top + 1, cf, cb, _ops(records_of[c], steps), ranks_of(c)))
    # above the first branching level: each ancestor's own operations (a residual add in ``model.forward``)
    for p in sorted(a for a in real if _depth(a) < top):
        if p in own and sum(own[p].values()) > 0:
            f, b = own[p].get("forward", 0.0), own[p].get("backward", 0.0)
            mine = [r for r in table.records if r.module == p]
            rows.append(ModuleTime(f"{p} {OWN}", _depth(p), f, b, _ops(mine, steps), ranks_of(p, exact=True)))
    for p in PSEUDO_MODULES:
        if p in total and seconds[p] > 0:
            f, b = total[p]
            rows.append(ModuleTime(p, 0, f, b, _ops(records_of[p], steps), ranks_of(p)))
    leaves = [
        ModuleTime(
            p,
            _depth(p),
            own[p].get("forward", 0.0),
            own[p].get("backward", 0.0),
            _ops([r for r in table.records if r.module == p], steps),
        )
        for p in own
        if p not in PSEUDO_MODULES and p
    ]
    leaves.sort(key=lambda m: -m.seconds)
    forward = sum(v.get("forward", 0.0) for v in own.values())
    backward = sum(v.get("backward", 0.0) for v in own.values())
    ranks = [
        {
            "rank": float(i),
            "forward_s": sum(v.get("forward", 0.0) for v in rt.values()),
            "backward_s": sum(v.get("backward", 0.0) for v in rt.values()),
        }
        for i, rt in enumerate(rank_tables)
        if len(rank_tables) > 1
    ]
    return Attribution(
        forward_s=forward,
        backward_s=backward,
        modules=rows,
        leaves=leaves[:_LEAVES],
        steps=table.steps,
        device_type=table.device_type,
        stage_seconds={k: v / steps for k, v in table.stage_seconds.items() if math.isfinite(v)},
        measured_seconds={k: v / steps for k, v in table.measured_seconds.items() if math.isfinite(v)},
        ranks=ranks,
    )
