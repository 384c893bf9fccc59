"""Overhead of BottleneckDoctor (default settings) together with MFUMonitor, against a bare Trainer.

Both arms train the same CPU MLP (steps of >= 10 ms) with the same step clock (a callback that reads
``perf_counter`` at every ``on_train_batch_end``); the arms alternate A B A B ... within one run, so machine noise
hits both. Printed: median step time per arm and the ratio (doctor + MFUMonitor ÷ bare), and the ratio of mean step
times (which includes the once-per-window work the median hides). Target <= 1.01, must not exceed 1.03.

    python benchmarks/bench_doctor_overhead.py [--rounds 6] [--steps 110]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks.bottleneck_doctor import BottleneckDoctor
from lightning_accel.callbacks.mfu_monitor import MFUMonitor

WARMUP = 8  # steps dropped from each arm's timings (FLOP counting, allocator warm-up, the doctor's warm-up)


class StepClock(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps[WARMUP:], self.stamps[WARMUP + 1:])]


class MLP(pl.LightningModule):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.net(x) - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run_arm(with_doctor: bool, steps: int, dim: int, hidden: int, batch: int) -> list[float]:
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    if with_doctor:
        callbacks += [MFUMonitor(print_summary=False, prog_bar=False),
                      BottleneckDoctor(report_path=False, print_report=False)]
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(steps * batch, dim)), batch_size=batch)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(MLP(dim, hidden), train_dataloaders=data)
    return clock.steps()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="A/B pairs (default 6)")
    parser.add_argument("--steps", type=int, default=110,
                        help="steps per arm and round (default 110: two of the doctor's 50-batch windows close)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    bare: list[float] = []
    doctor: list[float] = []
    bare_means: list[float] = []
    doctor_means: list[float] = []
    for _ in range(args.rounds):
        for with_doctor, sink, means in ((False, bare, bare_means), (True, doctor, doctor_means)):
            steps = run_arm(with_doctor, args.steps, args.dim, args.hidden, args.batch)
            sink.extend(steps)
            means.append(statistics.fmean(steps))
    mb, md = statistics.median(bare), statistics.median(doctor)
    print(f"workload: MLP {args.dim}-{args.hidden}-{args.dim}, batch {args.batch}, AdamW, {args.threads} thread(s); "
          f"{args.rounds} rounds x {args.steps} steps per arm, alternating, first {WARMUP} steps of each fit dropped")
    print(f"{'arm':<34}{'median step (ms)':>18}{'mean step (ms)':>16}")
    print(f"{'bare Trainer':<34}{1000 * mb:>18.2f}{1000 * statistics.median(bare_means):>16.2f}")
    print(f"{'BottleneckDoctor + MFUMonitor':<34}{1000 * md:>18.2f}{1000 * statistics.median(doctor_means):>16.2f}")
    ratio_mean = statistics.median(d / b for d, b in zip(doctor_means, bare_means))
    print(f"ratio of median steps: {md / mb:.3f} (target <= 1.01, limit 1.03)")
    print(f"ratio of mean steps (paired per round, median over rounds; includes window closes): {ratio_mean:.3f}")


if __name__ == "__main__":
    main()
