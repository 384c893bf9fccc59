"""The doctor's live window log (rank 0): one JSON line per measuring window, the file ``lightning-accel watch``
follows (``core/window_log.py`` writes and reads the lines). See ``docs/measuring/doctor.md``, "A live view"."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_accel.core.window_log import WindowLogWriter

if TYPE_CHECKING:
    from lightning_accel.core.breakdown import WindowBreakdown
    from lightning_accel.core.rules import Finding

__all__ = ["LiveLog"]


class LiveLog:
    """The window log of the current fit: open from the fit's start to its end, or not at all."""

    def __init__(self) -> None:
        self.writer: WindowLogWriter | None = None

    @property
    def is_open(self) -> bool:
        return self.writer is not None

    def start(self, path: Path, *, world_size: int, window: int) -> bool:
        """Open the log at ``path``; ``False``, with a warning, when it cannot."""
        try:
            self.writer = WindowLogWriter(path)
            self.writer.write("start", world_size=world_size, window=window, pid=os.getpid())
        except OSError as err:  # a live view must not stop the fit
            self.writer = None
            warnings.warn(f"BottleneckDoctor: no window log at {path} ({err})", stacklevel=2)
            return False
        return True

    def window(self, *, batch: int, window: WindowBreakdown, mfu: float | None, findings: list[Finding]) -> None:
        """One gathered window: its shares, step time, throughput, MFU and findings."""
        if self.writer is None:
            return
        self.writer.write(
            "window",
            batch=batch,
            shares=window.shares,
            step_ms=1e3 * window.step_seconds,
            samples_per_sec=window.samples_per_sec,
            mfu=mfu,
            findings=[
                {"stage": f.stage, "rule": f.rule, "evidence": f.evidence, "fix": f.fix, "value": f.value}
                for f in findings
            ],
        )

    def end(self, status: str | None, files: list[Path]) -> None:
        """Close the log; with a ``status``, its last line names the report among ``files`` (the page if any)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        try:
            if status is not None:
                pages = [f for f in files if f.suffix == ".html"] + files
                writer.write("end", status=status, report=str(pages[0]) if pages else None)
        finally:
            writer.close()
