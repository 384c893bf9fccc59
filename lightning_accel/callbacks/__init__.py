"""Lightning callbacks: thin adapters over :mod:`lightning_accel.core`, one per file."""

from lightning_accel.callbacks.bottleneck_doctor import BottleneckDoctor
from lightning_accel.callbacks.mfu_monitor import MFUMonitor

__all__ = ["BottleneckDoctor", "MFUMonitor"]
