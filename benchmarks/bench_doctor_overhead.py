"""Overhead of BottleneckDoctor (default settings) together with MFUMonitor: in-hook time ÷ step time, and A/B.

1. **In-hook** (the precise figure): every hook of both callbacks, and the doctor's wrappers (``batch_to_device``,
   the optimizer step hooks, ``save_checkpoint``), is timed with ``perf_counter`` while the same fit runs. Calls
   after the warm-up batches are the **steady-state** cost (window flushes included: gather, ``pl_module.log``,
   rules, psutil sample); their sum ÷ the measured steps' time is the overhead (target <= 0.3 %, bar 1 %). Calls in
   the warm-up batches and the once-per-fit hooks (``setup``, ``on_fit_start``, ``on_train_start``: smells and
   the optimizer preview; MFUMonitor's peak probe; FLOP counting on batch 0; ``on_train_end``/``on_fit_end``: the
   last window and the report) are the **one-off** costs, printed apart.
2. **A/B**: median step time with both callbacks ÷ a bare Trainer, the arms alternating A B A B within one run
   (step time = host time between ``on_train_batch_end`` calls, ``_common.StepTimes``). On a shared machine this
   ratio moves by a few percent run to run, far more than the effect; it is printed for judgement.

Run: ``python benchmarks/bench_doctor_overhead.py [--rounds 6] [--steps 110] [--width 512]``
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
import warnings
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from _common import MLPTask, StepTimes, fit_step_times

from lightning_accel import BottleneckDoctor, MFUMonitor

ONCE = ("setup", "on_fit_start", "on_train_start", "on_train_end", "on_fit_end", "teardown")
HOOKS = (
    *ONCE,
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_validation_start",
    "on_validation_end",
)
# the doctor's own wrappers, bound when it installs them in on_fit_start (so patch before fit)
WRAPPERS = (
    "_transfer_begin",
    "_transfer_end",
    "_before_optimizer_step_hook",
    "_after_optimizer_step",
    "_checkpoint_begin",
    "_checkpoint_end",
)


class BatchCounter(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1


def instrument(
    callback: Any, name: str, counter: BatchCounter, skip: int, steady: dict[str, float], once: dict[str, float]
) -> None:
    """Wrap ``callback``'s hooks (instance attributes, which Lightning looks up) to add their time to ``steady``
    (after the warm-up, per-step hooks) or ``once``."""
    names = HOOKS + (WRAPPERS if isinstance(callback, BottleneckDoctor) else ())
    for hook in names:
        original = getattr(callback, hook)

        @functools.wraps(original)
        def wrapper(*args: Any, __original: Any = original, __hook: str = hook, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                # on_train_batch_end of batch `skip - 1` still belongs to the warm-up (it starts the measuring)
                warm = counter.batches < skip
                key = f"{name}.{__hook}"
                if __hook in ONCE or warm:
                    once[key] += took
                else:
                    steady[key] += took

        setattr(callback, hook, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="A/B pairs (default 6)")
    parser.add_argument(
        "--steps", type=int, default=110, help="steps per fit (default 110: two of the doctor's 50-batch windows close)"
    )
    parser.add_argument("--width", type=int, default=512, help="MLPTask width (default 512: ~13 ms steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    def make_model() -> MLPTask:
        return MLPTask(width=args.width, batches=args.steps)

    ratios: list[float] = []
    steady_all: dict[str, list[float]] = defaultdict(list)
    once_all: dict[str, list[float]] = defaultdict(list)
    per_step_us: list[float] = []

    def instrumented() -> list[float]:
        steady: dict[str, float] = defaultdict(float)
        once: dict[str, float] = defaultdict(float)
        counter = BatchCounter()
        monitor = MFUMonitor(print_summary=False, prog_bar=False)
        doctor = BottleneckDoctor(report_path=False, print_report=False)
        skip = max(monitor.warmup_batches, 3)  # the doctor's default warm-up, or MFUMonitor's request
        instrument(monitor, "MFUMonitor", counter, skip, steady, once)
        instrument(doctor, "BottleneckDoctor", counter, skip, steady, once)
        recorder = StepTimes(skip=skip)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[monitor, doctor, counter, recorder],
        )
        torch.manual_seed(0)
        trainer.fit(make_model())
        measured = sum(recorder.times)
        ratios.append(sum(steady.values()) / measured)
        per_step_us.append(1e6 * sum(steady.values()) / len(recorder.times))
        for k, v in steady.items():
            steady_all[k].append(v / len(recorder.times))
        for k, v in once.items():
            once_all[k].append(v)
        return recorder.times

    arms = {
        "bare Trainer": lambda: fit_step_times([], args.steps, make_model),
        "BottleneckDoctor + MFUMonitor": instrumented,
    }
    medians: dict[str, list[float]] = {name: [] for name in arms}
    means: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            times = arms[name]()
            medians[name].append(statistics.median(times))
            means[name].append(statistics.fmean(times))
    base, other = arms
    paired_median = statistics.median(d / b for d, b in zip(medians[other], medians[base]))
    paired_mean = statistics.median(d / b for d, b in zip(means[other], means[base]))
    w = args.width
    print(
        f"workload: _common.MLPTask ({w}-{2 * w}-{2 * w}-{w}, batch 64, SGD), {args.threads} thread(s); "
        f"{args.rounds} rounds x {args.steps} steps per arm, alternating"
    )
    print(f"{'arm':32s} {'median step':>12s} {'mean step':>10s}")
    for name in arms:
        print(
            f"{name:32s} {1e3 * statistics.median(medians[name]):10.2f}ms {1e3 * statistics.median(means[name]):8.2f}ms"
        )
    print(
        f"in-hook overhead (steady state, window flushes included): {100 * statistics.median(ratios):.3f} % of the "
        f"step time, {statistics.median(per_step_us):.1f} µs per step (median over rounds; max "
        f"{100 * max(ratios):.3f} %; target <= 0.3 %, bar 1 %)"
    )
    print("  per hook, µs per step (median over rounds):")
    for key, values in sorted(steady_all.items(), key=lambda kv: -statistics.median(kv[1])):
        if statistics.median(values) * 1e6 >= 0.5:
            print(f"    {key:52s} {1e6 * statistics.median(values):8.1f}")
    print("  one-off costs, ms per fit (median over rounds):")
    for key, values in sorted(once_all.items(), key=lambda kv: -statistics.median(kv[1])):
        if statistics.median(values) * 1e3 >= 0.05:
            print(f"    {key:52s} {1e3 * statistics.median(values):8.2f}")
    print(f"A/B ratio of median steps (paired per round, median over rounds): {paired_median:.3f}")
    print(f"A/B ratio of mean steps (paired per round; counts window closes): {paired_mean:.3f}")


if __name__ == "__main__":
    main()
