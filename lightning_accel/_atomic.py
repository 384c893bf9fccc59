"""Atomic file writes: write a temporary file in the target folder, fsync, ``os.replace``.

A reader (or a resumed pack) therefore sees either the complete file or none: an interrupted pack leaves no
half-written shard, only whole shards and, if the interruption came before the end, no index file; a report, a
plot or a profiler trace is never half-written. The one way every writer of the package writes a file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_open", "atomic_path", "atomic_write_json", "atomic_write_text", "fsync_dir"]

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
    """``obj`` as indented JSON (one value per line at the top level), through :func:`atomic_path`."""
    with atomic_open(final, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def atomic_write_text(final: Path, text: str) -> None:
    """``text`` into ``final``, through :func:`atomic_path`."""
    with atomic_open(final, "w") as f:
        f.write(text)
