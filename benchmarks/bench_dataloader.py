"""DataLoaderTuner on a decode-heavy dataset: samples/s of the tuned loader ÷ the default ``num_workers=0`` loader.

The dataset holds JPEG bytes made here with Pillow (500×375 like most of ImageNet, smooth shapes plus grain,
quality 90, ~100 KiB; nothing is downloaded) and decodes + resizes one to 224×224 uint8 per ``__getitem__`` — the
CPU-bound part of an image pipeline. The tuner
runs inside ``Trainer.fit`` on a small model, then two figures are measured side by side, alternating A B A B,
median of ``--repeats``:

* loader: samples/s of iterating the train dataloader alone, steady state (first batches skipped);
* training: samples/s of ``fit`` for ``--steps`` steps (data + step), timed from the first to the last batch;
* control: the num_workers=0 loader with ``torch.set_num_threads(1)`` — DataLoader workers run with one intra-op
  thread, so part of a worker's advantage on a busy CPU can be freedom from OpenMP contention rather than
  parallel decoding; the control shows how much.

    python benchmarks/bench_dataloader.py
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import time
import warnings

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner


def make_jpegs(n: int, width: int = 500, height: int = 375, seed: int = 0) -> list[bytes]:
    """ImageNet-like JPEGs (500×375, the most common ImageNet size; ~100 KiB): smooth shapes plus grain."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        low = rng.integers(0, 256, size=(height // 25, width // 25, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), dtype=np.int16)
        grain = rng.integers(-24, 25, size=smooth.shape, dtype=np.int16)
        img = Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class JpegDataset(Dataset):
    """Decode + resize to 224×224 in the loader, uint8 out (normalising is left to the step, as DALI/FFCV do)."""

    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB").resize((224, 224), Image.BILINEAR)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), i % 10


class Classifier(pl.LightningModule):
    MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255  # ImageNet statistics (torchvision's)
    STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255

    def __init__(self, blobs: list[bytes], batch_size: int = 32) -> None:
        super().__init__()
        self.blobs, self.batch_size = blobs, batch_size
        self.num_workers, self.prefetch_factor, self.persistent_workers = 0, None, False
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 7, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
        )
        self.stamps: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = (x.float() - self.MEAN) / self.STD
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        self.stamps.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        w = self.num_workers
        return DataLoader(
            JpegDataset(self.blobs),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=w,
            prefetch_factor=self.prefetch_factor if w else None,
            persistent_workers=self.persistent_workers and w > 0,
            drop_last=True,
        )


def _trainer(callbacks, steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def loader_rate(model: Classifier, batches: int, skip: int) -> float:
    n, t0 = 0, None
    for i, (x, _) in enumerate(model.train_dataloader()):
        if i == skip:
            t0 = time.perf_counter()
        elif i > skip:
            n += len(x)
        if i == skip + batches:
            break
    return n / (time.perf_counter() - t0)


def train_rate(blobs: list[bytes], setting: dict, steps: int) -> float:
    model = Classifier(blobs)
    for k, v in setting.items():
        setattr(model, k, v)
    _trainer([], steps).fit(model)
    s = model.stamps[2:]  # from the 3rd batch: worker start-up excluded
    return (len(s) - 1) * model.batch_size / (s[-1] - s[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    blobs = make_jpegs(args.images)
    print(
        f"{len(blobs)} JPEGs, {sum(map(len, blobs)) / len(blobs) / 1024:.1f} KiB each; batch 32; "
        f"torch threads {torch.get_num_threads()}"
    )

    tuned_model = Classifier(blobs)
    tuner = DataLoaderTuner(print_summary=True, batches_per_trial=10)
    _trainer([tuner], 1).fit(tuned_model)
    chosen = {k: tuner.decision[k] for k in ("num_workers", "prefetch_factor", "persistent_workers")}
    default = {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False}
    print(f"tuned: {chosen}")

    loader = {"default": [], "tuned": [], "default_1thread": []}
    train = {"default": [], "tuned": []}
    for _ in range(args.repeats):  # A B A B ...
        for name, setting in (("default", default), ("tuned", chosen)):
            m = Classifier(blobs)
            for k, v in setting.items():
                setattr(m, k, v)
            loader[name].append(loader_rate(m, batches=24, skip=2 + 2 * setting["num_workers"]))
            train[name].append(train_rate(blobs, setting, args.steps))
        # control: the main-process loader with one intra-op thread, as DataLoader workers run (they call
        # torch.set_num_threads(1)); separates "more processes" from "no OpenMP contention on small tensor ops"
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        loader["default_1thread"].append(loader_rate(Classifier(blobs), batches=24, skip=2))
        torch.set_num_threads(threads)
    med = {k: {n: statistics.median(v[n]) for n in v} for k, v in (("loader", loader), ("train", train))}
    print("| measure | default num_workers=0 (samples/s) | tuned (samples/s) | tuned ÷ default |")
    print("|---|---|---|---|")
    for k in ("loader", "train"):
        print(
            f"| {k} | {med[k]['default']:,.1f} | {med[k]['tuned']:,.1f} | {med[k]['tuned'] / med[k]['default']:.2f} |"
        )
    one = med["loader"]["default_1thread"]
    print(
        f"| loader, control: num_workers=0 with torch.set_num_threads(1) | {one:,.1f} | "
        f"{med['loader']['tuned']:,.1f} | {med['loader']['tuned'] / one:.2f} |"
    )


if __name__ == "__main__":
    main()
