"""DALI train pipeline vs a PyTorch DataLoader doing the same work with PIL, side by side on the same cores.

Both read the same JPEGs (photo-like, 500x375 by default, the size of a typical ImageNet image) and produce the
same batches: random-resized crop (area 0.08-1, aspect 3/4-4/3, torchvision's algorithm) -> 224x224 bilinear ->
random horizontal flip -> normalise (ImageNet mean/std) -> float32 NCHW. DALI uses ``num_threads`` = N threads and
ROI decode (``fn.decoders.image_random_crop``: only the crop window is decoded); the DataLoader uses N worker
processes, each decoding the full image with PIL. Runs alternate (A B A B ...), one epoch each after a warm-up
epoch; the table reports the median images/s.

    flock /tmp/la-bench.lock python benchmarks/bench_dali.py [--images 256] [--workers 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def make_jpegs(root: Path, n: int, size: tuple[int, int], classes: int = 4) -> None:
    """Photo-like JPEGs: smooth colour fields (upscaled low-res noise) plus grain; about 40-80 KB at 500x375."""
    from PIL import Image, ImageFilter

    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        low = Image.fromarray(rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        arr = np.asarray(low.filter(ImageFilter.GaussianBlur(2)), dtype=np.float32)
        arr += rng.normal(0, 8, size=arr.shape)
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)


def random_resized_crop_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params with scale (0.08, 1) and ratio (3/4, 4/3)."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            return x, y, x + w, y + h
    side = min(width, height)  # fallback: centre crop (torchvision clamps the ratio; equivalent here)
    x, y = (width - side) // 2, (height - side) // 2
    return x, y, x + side, y + side


class PILTrainSet(Dataset):
    def __init__(self, files: list[Path], labels: list[int], size: int = 224) -> None:
        self.files, self.labels, self.size = files, labels, size
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.files[i]) as img:
            img = img.convert("RGB")
            box = random_resized_crop_box(img.width, img.height, self.rng)
            img = img.resize((self.size, self.size), Image.BILINEAR, box=box)
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = (np.asarray(img, dtype=np.float32) - MEAN) / STD
        return torch.from_numpy(x.transpose(2, 0, 1).copy()), self.labels[i]


def epoch_rate(loader) -> float:
    start = time.perf_counter()
    n = 0
    for images, _ in loader:
        n += images.shape[0]
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DALI threads = DataLoader workers")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lightning_accel.data.dali import DALIImageDataModule

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpegs"
        make_jpegs(root, args.images, (args.width, args.height))
        files = sorted(root.glob("*/*.jpg"))
        kb = sum(f.stat().st_size for f in files) / len(files) / 1024
        dm = DALIImageDataModule(train=root, image_size=224, batch_size=args.batch_size, num_threads=args.workers,
                                 decode_device="cpu", last_batch="drop")
        dm.setup("fit")
        dali = dm.train_dataloader()
        pil = DataLoader(PILTrainSet(files, [int(f.parent.name[-1]) for f in files]), batch_size=args.batch_size,
                         shuffle=True, drop_last=True, num_workers=args.workers, persistent_workers=True,
                         prefetch_factor=2)
        epoch_rate(dali), epoch_rate(pil)  # warm-up: thread pools, worker processes, page cache
        rates: dict[str, list[float]] = {"dali": [], "pil": []}
        for _ in range(args.rounds):
            rates["dali"].append(epoch_rate(dali))
            rates["pil"].append(epoch_rate(pil))
        dali_rate, pil_rate = statistics.median(rates["dali"]), statistics.median(rates["pil"])
        print(f"{args.images} JPEGs {args.width}x{args.height} (mean {kb:.0f} KB) -> 224x224 float32 NCHW, "
              f"batch {args.batch_size}, {args.workers} DALI threads vs {args.workers} DataLoader workers, "
              f"median of {args.rounds} alternating epochs")
        print(f"| pipeline | images/s | ratio |\n|---|---|---|")
        print(f"| PyTorch DataLoader + PIL | {pil_rate:.1f} | 1.00x |")
        print(f"| DALI CPU (ROI decode) | {dali_rate:.1f} | {dali_rate / pil_rate:.2f}x |")
        print(f"all rounds: dali {[round(r, 1) for r in rates['dali']]}, pil {[round(r, 1) for r in rates['pil']]}")


if __name__ == "__main__":
    main()
