"""Generated datasets: nothing is downloaded."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SleepyDataset(Dataset):
    """``n`` samples of ``features`` values and their index; each ``__getitem__`` sleeps ``sleep_s`` (I/O-like: the
    wait needs no CPU, so a test that measures it holds on a loaded machine)."""

    def __init__(self, n: int = 256, sleep_s: float = 0.006, features: int = 8) -> None:
        self.n, self.sleep_s, self.features = n, sleep_s, features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.features, generator=g), i


class IndexedDataset(Dataset):
    """``n`` samples ``(x, y, index)`` of ``features`` inputs and one target: the index tells a test what was
    trained on."""

    def __init__(self, n: int = 512, features: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i
