"""Data: DALI image pipelines sharded for DDP, packers to WebDataset and memmap shards, memmap datasets.

Nothing here imports NVIDIA DALI at import time; ``DALIImageDataModule`` imports it when it builds a pipeline.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DALIImageDataModule",
    "MemmapDataModule",
    "MemmapDataset",
    "TokenMemmapDataset",
    "pack_memmap",
    "pack_webdataset",
]

_MODULES = {
    "DALIImageDataModule": "dali",
    "MemmapDataModule": "memmap",
    "MemmapDataset": "memmap",
    "TokenMemmapDataset": "memmap",
    "pack_memmap": "memmap",
    "pack_webdataset": "webdataset",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'lightning_accel.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_accel.data.{_MODULES[name]}"), name)
