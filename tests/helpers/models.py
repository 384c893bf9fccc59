"""Tiny models that fit in milliseconds on a CPU, and a quiet Trainer for them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.data import IndexedDataset


class TinyRegressor(pl.LightningModule):
    """A two-layer regressor over :class:`~tests.helpers.data.IndexedDataset` that records what it trained on.

    It has the attributes the tuners set (``batch_size``, ``num_workers``); ``losses`` and ``seen`` (sample
    indices) are what the fit loop's batches gave, never a tuner's probes. ``nan_at_batch`` makes one loss NaN;
    ``dropout`` makes every step depend on the global RNG.
    """

    def __init__(
        self,
        batch_size: int = 4,
        n: int = 64,
        features: int = 16,
        num_workers: int = 0,
        nan_at_batch: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.batch_size, self.n, self.features, self.num_workers = batch_size, n, features, num_workers
        self.nan_at_batch = nan_at_batch  # this training batch's loss is NaN (a non-finite step to guard against)
        # dropout draws from the global RNG every step: a callback that draws from it too changes the losses
        self.net = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.losses: list[float] = []
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nan_at_batch:
            loss = loss * float("nan")
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.seen.extend(int(i) for i in batch[2])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            IndexedDataset(self.n, self.features),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
        )


def cpu_trainer(callbacks: Any = (), **kwargs: Any) -> pl.Trainer:
    """A one-device CPU Trainer without logger, checkpoints, progress bar or model summary (overridable)."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)
