"""Overhead of MFUMonitor: median step time with it ÷ a bare Trainer, side by side (A B A B ...) in one run.

Run: ``python benchmarks/bench_mfu_overhead.py`` (CPU; the workload's step takes tens of ms). Target ≤ 1.01,
must not exceed 1.03.
"""

from __future__ import annotations

import argparse
import logging
import warnings

from _common import MLPTask, alternate, fit_step_times

from lightning_accel import MFUMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: process CPU time (robust on a shared machine; use --threads 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    medians = alternate({
        "bare Trainer": lambda: fit_step_times([], args.steps, MLPTask, clock=args.clock),
        "MFUMonitor()": lambda: fit_step_times([MFUMonitor(print_summary=False)], args.steps, MLPTask,
                                               clock=args.clock),
    }, rounds=args.rounds)
    base = medians["bare Trainer"]
    print(f"clock: {args.clock}; torch threads: {__import__('torch').get_num_threads()}")
    print(f"{'variant':16s} {'median step':>12s} {'ratio':>7s}")
    for name, value in medians.items():
        print(f"{name:16s} {1e3 * value:10.2f}ms {value / base:7.3f}")


if __name__ == "__main__":
    main()
