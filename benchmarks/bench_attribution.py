"""What the doctor's compute attribution costs, and what it finds in the demo's own model.

The demo task (``lightning_accel.demo``: a 4-layer GPT, d_model 128, sequence 64, vocabulary 256, batch 32, AdamW)
is trained with ``BottleneckDoctor(attribute_compute=False)`` (A) and ``BottleneckDoctor(attribute_compute=True)``
(B, the window right after the warm-up), alternating A B, B A for ``--rounds`` rounds of ``--steps`` steps each.
Per B run the report's ``attribution.overhead`` gives:

* ``window_s``: the wall time of the window's batches (one profiler warm-up step + ``--recorded`` recorded steps,
  module and stage ranges on);
* ``analysis_s``: reading the profiler's events into the table, and the gather;
* ``extra_s``: what the window added to the fit: ``window_s`` − its batches × the measured step, + ``analysis_s``.

Beside them: the step outside the window (the report's mean measured step, B ÷ A: the window adds nothing to
the other steps, so this should be 1 within the machine's noise), and one B run's attribution table and findings.

Run: ``python benchmarks/bench_attribution.py [--rounds 4] [--steps 80] [--recorded 3]``
"""

from __future__ import annotations

import argparse
import logging
import statistics
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_accel import BottleneckDoctor
from lightning_accel.demo.model import GPTConfig
from lightning_accel.demo.task import DemoDataModule, GPTTask


def run(attribute: bool, steps: int, recorded: int) -> Any:
    torch.manual_seed(0)
    doctor = BottleneckDoctor(
        window=20,
        warmup_batches=3,
        report_path=False,
        print_report=False,
        warn=False,
        log_metrics=False,
        attribute_compute=attribute,
        attribution_steps=recorded,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[doctor],
    )
    trainer.fit(GPTTask(GPTConfig()), datamodule=DemoDataModule(batch_size=32, train_tokens=200_000))
    return doctor.report


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--recorded", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # one thread: a 2-core machine shared with other work disturbs it least

    steps: dict[str, list[float]] = {"A": [], "B": []}
    window, analysis, extra, slow = [], [], [], []
    last = None
    for r in range(args.rounds):
        for arm in "AB" if r % 2 == 0 else "BA":
            report = run(arm == "B", args.steps, args.recorded)
            steps[arm].append(report.step_seconds)
            if arm == "B":
                over, win = report.attribution["overhead"], report.attribution["window"]
                window.append(over["window_s"])
                analysis.append(over["analysis_s"])
                extra.append(over["extra_s"])
                slow.append(over["window_s"] / win["batches"] / report.step_seconds)
                last = report
            print(f"round {r} {arm}: step {1e3 * report.step_seconds:.2f} ms", flush=True)
    ratios = [b / a for a, b in zip(steps["A"], steps["B"])]
    assert last is not None
    batches = last.attribution["window"]["batches"]
    print()
    print(f"| measure ({args.rounds} rounds, {args.steps} steps, window {batches} batches) | median (min–max) |")
    print("|---|---|")
    print(
        f"| step outside the window, ms: A / B | {spread([1e3 * s for s in steps['A']], '{:.2f}')} / "
        f"{spread([1e3 * s for s in steps['B']], '{:.2f}')} |"
    )
    print(f"| step outside the window, B ÷ A (paired by round) | {spread(ratios)} |")
    print(f"| window wall time, s | {spread(window)} |")
    print(f"| a window batch ÷ a measured step | {spread(slow, '{:.2f}')} |")
    print(f"| reading the events (analysis), s | {spread(analysis)} |")
    print(f"| added to the fit (extra_s), s | {spread(extra)} |")
    print()
    attr = last.attribution
    print(f"demo model, one B run: forward {attr['forward_ms']:.2f} ms, backward {attr['backward_ms']:.2f} ms a step")
    for row in attr["modules"]:
        top = row["ops"][0] if row["ops"] else {}
        print(
            f"  {'  ' * (row['depth'] > 2)}{row['module']:<28} {100 * row['share']:5.1f} %  "
            f"{top.get('name', '')} ({top.get('shapes', '')})"
        )
    compute = [f for f in last.findings if f.kind == "compute"]
    print("compute findings:", [(f.rule, f.module, round(f.saving or 0.0, 3)) for f in compute] or "none")


if __name__ == "__main__":
    main()
