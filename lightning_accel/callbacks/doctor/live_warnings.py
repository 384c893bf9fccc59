"""The doctor's live warnings (rank 0): a finding when it is new, came back or its fix changed, each rule at most
every ``interval_s`` seconds; a new finding also asks a ``ProfileWindow`` among the callbacks for a trace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities import rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.core.rules import Finding

__all__ = ["LiveWarnings", "warn_smell"]


class LiveWarnings:
    """Which findings of a window to warn, and the warning; state: the rules of the last window and each rule's
    last warned fix and time."""

    def __init__(self) -> None:
        self._active: set[str] = set()  # rules found in the last window
        self._warned: dict[str, tuple[str, float]] = {}  # rule -> (fix, time) of its last warning

    def due(self, findings: list[Finding], now: float, interval_s: float) -> list[Finding]:
        """The findings to warn at ``now`` (recorded as warned): new, come back, or with another fix, and not
        warned within ``interval_s``."""
        due = []
        for f in findings:
            last = self._warned.get(f.rule)
            changed = f.rule not in self._active or (last is not None and last[0] != f.fix)
            if not changed or (last is not None and now - last[1] < interval_s):
                continue
            self._warned[f.rule] = (f.fix, now)
            due.append(f)
        self._active = {f.rule for f in findings}
        return due

    def warn(self, trainer: pl.Trainer, findings: list[Finding], now: float, interval_s: float) -> None:
        """Warn the due findings on rank 0; every rank asks for a trace (all see the same gathered findings)."""
        for f in self.due(findings, now, interval_s):
            request_trace(trainer, f)
            if trainer.is_global_zero:
                rank_zero_warn(
                    f"BottleneckDoctor: {f.stage} is holding the run back: {f.evidence} Fix: {f.fix}",
                    category=UserWarning,
                )


def request_trace(trainer: pl.Trainer, finding: Finding) -> None:
    """Ask a ``ProfileWindow`` among the callbacks for a trace of the next steps (every rank sees the same
    gathered findings, so every rank asks): the numbers say which stage, the trace says which ops."""
    from lightning_accel.callbacks.profile_window import ProfileWindow

    for cb in trainer.callbacks:
        if isinstance(cb, ProfileWindow):
            cb.request(f"BottleneckDoctor finding: {finding}")


def warn_smell(trainer: pl.Trainer, finding: Finding) -> None:
    """One code smell's warning (rank 0)."""
    if trainer.is_global_zero:
        rank_zero_warn(
            f"BottleneckDoctor: code smell {finding.rule}: {finding.evidence} Fix: {finding.fix}", category=UserWarning
        )
