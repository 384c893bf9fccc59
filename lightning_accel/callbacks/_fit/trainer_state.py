"""Small readers of Trainer state shared by the callbacks (public Trainer API only)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "agree_across_ranks",
    "compute_dtype",
    "gather_floats",
    "gather_outcomes",
    "rank_zero_print",
    "steps_per_epoch",
    "sync_fn",
]


def compute_dtype(trainer: pl.Trainer) -> str:
    """The dtype the matmuls of this run use, as a name the peak table knows (fp32/tf32/bf16/fp16/fp64/fp8).

    A precision plugin may say it directly with a ``compute_dtype`` attribute (``AutoMixedPrecision`` does), and so
    may a callback (``Float8Training``, once it converted layers);
    otherwise it is read from ``trainer.precision`` ("bf16-mixed" → bf16, "16-mixed" → fp16, "32-true" → fp32,
    or tf32 on an Ampere-or-newer GPU when ``torch.get_float32_matmul_precision()`` is not "highest").
    """
    from lightning_accel.core.peak import normalize_dtype

    # a callback that moves the matmuls to another dtype says so the same way (Float8Training: "fp8")
    for callback in trainer.callbacks:
        declared = getattr(callback, "compute_dtype", None)
        if isinstance(declared, str):
            return normalize_dtype(declared)
    declared = getattr(trainer.precision_plugin, "compute_dtype", None)
    if declared is not None:
        return normalize_dtype(declared)
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    if precision.startswith("transformer-engine"):
        return "fp8"
    device = trainer.strategy.root_device
    if (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 8
        and torch.get_float32_matmul_precision() != "highest"
    ):
        return "tf32"
    return "fp32"


def sync_fn(device: torch.device) -> Any:
    """A no-argument function that waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def gather_floats(
    trainer: pl.Trainer, device: torch.device, values: list[float], what: str = "lightning_accel"
) -> torch.Tensor:
    """Every rank's ``values`` as a ``(world_size, len(values))`` float64 tensor on the CPU (one collective).

    Bounded: a rank that died or hangs makes this raise ``core.collectives.RankFailure`` naming it (on gloo) within
    ``LIGHTNING_ACCEL_COLLECTIVE_TIMEOUT_S`` (300 s), instead of waiting for the process group's 30 minutes.
    """
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if trainer.world_size <= 1:
        return local.unsqueeze(0).cpu()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from lightning_accel.core.collectives import all_gather_bounded

        return all_gather_bounded(local, what=what).reshape(trainer.world_size, len(values)).cpu()
    gathered = trainer.strategy.all_gather(local)
    return gathered.reshape(trainer.world_size, len(values)).cpu()


def gather_outcomes(
    trainer: pl.Trainer, value: float, error: BaseException | None, what: str
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``value`` (a float64 CPU tensor, one entry a rank) and the ranks that passed an ``error``, in one
    collective. Each rank must call this even when it failed, or the others would wait in the collective forever."""
    rows = gather_floats(trainer, trainer.strategy.root_device, [value, 0.0 if error is None else 1.0], what=what)
    return rows[:, 0], [r for r in range(rows.shape[0]) if rows[r, 1] > 0]


def agree_across_ranks(trainer: pl.Trainer, value: float, error: BaseException | None, who: str) -> torch.Tensor:
    """Every rank's ``value`` (:func:`gather_outcomes`), after which a rank's own ``error`` is raised; if another rank
    failed, a ``RuntimeError`` says which."""
    values, failed = gather_outcomes(trainer, value, error, who)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{who}: failed on rank(s) {failed}; see their error")
    return values


def steps_per_epoch(trainer: pl.Trainer, batches: int, accumulate: int) -> int:
    """Optimizer steps of one epoch over a loader of ``batches`` batches: ``limit_train_batches`` applied (a
    fraction or a count), then ``accumulate`` micro-batches per step (the last, partial group steps too)."""
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit <= 1.0:
        batches = int(batches * limit)
    elif isinstance(limit, int):
        batches = min(batches, limit)
    return math.ceil(batches / max(1, accumulate))


def rank_zero_print(trainer: pl.Trainer, renderable: Any) -> None:
    """Print a rich renderable (table, text) on global rank 0 only."""
    if trainer.is_global_zero:
        from rich.console import Console

        Console().print(renderable)
