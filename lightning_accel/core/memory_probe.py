"""Peak memory of a block of work: the CUDA allocator's peak on GPUs, the process's peak resident set on CPUs.

The batch size search needs the peak a training step reaches, which the current memory misses. What each device
counts, and where the CPU peak can only be sampled (:attr:`PeakMemoryMeter.exact` ``False``): see
docs/techniques/batch-size.md (How peak memory is measured). Nothing here imports Lightning.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

__all__ = ["PeakMemoryMeter", "device_memory_capacity", "peak_rss_bytes", "reset_peak_rss"]

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def reset_peak_rss() -> None:
    """Reset this process's peak resident set size (``VmHWM``) to the current RSS (Linux >= 4.0 only).

    Writes ``5`` to ``/proc/self/clear_refs`` (``man 5 proc``). Raises ``OSError`` elsewhere.
    """
    _CLEAR_REFS.write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak resident set size since start or the last :func:`reset_peak_rss` (Linux ``VmHWM``)."""
    match = _HWM.search(_STATUS.read_text())
    if match is None:
        raise OSError("no VmHWM line in /proc/self/status")
    return int(match.group(1)) * 1024  # reported in kB


def _linux_peak_reset_works() -> bool:
    try:
        reset_peak_rss()
        peak_rss_bytes()
        return True
    except OSError:
        return False


def _current_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakMemoryMeter:
    """Measures the peak memory between :meth:`reset` and :meth:`peak_bytes` on one device.

    Args:
        device: a CUDA device (allocator peak) or the CPU (process peak RSS).

    Example::

        meter = PeakMemoryMeter(torch.device("cpu"))
        meter.reset()
        run_step()
        print(meter.peak_bytes())
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.exact = True
            self.source = "torch.cuda.max_memory_allocated"
        elif self.device.type == "cpu":
            self.exact = _linux_peak_reset_works()
            self.source = (
                "process peak RSS (/proc/self/status VmHWM, reset via /proc/self/clear_refs)"
                if self.exact
                else "process RSS sampled after the step (psutil; transient peaks are missed)"
            )
        else:
            raise ValueError(
                f"PeakMemoryMeter(device={str(self.device)!r}): only 'cuda' and 'cpu' devices are supported"
            )

    def reset(self) -> None:
        """Start a new measuring interval (frees nothing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.exact:
            reset_peak_rss()

    def peak_bytes(self) -> int:
        """Peak bytes since the last :meth:`reset` (docs/techniques/batch-size.md says what is counted)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.exact:
            return peak_rss_bytes()
        return _current_rss()

    def current_bytes(self) -> int:
        """Bytes in use now: allocated tensors on CUDA, resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return _current_rss()


def device_memory_capacity(device: torch.device | str) -> int:
    """Memory the process can use on ``device``, in bytes.

    CUDA: the device's total memory (``torch.cuda.mem_get_info``), which other processes may be sharing. CPU: this
    process's resident set plus the memory the OS reports available (``psutil.virtual_memory().available``), i.e.
    what it could grow to without swapping or being killed.
    """
    device = torch.device(device)
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        return int(total)
    import psutil

    return _current_rss() + int(psutil.virtual_memory().available)
