"""The image demo (``lightning-accel demo --data images``): a small CNN on JPEGs generated on the spot, read
through :class:`~lightning_accel.data.dali.DALIImageDataModule`.

Each class has its own colour; every image is that colour with pixel noise and a random rectangle of another
colour, so the classes are learnable but not after one glance at a single pixel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_accel._atomic import atomic_write_text
from lightning_accel.data.dali import DALIImageDataModule

__all__ = ["DemoImageDataModule", "ImageTask", "SmallCNN", "make_image_folder"]

_DONE = ".complete.json"


def make_image_folder(
    root: str | Path,
    *,
    num_classes: int = 10,
    images_per_class: int = 64,
    size: int = 64,
    seed: int = 0,
    quality: int = 90,
) -> Path:
    """Write ``root/<class>/<i>.jpg`` (``class_00`` ...); skipped when ``root`` already holds the same set."""
    from PIL import Image

    root = Path(root)
    spec = {
        "num_classes": num_classes,
        "images_per_class": images_per_class,
        "size": size,
        "seed": seed,
        "quality": quality,
    }
    marker = root / _DONE
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return root
    rng = np.random.default_rng(seed)
    hues = np.linspace(0, 1, num_classes, endpoint=False)
    for label in range(num_classes):
        folder = root / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        base = np.asarray(Image.new("HSV", (1, 1), (int(hues[label] * 255), 200, 220)).convert("RGB"))[0, 0]
        for i in range(images_per_class):
            img = base + rng.normal(0, 25, size=(size, size, 3))
            h, w = rng.integers(size // 4, size // 2, size=2)
            y, x = rng.integers(0, size - h), rng.integers(0, size - w)
            img[y : y + h, x : x + w] = rng.integers(0, 256, size=3)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=quality)
    atomic_write_text(marker, json.dumps(spec))  # the marker says the folder is complete: never half-written
    return root


class DemoImageDataModule(DALIImageDataModule):
    """``DALIImageDataModule`` over generated folders ``root/train`` and ``root/val`` (written on local rank 0)."""

    def __init__(
        self,
        root: str | Path,
        *,
        num_classes: int = 10,
        train_per_class: int = 64,
        val_per_class: int = 16,
        source_size: int = 64,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        root = Path(root)
        super().__init__(train=root / "train", val=root / "val", seed=seed, **kwargs)
        self.root, self.num_classes_, self.source_size = root, num_classes, source_size
        self.train_per_class, self.val_per_class = train_per_class, val_per_class

    @override
    def prepare_data(self) -> None:
        make_image_folder(
            self.root / "train",
            num_classes=self.num_classes_,
            images_per_class=self.train_per_class,
            size=self.source_size,
            seed=self.seed,
        )
        make_image_folder(
            self.root / "val",
            num_classes=self.num_classes_,
            images_per_class=self.val_per_class,
            size=self.source_size,
            seed=self.seed + 1,
        )


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU stages (32, 64, 128 channels), global average pool, linear classifier."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for out in (width, 2 * width, 4 * width):
            layers += [
                nn.Conv2d(channels, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class ImageTask(pl.LightningModule):
    """Classification with :class:`SmallCNN`; logs ``train_loss``, ``val_loss`` (nats/image) and ``val_acc``."""

    def __init__(self, num_classes: int = 10, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = SmallCNN(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images).float(), labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images).float()
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, batch_size=len(labels), sync_dist=True)
        self.log(
            "val_acc",
            (logits.argmax(-1) == labels).float().mean(),
            prog_bar=True,
            batch_size=len(labels),
            sync_dist=True,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=1e-4)
