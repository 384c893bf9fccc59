"""NVTX ranges for the doctor's stages, in a ``lightning_accel`` domain, so an nsys timeline shows which stage
launched each kernel (framework-free: torch and, when installed, NVIDIA's ``nvtx`` package).

:class:`StageRanges` is called at the stage boundaries only; :func:`nvtx_range` is the same emitter as a context
manager. Opt-in, skipped while compiling. The manual: ``docs/measuring/traces.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["DOMAIN", "NvtxBackend", "SearchPhaseRanges", "StageRanges", "nvtx_range", "nvtx_unavailable"]

#: the NVTX domain of every range this package emits
DOMAIN = "lightning_accel"


class NvtxBackend(Protocol):
    """What :class:`StageRanges` calls (the ``nvtx`` package's functions, or a mock in tests)."""

    def push_range(self, message: str, domain: str) -> None: ...
    def pop_range(self, domain: str) -> None: ...
    def start_range(self, message: str, domain: str) -> Any: ...
    def end_range(self, handle: Any) -> None: ...


class _NvtxPackage:
    """NVIDIA's ``nvtx`` package: ranges in a named domain."""

    def __init__(self, module: Any) -> None:
        self._nvtx = module

    def push_range(self, message: str, domain: str) -> None:
        self._nvtx.push_range(message, domain=domain)

    def pop_range(self, domain: str) -> None:
        self._nvtx.pop_range(domain=domain)

    def start_range(self, message: str, domain: str) -> Any:
        return self._nvtx.start_range(message, domain=domain)

    def end_range(self, handle: Any) -> None:
        self._nvtx.end_range(handle)


class _TorchNvtx:
    """``torch.cuda.nvtx`` (no domains: the domain becomes a name prefix)."""

    def push_range(self, message: str, domain: str) -> None:
        torch.cuda.nvtx.range_push(f"{domain}/{message}")

    def pop_range(self, domain: str) -> None:
        torch.cuda.nvtx.range_pop()

    def start_range(self, message: str, domain: str) -> Any:
        return torch.cuda.nvtx.range_start(f"{domain}/{message}")

    def end_range(self, handle: Any) -> None:
        torch.cuda.nvtx.range_end(handle)


def nvtx_unavailable() -> str | None:
    """Why no NVTX range can be emitted here, with the install that fixes it; ``None`` when ranges work.

    Ranges need NVIDIA's ``nvtx`` package or a CUDA build of torch: a CPU-only torch's ``torch.cuda.nvtx`` raises
    on every call.
    """
    try:
        import nvtx  # noqa: F401
    except ImportError:
        pass
    else:
        return None
    if torch.version.cuda is not None:
        return None
    return (
        f"torch {torch.__version__} is a CPU-only build and the nvtx package is not installed: "
        "pip install nvtx (or install a CUDA build of torch) to get the ranges"
    )


def _default_backend() -> NvtxBackend:
    try:
        import nvtx
    except ImportError:
        return _TorchNvtx()
    return _NvtxPackage(nvtx)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


class StageRanges:
    """Emits the doctor's stages as NVTX ranges (docs/measuring/traces.md, How the ranges are emitted).

    Args:
        domain: the NVTX domain (default ``"lightning_accel"``).
        backend: where the calls go (default: the ``nvtx`` package, else ``torch.cuda.nvtx``); tests pass a mock.
    """

    def __init__(self, *, domain: str = DOMAIN, backend: NvtxBackend | None = None) -> None:
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"StageRanges(domain={domain!r}): give a non-empty name, e.g. 'lightning_accel'")
        self.domain = domain
        self.backend = backend if backend is not None else _default_backend()
        self._open: list[str] = []  # pushed and not popped yet (what a cancel or a finish pops)

    def switch(self, old: str | None, new: str | None) -> None:
        """A stage boundary: close ``old``'s range (if this emitter opened it), open ``new``'s."""
        if _compiling():
            return
        if old is not None and self._open and self._open[-1] == old:
            self._open.pop()
            self.backend.pop_range(self.domain)
        if new is not None:
            self.backend.push_range(new, self.domain)
            self._open.append(new)

    def close_all(self) -> None:
        """Pop every range still open (a cancelled step, the end of the fit): the pushes and pops stay balanced."""
        while self._open:
            self._open.pop()
            self.backend.pop_range(self.domain)

    def start(self, name: str) -> Any:
        """Open a range that may end on another thread (a bucket's all-reduce); returns its handle (or None)."""
        if _compiling():
            return None
        return self.backend.start_range(name, self.domain)

    def end(self, handle: Any) -> None:
        """Close a range opened by :meth:`start` (a ``None`` handle is ignored)."""
        if handle is not None:
            self.backend.end_range(handle)

    @property
    def open_ranges(self) -> list[str]:
        """The pushed ranges not popped yet, outermost first."""
        return list(self._open)


@contextlib.contextmanager
def nvtx_range(name: str, ranges: StageRanges | None = None) -> Iterator[None]:
    """``with nvtx_range("autopilot/trial compile"):`` — one NVTX range around a block (the Autopilot's trials).

    Args:
        name: the range's name.
        ranges: the emitter to use (default: a new one in the ``lightning_accel`` domain); ``None`` handling is
            the caller's: pass an emitter only when NVTX is on.
    """
    emitter = ranges if ranges is not None else StageRanges()
    if _compiling():
        yield
        return
    emitter.backend.push_range(name, emitter.domain)
    try:
        yield
    finally:
        emitter.backend.pop_range(emitter.domain)


class SearchPhaseRanges:
    """The Autopilot's search phases as NVTX ranges, one open at a time (``autopilot/measuring compile``), around
    another progress view it forwards to (the live line). Used by ``Autopilot(nvtx=True)``; framework-free: it only
    needs ``phase(status)`` / ``record(record)`` / ``close()`` and a status with ``phase`` and ``candidate``.

    Args:
        inner: the progress view to forward to (its ``close()`` is called too, when it has one).
        ranges: the emitter (default: a new :class:`StageRanges` in the ``lightning_accel`` domain); tests pass
            one with a mock backend.
    """

    def __init__(self, inner: Any, ranges: StageRanges | None = None) -> None:
        self.inner = inner
        self.ranges = ranges if ranges is not None else StageRanges()
        self._name: str | None = None

    def phase(self, status: Any) -> None:
        name = f"autopilot/{status.phase}" + (f" {status.candidate}" if status.candidate else "")
        if name != self._name:
            self.ranges.switch(self._name, name)
            self._name = name
        self.inner.phase(status)

    def record(self, record: Any) -> None:
        self.inner.record(record)

    def close(self) -> None:
        self.ranges.close_all()
        self._name = None
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
