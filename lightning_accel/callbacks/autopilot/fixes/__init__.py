"""The fixes the Autopilot can apply and undo, each built on the existing component that implements it.

One concern per module (``base``: :class:`Run`, :class:`Intervention`; one module per fix or family); this package
holds the registry (:data:`INTERVENTIONS`, :func:`knob_names`) and re-exports every name, so imports need not know
the module. The contract of a fix, and every fix with its kind: ``docs/autopilot.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_accel.callbacks.autopilot.fixes.activation_checkpointing import ActivationCheckpointingWithLargerBatch
from lightning_accel.callbacks.autopilot.fixes.attention import FusedAttention
from lightning_accel.callbacks.autopilot.fixes.base import Intervention, Run
from lightning_accel.callbacks.autopilot.fixes.batch import MicroBatch
from lightning_accel.callbacks.autopilot.fixes.checkpoint_io import AsyncCheckpoint
from lightning_accel.callbacks.autopilot.fixes.compile import Compile
from lightning_accel.callbacks.autopilot.fixes.compression import (
    COMPRESSION_STRATEGIES,
    MIN_PROJECTED_GAIN,
    Compression,
    SwitchableCompression,
    choose_compression,
    measure_link,
)
from lightning_accel.callbacks.autopilot.fixes.data import DataLoaderSettings, PinMemory, Prefetch
from lightning_accel.callbacks.autopilot.fixes.float8 import Float8
from lightning_accel.callbacks.autopilot.fixes.loss import FusedCrossEntropy
from lightning_accel.callbacks.autopilot.fixes.memory_format import ChannelsLast
from lightning_accel.callbacks.autopilot.fixes.optimizer import (
    ForeachOptimizer,
    FusedOptimizer,
    OptimizerImplementation,
)
from lightning_accel.callbacks.autopilot.fixes.precision import MixedPrecisionDtype, Tf32Matmul

__all__ = [
    "COMPRESSION_STRATEGIES",
    "INTERVENTIONS",
    "MIN_PROJECTED_GAIN",
    "ActivationCheckpointingWithLargerBatch",
    "AsyncCheckpoint",
    "ChannelsLast",
    "Compile",
    "Compression",
    "DataLoaderSettings",
    "Float8",
    "ForeachOptimizer",
    "FusedAttention",
    "FusedCrossEntropy",
    "FusedOptimizer",
    "Intervention",
    "MicroBatch",
    "MixedPrecisionDtype",
    "OptimizerImplementation",
    "PinMemory",
    "Prefetch",
    "Run",
    "SwitchableCompression",
    "Tf32Matmul",
    "choose_compression",
    "knob_names",
    "measure_link",
]


#: Built-in interventions by name, in the order the table lists them.
INTERVENTIONS: dict[str, Callable[..., Intervention]] = {
    cls.name: cls
    for cls in (
        DataLoaderSettings,
        PinMemory,
        Prefetch,
        MicroBatch,
        FusedOptimizer,
        ForeachOptimizer,
        MixedPrecisionDtype,
        Tf32Matmul,
        Compile,
        Float8,
        FusedAttention,
        FusedCrossEntropy,
        ChannelsLast,
        ActivationCheckpointingWithLargerBatch,
        Compression,
        AsyncCheckpoint,
    )
}


def knob_names() -> list[str]:
    """Every knob a built-in intervention touches (the valid entries of ``Autopilot(freeze=...)``)."""
    return sorted({k for cls in INTERVENTIONS.values() for k in cls.knobs})  # type: ignore[attr-defined]
