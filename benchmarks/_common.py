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
    """Time between consecutive ``on_train_batch_end`` calls (the full step, data wait included).

    ``clock="wall"`` records ``time.perf_counter``; ``clock="cpu"`` records the process's CPU time
    (``time.process_time``, all threads), which other processes on a shared machine disturb far less: use it with
    one torch thread to measure the CPU overhead of a callback.
    """

    def __init__(self, skip: int = 5, clock: str = "wall") -> None:
        self.skip, self.times, self._last = skip, [], None
        self._clock = {"wall": time.perf_counter, "cpu": time.process_time}[clock]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = self._clock()
        if self._last is not None and batch_idx >= self.skip:
            self.times.append(now - self._last)
        self._last = now


class MLPTask(pl.LightningModule):
    """A CPU workload whose step takes tens of milliseconds (3 wide linear layers)."""

    def __init__(self, width: int = 1024, batch_size: int = 64, batches: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, 2 * width),
            nn.ReLU(),
            nn.Linear(2 * width, 2 * width),
            nn.ReLU(),
            nn.Linear(2 * width, width),
        )
        self.width, self.batch_size, self.batches = width, batch_size, batches

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(self.batch_size * self.batches, self.width, generator=g)),
            batch_size=self.batch_size,
        )


def fit_step_times(
    callbacks: list[Any],
    steps: int,
    make_model: Callable[[], pl.LightningModule],
    *,
    clock: str = "wall",
    **trainer_kwargs: Any,
) -> list[float]:
    recorder = StepTimes(clock=clock)
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[*callbacks, recorder], **kwargs)
    torch.manual_seed(0)
    trainer.fit(make_model())
    return recorder.times


def alternate(variants: dict[str, Callable[[], list[float]]], rounds: int, *, verbose: bool = True) -> dict[str, float]:
    """Run the variants A B A B ... ``rounds`` times; median step time per variant over all rounds.

    The order inside a round flips every round (A B, B A, ...) so neither variant always runs first.
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times = variants[name]()
            samples[name].extend(times)
            if verbose:
                print(
                    f"  round {r}: {name:24s} median {1e3 * statistics.median(times):8.2f} ms over {len(times)} steps",
                    flush=True,
                )
    return {name: statistics.median(times) for name, times in samples.items()}
