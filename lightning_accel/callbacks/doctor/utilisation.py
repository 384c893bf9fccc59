"""The doctor's utilisation samplers: CPU (psutil) and, on CUDA with NVML, GPU, started once per fit and read when
a window closes (``core.utilisation``); a sampler that cannot start is a note in the report, never an error."""

from __future__ import annotations

from typing import Any

import torch

from lightning_accel.callbacks.doctor.facts import nvml_index

__all__ = ["UtilisationSamplers"]


class UtilisationSamplers:
    """The CPU and GPU samplers of one fit (either ``None`` when not sampled)."""

    def __init__(self) -> None:
        self.cpu: Any = None
        self.gpu: Any = None

    def create(self, device: torch.device, notes: list[str]) -> None:
        """Make the samplers this machine allows; what is missing goes to ``notes``."""
        from lightning_accel._imports import is_available
        from lightning_accel.core.utilisation import CpuUtilisation, GpuUtilisation

        try:
            self.cpu = CpuUtilisation()
        except Exception as err:  # noqa: BLE001 - e.g. psutil missing or restricted /proc
            notes.append(f"CPU utilisation not sampled: {err!r}")
        if device.type != "cuda":
            return
        if not is_available("pynvml"):
            notes.append("GPU utilisation not sampled: NVML not installed (pip install 'lightning-accel[nvml]')")
            return
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.gpu = GpuUtilisation(nvml_index(index))
        except Exception as err:  # noqa: BLE001 - NVML present but unusable (container, MIG)
            notes.append(f"GPU utilisation not sampled: NVML failed ({err!r})")

    def skip_workers(self) -> None:
        """No worker processes (or a threaded pipeline): skip the /proc walk for their CPU."""
        if self.cpu is not None:
            self.cpu.track_workers = False

    def start(self) -> None:
        if self.cpu is not None:
            self.cpu.start()
        if self.gpu is not None:
            self.gpu.start()

    def sample(self) -> dict[str, float]:
        """The window's readings since the last sample."""
        util: dict[str, float] = {}
        if self.cpu is not None:
            util.update(self.cpu.sample() or {})
        if self.gpu is not None:
            util.update(self.gpu.sample())
        return util
