"""What the Autopilot shows while it searches (rank 0): a live status line and each trial's row when it is decided.

On a terminal with the progress bar enabled the line is a ``rich`` live line (transient, like Lightning's progress
bar) with the rows printed above it; otherwise (a log file, a notebook's captured output, ``enable_progress_bar=
False``) each phase is one plain line. The loop calls :meth:`phase` and :meth:`record` between windows, never
inside a timed step, so the display costs the measurements nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from lightning_accel.core.autopilot import SearchStatus, TrialRecord

__all__ = ["SearchDisplay", "format_row", "format_status"]


def format_status(status: SearchStatus) -> str:
    """``Autopilot | trial 3 of <= 8: optimizer_fused, numerics probe | best 1.42x | 12.3 s of 40.0 s``."""
    if status.trial is not None:
        of = f" of <= {status.max_trials}" if status.max_trials else ""
        what = f"trial {status.trial}{of}: {status.candidate}, {status.phase}"
    else:
        what = status.phase
    parts = [f"Autopilot | {what}"]
    if status.best_speedup is not None:
        parts.append(f"best {status.best_speedup:.2f}x")
    budget = f" of {status.budget_seconds:.1f} s" if status.budget_seconds is not None else ""
    parts.append(f"{status.spent_seconds:.1f} s{budget}")
    return " | ".join(parts)


def format_row(record: TrialRecord) -> str:
    """The final table's row of one trial, as one line."""
    change = record.change if record.index else "baseline (as configured)"
    rate = f"{record.samples_per_sec:,.1f} samples/s" if record.samples_per_sec else "—"
    vs = f"{record.vs_baseline:.2f}x baseline" if record.vs_baseline else "—"
    kept = "kept" if record.kept and record.index else ("baseline" if not record.index else "not kept")
    return f"Autopilot trial {record.index}: {change} | {rate} | {vs} | {kept} | {record.reason}"


class SearchDisplay:
    """The live view (see the module docstring). ``enabled=False`` (``print_summary=False``, other ranks): silent;
    ``on_record`` still runs (the per-trial logger keys)."""

    def __init__(
        self, *, enabled: bool, live: bool, on_record: Callable[[TrialRecord], None] | None = None, file: Any = None
    ) -> None:
        self.enabled, self.live = enabled, live
        self.on_record = on_record
        self._file = file
        self._console: Any = None
        self._live: Any = None
        self._last = ""

    def _out(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(
                file=self._file or sys.stdout,
                force_terminal=self.live or None,
                width=None if self.live else 200,
                highlight=False,
            )
        return self._console

    def phase(self, status: SearchStatus) -> None:
        if not self.enabled:
            return
        text = format_status(status)
        if self.live:
            from rich.live import Live
            from rich.text import Text

            if self._live is None:
                self._live = Live(Text(text), console=self._out(), transient=True, auto_refresh=False)
                self._live.start()
            self._live.update(Text(text), refresh=True)
        elif text.split(" | ")[1:2] != self._last.split(" | ")[1:2]:  # plain: one line per phase
            self._out().print(text, markup=False, soft_wrap=True)
        self._last = text

    def record(self, record: TrialRecord) -> None:
        if self.enabled:
            self._out().print(format_row(record), markup=False, soft_wrap=True)
        if self.on_record is not None:
            self.on_record(record)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
