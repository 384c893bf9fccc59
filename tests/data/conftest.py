"""Fixtures for the data tests: tiny generated image folders whose pixels identify each image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# 4 x 3 x 2 = 24 colours, 60 apart per channel: a random crop, resize or flip of a solid image keeps its colour,
# so the mean colour of an output identifies the source image (a content hash that survives augmentation)
LEVELS = ((30, 90, 150, 210), (40, 120, 200), (60, 180))
PALETTE = np.array([(r, g, b) for r in LEVELS[0] for g in LEVELS[1] for b in LEVELS[2]], dtype=np.float64)


def write_solid_folder(
    root: Path, *, num_classes: int = 3, per_class: int = 8, size: tuple[int, int] = (48, 40), fmt: str = "jpg"
) -> dict[str, tuple[int, int]]:
    """``root/class_k/img_i.<fmt>``, each a solid colour from PALETTE; returns name -> (palette id, label)."""
    from PIL import Image

    if num_classes * per_class > len(PALETTE):
        raise ValueError("not enough distinct colours")
    truth = {}
    for label in range(num_classes):
        (root / f"class_{label}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pid = label * per_class + i
            name = f"class_{label}/img_{i}.{fmt}"
            pixels = np.broadcast_to(PALETTE[pid].astype(np.uint8), (size[1], size[0], 3)).copy()
            Image.fromarray(pixels).save(root / name, quality=95) if fmt == "jpg" else Image.fromarray(pixels).save(
                root / name
            )
            truth[name] = (pid, label)
    return truth


def identify(images, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), layout: str = "NCHW") -> list[int]:
    """Palette ids of a batch of normalised solid-colour images (asserts each is close to one colour)."""
    x = images.float().cpu().numpy()
    if layout == "NHWC":
        x = x.transpose(0, 3, 1, 2)
    rgb = x.mean(axis=(2, 3)) * (np.array(std) * 255)[None] + (np.array(mean) * 255)[None]
    dist = np.abs(rgb[:, None, :] - PALETTE[None]).max(axis=2)
    ids = dist.argmin(axis=1)
    assert (dist.min(axis=1) < 12).all(), f"an output is not a solid palette colour: {rgb}"
    return [int(i) for i in ids]


@pytest.fixture
def solid_folder(tmp_path: Path) -> tuple[Path, dict[str, tuple[int, int]]]:
    root = tmp_path / "images"
    return root, write_solid_folder(root)
