"""The demo's planted data bottleneck (``lightning-accel demo --slow-data``): a dataset that sleeps per sample.

It stands for an expensive input pipeline (decoding JPEGs, tokenising text, augmentations) so a newcomer sees
``BottleneckDoctor`` point at ``data`` within the first minute, and sees the fix work: with ``--num-workers 2``
the sleeping moves into worker processes and overlaps with training.
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import DataLoader, Dataset

from lightning_accel.demo.task import DemoDataModule

__all__ = ["SlowDataset", "SlowDemoDataModule"]


class SlowDataset(Dataset):
    """Wraps a map-style dataset; every ``__getitem__`` first sleeps ``seconds_per_sample`` (host time, no CPU)."""

    def __init__(self, dataset: Any, seconds_per_sample: float) -> None:
        if seconds_per_sample < 0:
            raise ValueError(f"SlowDataset: seconds_per_sample must be >= 0, got {seconds_per_sample}")
        self.dataset = dataset
        self.seconds_per_sample = seconds_per_sample

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds_per_sample)
        return self.dataset[index]


class SlowDemoDataModule(DemoDataModule):
    """:class:`DemoDataModule` whose training loader reads through :class:`SlowDataset` (validation is unchanged)."""

    def __init__(self, *, seconds_per_sample: float = 0.002, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds_per_sample = seconds_per_sample

    def train_dataloader(self) -> DataLoader:
        loader = super().train_dataloader()
        return DataLoader(
            SlowDataset(loader.dataset, self.seconds_per_sample),
            batch_size=loader.batch_size,
            shuffle=True,
            drop_last=loader.drop_last,
            num_workers=loader.num_workers,
            persistent_workers=loader.persistent_workers,
        )
