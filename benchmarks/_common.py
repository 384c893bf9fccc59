"""Helpers shared by the benchmark scripts: a step-time recorder and A/B alternation with medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class StepTimes(pl.Callback):
    """Host time between consecutive ``on_train_batch_end`` calls (the full step, data wait included)."""

    def __init__(self, skip: int = 5) -> None:
        self.skip, self.times, self._last = skip, [], None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last is not None and batch_idx >= self.skip:
            self.times.append(now - self._last)
        self._last = now


class MLPTask(pl.LightningModule):
    """A CPU workload whose step takes tens of milliseconds (3 wide linear layers)."""

    def __init__(self, width: int = 1024, batch_size: int = 64, batches: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 2 * width),
                                 nn.ReLU(), nn.Linear(2 * width, width))
        self.width, self.batch_size, self.batches = width, batch_size, batches

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(self.batch_size * self.batches, self.width, generator=g)),
                          batch_size=self.batch_size)


def fit_step_times(callbacks: list[Any], steps: int, make_model: Callable[[], pl.LightningModule],
                   **trainer_kwargs: Any) -> list[float]:
    recorder = StepTimes()
    kwargs = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[*callbacks, recorder], **kwargs)
    torch.manual_seed(0)
    trainer.fit(make_model())
    return recorder.times


def alternate(variants: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, float]:
    """Run the variants A B A B ... ``rounds`` times; median step time per variant over all rounds."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            samples[name].extend(run())
    return {name: statistics.median(times) for name, times in samples.items()}
