"""Lightning callbacks: thin adapters over :mod:`lightning_accel.core`, one per file."""

from lightning_accel.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_accel.callbacks.bottleneck_doctor import BottleneckDoctor
from lightning_accel.callbacks.mfu_monitor import MFUMonitor
from lightning_accel.callbacks.non_finite_guard import NonFiniteGuard
from lightning_accel.callbacks.torch_compile import TorchCompile

__all__ = ["ActivationCheckpointing", "BottleneckDoctor", "MFUMonitor", "NonFiniteGuard", "TorchCompile"]
