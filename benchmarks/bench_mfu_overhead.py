"""Overhead of MFUMonitor on the step time, measured two ways in one run.

Run: ``python benchmarks/bench_mfu_overhead.py`` (CPU; the workload's step takes tens of ms). Target ≤ 1.01,
must not exceed 1.03.

1. **Attributed** (the precise figure): the time spent inside MFUMonitor's hooks, summed over the measured steps
   (window closes included), divided by the time of those steps — what the callback adds to the step.
2. **A/B**: median step time with MFUMonitor ÷ a bare Trainer, alternating whole runs (A B, B A, ...). On a shared
   or virtualised CPU, run-to-run variation of the same configuration can exceed ±20 %, far above a 1 % effect, so
   this ratio is printed with each round's medians for judgement.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
import warnings

from _common import MLPTask, alternate, fit_step_times

from lightning_accel import MFUMonitor

HOOKS = (
    "on_fit_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_train_end",
)


def timed(callback: MFUMonitor, spent: dict[str, float]) -> MFUMonitor:
    """Wrap the callback's hooks (instance attributes, which Lightning looks up) to accumulate their time."""
    for name in HOOKS:
        original = getattr(callback, name)

        @functools.wraps(original)
        def wrapper(*args, __original=original, __name=name, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__name] = spent.get(__name, 0.0) + time.perf_counter() - start

        setattr(callback, name, wrapper)
    return callback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    attributed: list[float] = []

    def with_monitor() -> list[float]:
        spent: dict[str, float] = {}
        times = fit_step_times([timed(MFUMonitor(print_summary=False), spent)], args.steps, MLPTask)
        per_step_hooks = (spent.get("on_train_batch_start", 0.0) + spent.get("on_train_batch_end", 0.0)) / args.steps
        attributed.append(per_step_hooks / statistics.median(times))
        print(
            f"    MFUMonitor hooks: {1e6 * per_step_hooks:.1f} µs per step "
            f"(on_fit_start once: {1e3 * spent.get('on_fit_start', 0.0):.0f} ms, incl. the peak probe)"
        )
        return times

    medians = alternate(
        {"bare Trainer": lambda: fit_step_times([], args.steps, MLPTask), "MFUMonitor()": with_monitor},
        rounds=args.rounds,
    )
    base = medians["bare Trainer"]
    print(f"torch threads: {torch.get_num_threads()}; {args.rounds} rounds x {args.steps} steps")
    print(
        f"attributed overhead: hook time ÷ step time = {1 + statistics.median(attributed):.4f} "
        f"(median over rounds; max {1 + max(attributed):.4f})"
    )
    print(f"{'variant':16s} {'median step':>12s} {'ratio':>7s}   (A/B, whole runs alternated)")
    for name, value in medians.items():
        print(f"{name:16s} {1e3 * value:10.2f}ms {value / base:7.3f}")


if __name__ == "__main__":
    main()
