"""The doctor's window log: one JSON line per measuring window of a running fit, and what follows it.

``BottleneckDoctor`` (rank 0) appends to it while the fit runs, a line per window, never per step;
``lightning-accel watch DIR`` follows it from another shell. See docs/measuring/doctor.md (A live view), which
lists each line's fields.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_accel.core.findings import STAGES

__all__ = ["WINDOW_LOG_SUFFIX", "LiveState", "WindowLogReader", "WindowLogWriter", "find_window_log", "render_live"]

#: a window log's file name ends with this (``bottleneck_report.json`` → ``bottleneck_report.windows.jsonl``)
WINDOW_LOG_SUFFIX = ".windows.jsonl"


class WindowLogWriter:
    """Appends events to the log, one flushed line each, so a reader sees every complete window at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a new fit starts a new log: a reader must not mix two fits' windows
        self._fh: IO[str] | None = open(self.path, "w", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps({"event": event, "time": time.time(), **fields}, default=_json_default) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _json_default(value: Any) -> Any:
    return str(value)  # a path, a dtype: readable, never a failed write


@dataclass
class LiveState:
    """What the events read so far say about the fit."""

    started: float | None = None
    world_size: int = 1
    windows: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    status: str | None = None
    report: str | None = None

    def apply(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            self.started = event.get("time")
            self.world_size = int(event.get("world_size") or 1)
            self.windows.clear()
        elif kind == "window":
            self.windows.append(event)
        elif kind == "end":
            self.ended = True
            self.status = event.get("status")
            self.report = event.get("report")

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.windows[-1] if self.windows else None


class WindowLogReader:
    """Reads the complete lines appended since the last call (a partial last line waits for its newline)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_events(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        if len(data) == 0:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # not one of ours (or a torn write): skip it, the next window replaces it
        return events


def find_window_log(where: str | os.PathLike[str]) -> Path | None:
    """``where`` itself when it is a file, else the most recently written window log under the folder ``where``
    (searched recursively: Lightning's ``lightning_logs/version_N/`` folders), else ``None``."""
    path = Path(where)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(
            f"{where}: no such folder or window log (give the fit's log folder, e.g. "
            "lightning_logs/, or a *.windows.jsonl file)"
        )
    logs = [p for p in path.rglob(f"*{WINDOW_LOG_SUFFIX}") if p.is_file()]
    return max(logs, key=lambda p: p.stat().st_mtime) if logs else None


def render_live(state: LiveState, source: str) -> Any:
    """A rich renderable of the latest window: the stage breakdown, throughput and MFU, the current findings."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    latest = state.latest
    if latest is None:
        return Text(f"{source}: waiting for the first measuring window ...")
    title = f"{source}: window {len(state.windows)} (batch {latest.get('batch')}, {state.world_size} rank(s))"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("stage")
    table.add_column("share of step", justify="right")
    table.add_column("")
    shares = latest.get("shares") or {}
    for stage in STAGES:
        share = shares.get(stage)
        if share is None:
            continue
        table.add_row(stage, f"{100 * share:5.1f} %", "█" * int(round(30 * share)))
    rate, mfu, step = latest.get("samples_per_sec"), latest.get("mfu"), latest.get("step_ms")
    line = f"step {step:.1f} ms" if isinstance(step, (int, float)) else "step —"
    line += f" · {rate:.1f} samples/s" if isinstance(rate, (int, float)) else ""
    line += f" · MFU {100 * mfu:.1f} %" if isinstance(mfu, (int, float)) else ""
    rates = [
        float(w["samples_per_sec"]) for w in state.windows[-20:] if isinstance(w.get("samples_per_sec"), (int, float))
    ]
    if len(rates) > 1:
        line += " · recent windows " + _sparkline(rates)
    parts: list[Any] = [table, Text(line)]
    findings = latest.get("findings") or []
    if findings:
        parts.append(Text("findings now:", style="bold"))
        for f in findings:
            parts.append(Text(f"  [{f.get('stage')}] {f.get('evidence')} Fix: {f.get('fix')}"))
    else:
        parts.append(Text("no finding in this window"))
    if state.ended:
        parts.append(Text(f"fit {state.status}" + (f"; report: {state.report}" if state.report else ""), style="bold"))
    return Group(*parts)


def _sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(bars[min(7, int(8 * (v - low) / span))] for v in values)
