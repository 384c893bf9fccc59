"""The fixes the Autopilot can apply and undo, each built on the existing component that implements it.

An :class:`Intervention` is one machine-applicable change: ``unavailable(run)`` says why it cannot apply (or
``None``), ``apply(run)`` changes the run in place and returns its :class:`~lightning_accel.core.autopilot.Undo`
(built-ins implement ``change(run, undo)``, pushing the undo of each part as they make it, so an apply that raises
halfway leaves nothing applied; ``revert(run)`` runs the last undo), ``describe(run)`` names the change
for the table, ``config(run)`` gives its LightningCLI keys and Python lines, and ``params`` are what a plan stores to
replay it. ``kind`` decides the numerics tolerance (``lightning_accel.core.autopilot.NUMERICS_KINDS``) and
``knobs`` the user settings it touches (``Autopilot(freeze=[...])`` names them).

One concern per module: ``base`` (:class:`Run`, :class:`Intervention`), ``data``, ``batch``, ``optimizer``,
``precision`` (the autocast dtype and TF32), ``compile``, ``float8``, ``attention``, ``loss`` (the fused cross-entropy),
``memory_format`` (channels_last), ``activation_checkpointing``,
``compression`` (with its link measurement and the projection's choice) and ``checkpoint_io`` (the background
checkpoint writer, trialled after the step search); this package holds the registry
(:data:`INTERVENTIONS`, :func:`knob_names`) and re-exports every name, so imports from
``lightning_accel.callbacks.autopilot.fixes`` need not know the module.

============================  ===========================================  ==============================  =============
name                          change                                       built on                        kind
============================  ===========================================  ==============================  =============
``dataloader``                num_workers / prefetch_factor /              ``DataLoaderTuner``'s search    data
                              persistent_workers
``pin_memory``                pin_memory=True (CUDA)                       the DataLoader                  data
``prefetch``                  background prefetch (+ side-stream copies)   ``DevicePrefetcher``            data
``micro_batch``               micro-batch ×f, accumulation ÷f (global      ``BatchSizeTuner``'s attribute  reorder
                              batch fixed): ×2, then a jump to one         lookup
                              micro-batch per step
``optimizer_fused``           ``fused=True`` optimizer step                torch.optim                     reorder
``optimizer_foreach``         ``foreach=True`` optimizer step              torch.optim                     exact
``precision``                 bf16 (fp16 + scaler where bf16 is missing)   ``AutoMixedPrecision``,         low_precision
                              from Lightning's default ``32-true``, or     installed by the Autopilot
                              another dtype of the user's plugin
``tf32``                      TF32 matmuls for a run that stays fp32       ``torch.set_float32_matmul_``   reorder
                              (CUDA, compute capability >= 8.0)            ``precision("high")``
``compile``                   torch.compile in place (pays back or not)    ``TorchCompile``                reorder
``float8``                    large linear layers in FP8, after bf16 and   ``Float8Training`` (torchao)    low_precision
                              compile (CUDA, compute capability >= 8.9)
``fused_attention``           hand-written attention → SDPA                ``use_fused_attention``         reorder
``fused_cross_entropy``       a Hugging Face causal LM's loss without its  ``use_fused_linear_cross_``      reorder
                              logits (when ``large_vocab_loss`` fires)     ``entropy``
``channels_last``             2-D convolution weights to NHWC (CUDA, one   ``Tensor.contiguous(memory_``   reorder
                              process)                                     ``format=channels_last)``
``activation_checkpointing``    recompute blocks + larger micro-batch        ``core.checkpointing``          reorder
``compression``               16-bit gradient all-reduce (DDP), or         ``ddp_bf16_compress``'s hook    low_precision
                              Top-K / QSGD where ``project_scaling``       (``ddp_topk`` / ``ddp_qsgd``'s
                              ranks them ahead for the link and ranks      hooks)
``async_checkpoint``          checkpoints written in a background thread   ``OrderedAsyncCheckpointIO``    exact
                              (trialled after the step search, on fits
                              whose saves cost >= 5 %)
============================  ===========================================  ==============================  =============
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
