"""Probes to reach the largest batch: BatchSizeTuner vs Lightning's BatchSizeFinder(mode="binsearch").

Both run on the same fake-OOM LightningModule: a simulated device of ``capacity`` bytes where one training step
peaks at ``fixed + per_sample × batch`` bytes and raises ``torch.OutOfMemoryError`` above the capacity (what the
CUDA allocator does). BatchSizeTuner reads that peak through its ``memory_meter`` argument (on a GPU it would be
``torch.cuda.max_memory_allocated``); Lightning's finder only sees the OOMs, which is all it uses. A "probe" is
one trial at one batch size (BatchSizeTuner: 2 steps; BatchSizeFinder: ``steps_per_trial=3`` steps).
BatchSizeFinder runs with ``margin=0`` so that it can reach the maximum at all (its default 5 % margin caps it at
0.95) and ``max_val=65536`` (with the default 8192, Lightning 2.6 stops doubling when the next size reaches 8192 and
returns that size untried: the "small" case then trains at 8192 and runs out of memory); everything else is its
default. Runs alternate A B A B; counts are deterministic, times are medians.

    python benchmarks/bench_batch_size.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks.batch_size_tuner import BatchSizeTuner

GiB = 2**30


class SimulatedDevice:
    """A memory meter over the fake device: the module records each step's simulated peak here."""

    source = "simulated device (fixed + per_sample × batch)"
    exact = True

    def __init__(self) -> None:
        self.peak = 0.0

    def reset(self) -> None:
        self.peak = 0.0

    def peak_bytes(self) -> float:
        return self.peak


class FakeOOM(pl.LightningModule):
    def __init__(self, fixed: float, per_sample: float, capacity: float, meter: SimulatedDevice) -> None:
        super().__init__()
        self.batch_size = 2
        self.fixed, self.per_sample, self.capacity, self.meter = fixed, per_sample, capacity, meter
        self.layer = nn.Linear(16, 1)
        self.trials = 0  # on_train_start runs once per fit-loop run: once per BatchSizeFinder trial, once for fit

    def training_step(self, batch, batch_idx):
        (x,) = batch
        peak = self.fixed + self.per_sample * len(x)
        if peak > self.capacity:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated: {peak / GiB:.2f} GiB > {self.capacity / GiB:.2f} GiB)"
            )
        self.meter.peak = max(self.meter.peak, peak)
        return self.layer(x).square().mean()

    def on_train_start(self) -> None:
        self.trials += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16384, 16)), batch_size=self.batch_size)

    def true_max(self) -> int:
        return int((self.capacity - self.fixed) // self.per_sample)


def _trainer(callback, tmp: str) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
        default_root_dir=tmp,
    )


def run_ours(case: dict, tmp: str) -> tuple[int, int, float]:
    meter = SimulatedDevice()
    model = FakeOOM(meter=meter, **case)
    tuner = BatchSizeTuner(memory_budget=case["capacity"], memory_meter=meter, print_summary=False)
    t0 = time.perf_counter()
    _trainer(tuner, tmp).fit(model)
    return tuner.result.num_probes, model.batch_size, time.perf_counter() - t0


def run_lightning(case: dict, tmp: str) -> tuple[int, int, float]:
    meter = SimulatedDevice()
    model = FakeOOM(meter=meter, **case)
    finder = BatchSizeFinder(mode="binsearch", margin=0.0, max_val=2**16)
    t0 = time.perf_counter()
    _trainer(finder, tmp).fit(model)
    return model.trials - 1, finder.optimal_batch_size, time.perf_counter() - t0


CASES = {
    "7B-ish: 60 GiB fixed, 12 MiB/sample, 80 GiB": dict(fixed=60 * GiB, per_sample=12 * 2**20, capacity=80 * GiB),
    "ResNet-ish: 1 GiB fixed, 90 MiB/sample, 24 GiB": dict(fixed=1 * GiB, per_sample=90 * 2**20, capacity=24 * GiB),
    "small: 0.3 GiB fixed, 3 MiB/sample, 16 GiB": dict(fixed=0.3 * GiB, per_sample=3 * 2**20, capacity=16 * GiB),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import tempfile

    print(
        "| case | true max | ours: probes | ours: batch (÷ max) | Lightning binsearch: probes | "
        "Lightning: batch (÷ max) | probes ours ÷ Lightning | search time ours / Lightning (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            true_max = FakeOOM(meter=SimulatedDevice(), **case).true_max()
            ours, theirs = [], []
            for _ in range(args.repeats):  # A B A B ...
                ours.append(run_ours(case, tmp))
                theirs.append(run_lightning(case, tmp))
            (op, ob, _), (lp, lb, _) = ours[0], theirs[0]
            assert all(o[:2] == (op, ob) for o in ours) and all(t[:2] == (lp, lb) for t in theirs)
            ot = statistics.median(o[2] for o in ours)
            lt = statistics.median(t[2] for t in theirs)
            print(
                f"| {name} | {true_max} | {op} | {ob} ({ob / true_max:.3f}) | {lp} | {lb} ({lb / true_max:.3f}) "
                f"| {op / lp:.2f} | {ot:.2f} / {lt:.2f} |"
            )


if __name__ == "__main__":
    main()
