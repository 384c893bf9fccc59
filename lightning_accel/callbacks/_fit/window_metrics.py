"""Window metrics to the loggers, ``callback_metrics`` and the progress bar without ``pl_module.log``'s per-key cost.

``pl_module.log`` costs ~0.2-1.5 ms per key on a CPU (result-collection bookkeeping, a tensor per value, a device
check): most of the doctor's and MFUMonitor's in-hook time. A window's metrics are plain floats computed once per
window, so one call puts them where ``self.log(..., on_step=True)`` would. See docs/measuring/mfu.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["log_window"]


def log_window(
    trainer: pl.Trainer, pl_module: pl.LightningModule, values: Mapping[str, float], prog_bar: Collection[str] = ()
) -> None:
    """Log one window's ``values`` (key → float) as ``pl_module.log(key, value, on_step=True)`` would show them.

    ``trainer.callback_metrics`` (what ``ModelCheckpoint(monitor=...)`` / ``EarlyStopping`` read) and, for
    ``prog_bar`` keys, ``trainer.progress_bar_metrics`` are reached through the Trainer's public properties (they
    return Lightning's own dicts); every logger through the logger connector's ``log_metrics``, the one method
    Lightning's own ``ThroughputMonitor`` logs through (it logs at Lightning's step counter and adds ``epoch``, as
    ``self.log`` does; no public API does that: :func:`lightning_accel._compat.logger_connector_log_metrics`).
    Where that method is missing (another Lightning version), it falls back to ``pl_module.log``.
    """
    from lightning_accel._compat import logger_connector_log_metrics

    log_metrics = logger_connector_log_metrics(trainer)
    if log_metrics is None:
        for key, value in values.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=key in prog_bar)
        return
    tensors = {key: torch.tensor(float(value)) for key, value in values.items()}
    trainer.callback_metrics.update(tensors)
    trainer.progress_bar_metrics.update({key: float(value) for key, value in values.items() if key in prog_bar})
    if trainer.loggers:
        log_metrics(tensors)
