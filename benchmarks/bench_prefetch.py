"""DevicePrefetcher on CPU: median step time with a slow-collate loader (``num_workers=0``), with ÷ without.

The loader's ``collate_fn`` costs ``--collate-ms`` per batch in the training process, either waiting like storage
or network I/O does (``--collate io``: ``time.sleep``) or doing tensor work like decoding/augmenting
(``--collate compute``: torch ops, which release the GIL but compete for the CPU cores with the step). The step
is the 3-layer MLP of ``_common.MLPTask`` (tens of ms on a 2-core CPU). Variants run A B C A B C ... in one
process; the table shows the median over rounds of each round's median step time (data wait included), its ratio to the
run without the prefetcher, and that ratio per round (how steady the machine was);
C, the same step with a free collate, is the floor the prefetcher can reach.

Run: ``flock /tmp/la-bench.lock python benchmarks/bench_prefetch.py [--collate io|compute]``.
Ideal with I/O-like collate: step ≈ max(compute, collate) instead of compute + collate.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import torch
from _common import MLPTask, alternate, fit_step_times
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_accel import DevicePrefetcher


def make_collate(kind: str, ms: float):
    def io_collate(samples: list[Any]) -> Any:
        time.sleep(ms / 1e3)  # storage/network latency: the GIL is released while waiting
        return default_collate(samples)

    def compute_collate(samples: list[Any]) -> Any:
        batch = default_collate(samples)
        deadline = time.perf_counter() + ms / 1e3
        x = batch[0]
        while time.perf_counter() < deadline:  # decode/augment-like tensor work (releases the GIL per op)
            x = torch.nn.functional.avg_pool1d(x.unsqueeze(1), 3, 1, 1).squeeze(1).mul_(1.0001)
        return [x]

    return io_collate if kind == "io" else compute_collate


class SlowCollateTask(MLPTask):
    def __init__(self, collate: str, collate_ms: float) -> None:
        super().__init__()
        self.collate, self.collate_ms = collate, collate_ms

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.batch_size * self.batches, self.width, generator=g))
        return DataLoader(
            data, batch_size=self.batch_size, num_workers=0, collate_fn=make_collate(self.collate, self.collate_ms)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--collate", choices=["io", "compute"], default="io")
    parser.add_argument("--collate-ms", type=float, default=15.0)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    def task() -> SlowCollateTask:
        return SlowCollateTask(args.collate, args.collate_ms)

    variants = {
        "no prefetcher": lambda: fit_step_times([], args.steps, task),
        "DevicePrefetcher()": lambda: fit_step_times([DevicePrefetcher()], args.steps, task),
        "step, no collate cost": lambda: fit_step_times([], args.steps, MLPTask),  # the floor prefetch can reach
    }
    # one round at a time, so the per-round ratios show how steady the machine was
    per_round = [alternate(variants, rounds=1) for _ in range(args.rounds)]
    base_name = "no prefetcher"
    print(
        f"collate: {args.collate}, {args.collate_ms:g} ms per batch, num_workers=0; "
        f"{args.rounds} rounds x {args.steps} steps; torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':22s} {'median step':>12s} {'ratio':>7s}  per-round ratios")
    for name in variants:
        median = statistics.median(r[name] for r in per_round)
        base = statistics.median(r[base_name] for r in per_round)
        ratios = " ".join(f"{r[name] / r[base_name]:.2f}" for r in per_round)
        print(f"{name:22s} {1e3 * median:10.2f}ms {median / base:7.3f}  {ratios}")


if __name__ == "__main__":
    main()
