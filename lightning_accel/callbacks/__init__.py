"""Lightning callbacks: thin adapters over :mod:`lightning_accel.core`, one per file. Every callback of the
collection is importable from here."""

from lightning_accel.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.callbacks.batch_size_tuner import BatchSizeTuner
from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner
from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor
from lightning_accel.callbacks.mfu_monitor import MFUMonitor
from lightning_accel.callbacks.non_finite_guard import NonFiniteGuard
from lightning_accel.callbacks.nsys_capture import NsysCapture
from lightning_accel.callbacks.profile_window import ProfileWindow
from lightning_accel.callbacks.torch_compile import TorchCompile

__all__ = [
    "ActivationCheckpointing",
    "Autopilot",
    "BatchSizeTuner",
    "BottleneckDoctor",
    "DataLoaderTuner",
    "DevicePrefetcher",
    "MFUMonitor",
    "NonFiniteGuard",
    "NsysCapture",
    "ProfileWindow",
    "TorchCompile",
]
