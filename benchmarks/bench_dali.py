"""DALI train pipeline vs a PyTorch DataLoader doing the same work with PIL, side by side on the same cores.

Both read the same JPEGs (photo-like, 500x375 by default, the size of a typical ImageNet image) and produce the
same batches: random-resized crop (area 0.08-1, aspect 3/4-4/3, torchvision's algorithm) -> 224x224 bilinear
(antialiased) -> random horizontal flip -> normalise (ImageNet mean/std) -> float32 NCHW. DALI uses N threads and
ROI decode (``fn.decoders.image_random_crop``: only the crop window is decoded); the DataLoader uses N worker
processes, each decoding the full image with PIL. Epochs alternate (A B C A B C ...) after a warm-up epoch each;
the table reports the median images/s.

Rows:
- ``PyTorch DataLoader + PIL``: the baseline (``persistent_workers``; ``pin_memory`` and a copy to the GPU on CUDA);
- ``DALIImageDataModule``: what users get (files read in Python from the exact DDP epoch plan, fed through
  ``fn.external_source``); on CUDA it runs twice, ``decode_device="cpu"`` and ``"mixed"`` (nvJPEG), both
  delivering batches on the GPU;
- ``DALI readers.file`` (``--reader``): the same operators fed by DALI's own C++ file reader, no DDP plan: the ceiling
  of DALI's operators on this machine, i.e. what the data module's exact sharding costs.

``--stages`` adds what one image costs in each stage on one core (DALI with 1 thread, PIL in this process), which is
where the ratio comes from.

    flock /tmp/la-bench.lock python benchmarks/bench_dali.py [--images 512] [--workers 2] [--rounds 5] [--reader]
        [--stages]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255
SIZE = 224
BASELINE = "PyTorch DataLoader + PIL"


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


def pil_decode(path: Path) -> Any:
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def pil_crop_resize(img: Any, rng: random.Random) -> Any:
    from PIL import Image

    return img.resize((SIZE, SIZE), Image.BILINEAR, box=random_resized_crop_box(img.width, img.height, rng))


def pil_flip_normalise(img: Any, rng: random.Random) -> np.ndarray:
    from PIL import Image

    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = (np.asarray(img, dtype=np.float32) - MEAN) / STD
    return x.transpose(2, 0, 1).copy()


class PILTrainSet(Dataset):
    def __init__(self, files: list[Path], labels: list[int]) -> None:
        self.files, self.labels = files, labels
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = pil_crop_resize(pil_decode(self.files[i]), self.rng)
        return torch.from_numpy(pil_flip_normalise(img, self.rng)), self.labels[i]


def dali_train_graph(encoded: Any, module: Any) -> Any:
    """The data module's own train operators (``DALIImageDataModule._decode_and_augment``), CPU decode."""
    import nvidia.dali as dali

    return module._decode_and_augment(encoded, train=True, decode_device="cpu", dali=dali)


def reader_loader(files: list[Path], module: Any, *, batch_size: int, threads: int, device_id: int | None) -> Any:
    """DALI's own file reader feeding the same operators (no DDP plan): the ceiling of DALI's CPU operators."""
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    pipe = Pipeline(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=1, prefetch_queue_depth=2)
    with pipe:
        encoded, labels = fn.readers.file(
            files=[str(f) for f in files], labels=list(range(len(files))), random_shuffle=True, name="reader"
        )
        images = dali_train_graph(encoded, module)
        pipe.set_outputs(images.gpu() if device_id is not None else images, labels)

    class Epochs:  # DALIGenericIterator with auto_reset re-iterates; one pass per `iter`
        def __init__(self) -> None:
            self.it = DALIGenericIterator(
                pipe,
                ["images", "labels"],
                reader_name="reader",
                auto_reset=True,
                last_batch_policy=LastBatchPolicy.DROP,
            )

        def __iter__(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            return ((out[0]["images"], out[0]["labels"]) for out in self.it)

    return Epochs()


def epoch_rate(loader: Iterable, device: torch.device) -> tuple[float, float]:
    """Images/s over one epoch, each batch delivered on ``device`` (what a training step would receive): over the
    whole epoch, and after its first batch (the steady state of a long epoch, without the start-of-epoch fill:
    the DataLoader's workers restart, DALI's queue refills)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    first_done, n, n_first = 0.0, 0, 0
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        n += images.shape[0]
        if not first_done:
            sync()
            first_done, n_first = time.perf_counter(), n
    sync()
    end = time.perf_counter()
    return n / (end - start), (n - n_first) / (end - first_done)


def build_loaders(
    root: Path, files: list[Path], *, batch_size: int, workers: int, device: torch.device, reader: bool
) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_accel.data.dali import DALIImageDataModule

    cuda = device.type == "cuda"
    labels = [int(f.parent.name.rsplit("_", 1)[-1]) for f in files]
    loaders: dict[str, Any] = {
        BASELINE: DataLoader(
            PILTrainSet(files, labels),
            batch_size=batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=workers,
            persistent_workers=True,
            prefetch_factor=2,
            pin_memory=cuda,
        )
    }
    modules = {}
    for decode in ("cpu", "mixed") if cuda else ("cpu",):
        dm = DALIImageDataModule(
            train=root,
            image_size=SIZE,
            batch_size=batch_size,
            num_threads=workers,
            decode_device=decode,
            last_batch="drop",
        )
        if cuda:  # a Trainer on the GPU: the data module delivers its batches there, as in training
            dm.trainer = pl.Trainer(accelerator="cuda", devices=1, logger=False, enable_progress_bar=False)
        dm.setup("fit")
        modules[decode] = dm
        name = "DALIImageDataModule (CPU, ROI decode)" if decode == "cpu" else "DALIImageDataModule (mixed, nvJPEG)"
        loaders[name] = dm.train_dataloader()
    if reader:
        loaders["DALI readers.file, same operators (no DDP plan)"] = reader_loader(
            files, modules["cpu"], batch_size=batch_size, threads=workers, device_id=device.index if cuda else None
        )
    return loaders


def compare(
    root: Path, *, batch_size: int, workers: int, rounds: int, device: torch.device, reader: bool
) -> dict[str, list[tuple[float, float]]]:
    """Alternating epochs of every loader over the JPEGs under ``root``; (whole epoch, steady) images/s per round."""
    files = sorted(root.glob("*/*.jpg"))
    loaders = build_loaders(root, files, batch_size=batch_size, workers=workers, device=device, reader=reader)
    for loader in loaders.values():
        epoch_rate(loader, device)  # warm-up: thread pools, worker processes, page cache
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, loader in loaders.items():
            rates[name].append(epoch_rate(loader, device))
    return rates


def summarise(rates: dict[str, list[tuple[float, float]]]) -> list[tuple[str, float, float, float, float]]:
    """(pipeline, whole-epoch median, its ratio to PIL, steady median, its ratio to PIL) per row."""
    medians = {
        name: (statistics.median(r[0] for r in values), statistics.median(r[1] for r in values))
        for name, values in rates.items()
    }
    epoch_base, steady_base = medians[BASELINE]
    return [
        (name, epoch, epoch / epoch_base, steady, steady / steady_base) for name, (epoch, steady) in medians.items()
    ]


def _ms_per_image(run: Callable[[], int], repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        n = run()
        best = min(best, (time.perf_counter() - start) / n)
    return 1e3 * best


def stage_costs(files: list[Path], module: Any, batch_size: int) -> list[tuple[str, float, float]]:
    """(stage, PIL ms/image, DALI ms/image) on one core; each stage's cost is the difference of cumulative runs."""
    from nvidia.dali import fn
    from nvidia.dali.pipeline import Pipeline

    rng = random.Random(0)
    pil = [
        _ms_per_image(lambda: sum(1 for f in files if pil_decode(f) is not None)),
        _ms_per_image(lambda: sum(1 for f in files if pil_crop_resize(pil_decode(f), rng) is not None)),
        _ms_per_image(
            lambda: sum(1 for f in files if pil_flip_normalise(pil_crop_resize(pil_decode(f), rng), rng) is not None)
        ),
    ]

    def dali_pipe(stage: int, roi: bool = True) -> Any:
        pipe = Pipeline(batch_size=batch_size, num_threads=1, device_id=None, seed=1, prefetch_queue_depth=2)
        with pipe:
            encoded, _ = fn.readers.file(files=[str(f) for f in files], random_shuffle=True)
            if stage == 3:
                images = dali_train_graph(encoded, module)
            elif roi:
                images = fn.decoders.image_random_crop(
                    encoded, device="cpu", random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10
                )
                images = fn.resize(images, resize_x=SIZE, resize_y=SIZE) if stage == 2 else images
            else:
                images = fn.decoders.image(encoded, device="cpu")
            pipe.set_outputs(images)
        pipe.build()
        for _ in range(2):
            pipe.run()
        return pipe

    def dali_cost(stage: int, roi: bool = True) -> float:
        pipe = dali_pipe(stage, roi)
        iterations = max(2, len(files) // batch_size)
        return _ms_per_image(lambda: sum(len(pipe.run()[0]) for _ in range(iterations)))

    full, roi_decode, resized, done = dali_cost(1, roi=False), dali_cost(1), dali_cost(2), dali_cost(3)
    return [
        ("decode (PIL: full; DALI: ROI of the crop)", pil[0], roi_decode),
        ("  DALI full decode, for reference", math.nan, full),
        ("crop + resize to 224x224 (antialiased bilinear)", pil[1] - pil[0], resized - roi_decode),
        ("flip + normalise to float32 CHW", pil[2] - pil[1], done - resized),
        ("total", pil[2], done),
    ]


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DALI threads = DataLoader workers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reader", action="store_true", help="add DALI's own readers.file (the ceiling)")
    parser.add_argument("--stages", action="store_true", help="add the cost of each stage on one core")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even where CUDA is available")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from lightning_accel.data.dali import DALIImageDataModule

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpegs"
        make_jpegs(root, args.images, (args.width, args.height))
        files = sorted(root.glob("*/*.jpg"))
        kb = sum(f.stat().st_size for f in files) / len(files) / 1024
        rates = compare(
            root,
            batch_size=args.batch_size,
            workers=args.workers,
            rounds=args.rounds,
            device=device,
            reader=args.reader,
        )
        stages = (
            stage_costs(files, DALIImageDataModule(train=root, image_size=SIZE, decode_device="cpu"), args.batch_size)
            if args.stages
            else []
        )  # the module's operators, its defaults
    print(
        f"{args.images} JPEGs {args.width}x{args.height} (mean {kb:.0f} KB) -> {SIZE}x{SIZE} float32 NCHW on "
        f"{device}, batch {args.batch_size}, {args.workers} DALI threads vs {args.workers} DataLoader workers, "
        f"{os.cpu_count()} cores, median of {args.rounds} alternating epochs"
    )
    print(
        "| pipeline | images/s, whole epoch | ratio | images/s after the first batch | ratio |\n|---|---|---|---|---|"
    )
    for name, epoch, epoch_ratio, steady, steady_ratio in summarise(rates):
        print(f"| {name} | {epoch:.1f} | {epoch_ratio:.2f}x | {steady:.1f} | {steady_ratio:.2f}x |")
    print(
        "all rounds (whole epoch / after the first batch): "
        + "; ".join(
            f"{name}: {[round(e) for e, _ in values]} / {[round(s) for _, s in values]}"
            for name, values in rates.items()
        )
    )
    if stages:
        print("\none image on one core (ms):\n| stage | PIL | DALI CPU | PIL / DALI |\n|---|---|---|---|")
        for stage, pil_ms, dali_ms in stages:
            pil_text = "" if math.isnan(pil_ms) else f"{pil_ms:.2f}"
            ratio = "" if math.isnan(pil_ms) else f"{pil_ms / dali_ms:.2f}x"
            print(f"| {stage} | {pil_text} | {dali_ms:.2f} | {ratio} |")
    return rates


if __name__ == "__main__":
    main()
