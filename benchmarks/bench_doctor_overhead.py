"""Overhead of BottleneckDoctor (default settings) together with MFUMonitor, against a bare Trainer.

Both arms train the same CPU MLP (``_common.MLPTask``: steps of tens of ms) with the same step clock
(``_common.StepTimes``, the host time between ``on_train_batch_end`` calls); the arms alternate A B A B ... within
one run, so machine noise hits both. Printed: the median step time per arm and their ratio (doctor + MFUMonitor ÷
bare; target <= 1.01, must not exceed 1.03), and the paired ratio of mean step times, which also counts the
once-per-window work (a gather, ``pl_module.log`` calls) that a median leaves out.

Run: ``python benchmarks/bench_doctor_overhead.py [--rounds 6] [--steps 110] [--width 512]``
"""

from __future__ import annotations

import argparse
import logging
import statistics
import warnings

import torch
from _common import MLPTask, fit_step_times

from lightning_accel import BottleneckDoctor, MFUMonitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="A/B pairs (default 6)")
    parser.add_argument("--steps", type=int, default=110,
                        help="steps per fit (default 110: two of the doctor's 50-batch windows close)")
    parser.add_argument("--width", type=int, default=512, help="MLPTask width (default 512: ~20-50 ms steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    def make_model() -> MLPTask:
        return MLPTask(width=args.width, batches=args.steps)

    arms = {
        "bare Trainer": lambda: [],
        "BottleneckDoctor + MFUMonitor": lambda: [MFUMonitor(print_summary=False, prog_bar=False),
                                                  BottleneckDoctor(report_path=False, print_report=False)],
    }
    steps: dict[str, list[float]] = {name: [] for name in arms}
    medians: dict[str, list[float]] = {name: [] for name in arms}
    means: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, callbacks in arms.items():
            times = fit_step_times(callbacks(), args.steps, make_model)
            steps[name].extend(times)
            medians[name].append(statistics.median(times))
            means[name].append(statistics.fmean(times))
    base, other = arms
    median = {name: statistics.median(t) for name, t in steps.items()}
    # paired per round (the two fits of a round ran back to back): robust to the load drifting between rounds
    paired_median = statistics.median(d / b for d, b in zip(medians[other], medians[base]))
    paired = statistics.median(d / b for d, b in zip(means[other], means[base]))
    w = args.width
    print(f"workload: _common.MLPTask ({w}-{2 * w}-{2 * w}-{w}, batch 64, SGD), {args.threads} thread(s); "
          f"{args.rounds} rounds x {args.steps} steps per arm, alternating")
    print(f"{'arm':32s} {'median step':>12s} {'mean step':>10s}")
    for name in arms:
        print(f"{name:32s} {1e3 * median[name]:10.2f}ms {1e3 * statistics.median(means[name]):8.2f}ms")
    print(f"ratio of median steps: pooled {median[other] / median[base]:.3f}, paired per round (median over "
          f"rounds) {paired_median:.3f} (target <= 1.01, limit 1.03)")
    print(f"ratio of mean steps (paired per round, median over rounds; counts window closes): {paired:.3f}")


if __name__ == "__main__":
    main()
