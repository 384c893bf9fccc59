"""Run facts for BottleneckDoctor: what the rules and smells need to know about the Trainer, read once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.callbacks._fit.trainer_state import compute_dtype
from lightning_accel.core.rules import RunContext

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "first_loader",
    "fit_settings",
    "nvml_index",
    "precision_stats",
    "read_dataloader_settings",
    "static_context",
]


def static_context(trainer: pl.Trainer, device: torch.device) -> RunContext:
    """Device, dtype, world size, cores, accumulation and the first optimizer's class and flags."""
    from lightning_accel.core.utilisation import usable_cpu_count

    ctx = RunContext(
        device_type=device.type,
        device_name=str(device),
        world_size=trainer.world_size,
        cpu_count=usable_cpu_count(),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
    )
    if device.type == "cuda":
        ctx.device_name = torch.cuda.get_device_name(device)
        ctx.device_capability = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
    try:
        ctx.compute_dtype = compute_dtype(trainer)
    except Exception:  # noqa: BLE001 - an exotic precision plugin: the dtype rules are skipped
        ctx.compute_dtype = None
    if trainer.optimizers:
        opt = trainer.optimizers[0]
        ctx.optimizer = type(opt).__name__
        defaults = getattr(opt, "defaults", {}) or {}
        if "fused" in defaults:
            ctx.optimizer_fused = bool(defaults["fused"])
        if "foreach" in defaults:
            ctx.optimizer_foreach = defaults["foreach"] if defaults["foreach"] is None else bool(defaults["foreach"])
    fit_settings(trainer, ctx)
    return ctx


def fit_settings(trainer: pl.Trainer, ctx: RunContext) -> None:
    """Logging, validation and checkpoint cadence into ``ctx`` (for the fit and variability findings)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    ctx.log_every_n_steps = trainer.log_every_n_steps
    interval = trainer.val_check_interval
    ctx.val_check_interval = interval if isinstance(interval, int) else float(interval)
    ctx.check_val_every_n_epoch = trainer.check_val_every_n_epoch
    limit = trainer.limit_val_batches
    ctx.limit_val_batches = limit if isinstance(limit, int) else float(limit)
    checkpoint = next((cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)), None)
    if checkpoint is not None:
        from lightning_accel._compat import checkpoint_every_n_train_steps

        ctx.checkpoint_every_n_train_steps = checkpoint_every_n_train_steps(checkpoint) or None
    ctx.async_checkpoint = isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO)


def nvml_index(cuda_index: int) -> int:
    """NVML numbers all GPUs; CUDA only the visible ones. Map through CUDA_VISIBLE_DEVICES when it lists indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if cuda_index < len(parts) and parts[cuda_index].isdigit():
            return int(parts[cuda_index])
    return cuda_index


def first_loader(loaders: Any) -> Any:
    """The first ``DataLoader`` or pipeline with ``pipeline_settings`` in ``loaders`` (lists/dicts nested), or
    ``None``."""
    from torch.utils.data import DataLoader

    stack = [loaders]
    while stack:
        item = stack.pop(0)
        if isinstance(getattr(item, "pipeline_settings", None), Mapping) or isinstance(item, DataLoader):
            return item
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def read_dataloader_settings(loaders: Any, ctx: RunContext) -> Any:
    """Settings of the (first) training loader into ``ctx``; returns that loader (or ``None``).

    A ``DataLoader``'s workers and prefetching, or the ``pipeline_settings`` mapping a non-DataLoader pipeline
    publishes (``DALIImageDataModule``'s loader: ``loader``, ``decode_device``, ``loader_threads``,
    ``prefetch_queue_depth``), so that the data finding names that pipeline's own knobs.
    """
    item = first_loader(loaders)
    settings = getattr(item, "pipeline_settings", None)
    if isinstance(settings, Mapping):
        for key in ("loader", "decode_device", "loader_threads", "prefetch_queue_depth"):
            if key in settings:
                setattr(ctx, key, settings[key])
    elif item is not None:
        ctx.loader = "DataLoader"
        ctx.num_workers = item.num_workers
        ctx.pin_memory = bool(item.pin_memory)
        ctx.prefetch_factor = item.prefetch_factor if item.num_workers > 0 else None
        ctx.persistent_workers = bool(item.persistent_workers) if item.num_workers > 0 else None
    return item


def precision_stats(trainer: pl.Trainer) -> dict[str, Any]:
    """``loss_scale``, ``skipped_steps``, ``total_steps`` of the precision plugin when it exposes them
    (``AutoMixedPrecision`` does)."""
    plugin = trainer.precision_plugin
    out: dict[str, Any] = {}
    for name in ("loss_scale", "skipped_steps", "total_steps"):
        value = getattr(plugin, name, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out
