"""Window metrics to the loggers, ``callback_metrics`` and the progress bar without ``pl_module.log``'s per-key cost.

``pl_module.log`` costs ~0.2-1.5 ms per key on a CPU (result-collection bookkeeping, a tensor per value, a device
check), which the doctor and MFUMonitor paid for every key of every window: most of their in-hook time. A window's
metrics are plain floats computed once per window, so they go where ``self.log(..., on_step=True)`` would put them
in one call: every logger (``log_metrics`` at the step Lightning logs at), ``trainer.callback_metrics`` (what
``ModelCheckpoint(monitor=...)`` / ``EarlyStopping`` read) and, for ``prog_bar`` keys, ``trainer.progress_bar_metrics``.

This touches Lightning's logger connector through :func:`lightning_accel._compat.logger_connector_stores`
(``log_metrics``, the method ``self.log`` flushes through, and the callback / progress-bar metric dicts). If they
are missing (another Lightning version), it falls back to ``pl_module.log``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["log_window"]


def log_window(trainer: pl.Trainer, pl_module: pl.LightningModule, values: Mapping[str, float],
               prog_bar: Collection[str] = ()) -> None:
    """Log one window's ``values`` (key → float) as ``pl_module.log(key, value, on_step=True)`` would show them."""
    from lightning_accel._compat import logger_connector_stores

    stores = logger_connector_stores(trainer)
    if stores is None:
        for key, value in values.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=key in prog_bar)
        return
    connector, callback_metrics, bar = stores
    tensors = {key: torch.tensor(float(value)) for key, value in values.items()}
    callback_metrics.update(tensors)
    bar.update({key: float(value) for key, value in values.items() if key in prog_bar})
    if trainer.loggers:
        connector.log_metrics(tensors)
