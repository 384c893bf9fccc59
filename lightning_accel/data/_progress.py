"""A rich progress bar for the packers, or a silent stand-in."""

from __future__ import annotations

from typing import Any

__all__ = ["progress"]


def progress(total: int, description: str, enabled: bool) -> Any:
    """A rich progress bar (a context manager with ``advance(n)``), or a silent stand-in."""
    if not enabled:
        return _NoProgress()
    return _RichProgress(total, description)


class _NoProgress:
    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def advance(self, n: int = 1) -> None:
        return None


class _RichProgress:
    def __init__(self, total: int, description: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=False
        )
        self._task = self._progress.add_task(description, total=total or None)  # None: unknown length

    def __enter__(self) -> _RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)
