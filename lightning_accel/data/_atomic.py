"""Atomic file writes for the packers: write a temporary file in the target folder, fsync, ``os.replace``.

A reader (or a resumed pack) therefore sees either the complete file or none: an interrupted pack leaves no
half-written shard, only whole shards and, if the interruption came before the end, no index file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_write_json", "fsync_dir", "progress"]

TMP_PREFIX = ".tmp-"


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success it is fsynced and renamed to ``final``.

    On any exception (including KeyboardInterrupt) the temporary file is removed and ``final`` is untouched.
    """
    final = Path(final)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_open(final: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """``open`` for writing, through :func:`atomic_path`."""
    with atomic_path(final) as tmp, open(tmp, mode) as f:
        yield f


def atomic_write_json(final: Path, obj: Any) -> None:
    with atomic_open(final, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


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

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), transient=False)
        self._task = self._progress.add_task(description, total=total or None)  # None: unknown length

    def __enter__(self) -> _RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)
