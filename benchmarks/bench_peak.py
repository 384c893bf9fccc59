"""The CPU peak MFU divides by: the hardware figure, the matmul probe over repeated runs, and the demo's MFU.

Run (CPU; each part separately on a shared machine):

    python benchmarks/bench_peak.py --part peak --probes 10          # hardware figure + probe spread (~20 s)
    python benchmarks/bench_peak.py --part demo --runs 3 --steps 200  # the demo's MFU, its peak and source

``peak`` prints the hardware figure (cores x clock x FLOPs per cycle, :func:`cpu_hardware_peak`) for fp32 and bf16,
then ``measure_peak_flops`` run ``--probes`` times at its default budget (0.25 s) and at ``--long-budget`` seconds,
alternated, its cache cleared before each: min / median / max and each as a fraction of the hardware figure, and
what ``resolve_peak_flops`` picks. ``demo`` runs ``lightning-accel demo`` (fp32, the default config) ``--runs`` times
and prints each run's peak source, peak, MFU of the summary, the largest logged ``perf/mfu`` and how many windows
raised the peak.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import tempfile
import warnings
from pathlib import Path


def spread(values: list[float]) -> str:
    return (
        f"min {min(values) / 1e9:.1f} / median {statistics.median(values) / 1e9:.1f} / "
        f"max {max(values) / 1e9:.1f} GFLOP/s"
    )


def part_peak(probes: int, long_budget: float) -> None:
    import torch

    from lightning_accel.core import peak

    hardware = {key: peak.cpu_hardware_peak(key) for key in ("fp32", "bf16")}
    for key, figure in hardware.items():
        print(f"{key} hardware: {figure.detail if figure else 'unknown'}")
    runs: dict[float, list[float]] = {0.25: [], long_budget: []}
    for _ in range(probes):
        for budget in runs:  # alternated, so a change in the machine's load hits both budgets alike
            peak._MEASURED.clear()
            runs[budget].append(peak.measure_peak_flops("cpu", "fp32", budget_s=budget))
    hw = hardware["fp32"].flops if hardware["fp32"] else None
    for budget, values in runs.items():
        share = (
            ""
            if hw is None
            else (
                f"; ÷ hardware: {min(values) / hw:.3f} / {statistics.median(values) / hw:.3f} / {max(values) / hw:.3f}"
            )
        )
        print(
            f"fp32 probe, budget {budget:g} s, {len(values)} runs, {torch.get_num_threads()} threads: "
            f"{spread(values)}{share}"
        )
    peak._MEASURED.clear()
    resolved = peak.resolve_peak_flops("cpu", "fp32")
    print(f"resolve_peak_flops('cpu', 'fp32') now: {resolved.flops / 1e9:.1f} GFLOP/s, {resolved.detail}")


def part_demo(runs: int, steps: int) -> None:
    from lightning_accel.demo.run import DemoConfig, run_demo

    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            result = run_demo(DemoConfig(steps=steps, quiet=True, progress_bar=False, output_dir=tmp))
            with open(Path(tmp) / "demo" / "version_0" / "metrics.csv") as f:
                logged = [float(r["perf/mfu"]) for r in csv.DictReader(f) if r.get("perf/mfu")]
        s = result["mfu_monitor"]
        print(
            f"run {i + 1}: MFU {100 * s['mfu']:.1f} % (summary), max logged perf/mfu {max(logged):.3f} over "
            f"{len(logged)} windows, peak {s['peak_flops'] / 1e9:.1f} GFLOP/s raised by {s['peak_raises']} "
            f"window(s), initial {s['peak_flops_initial'] / 1e9:.1f} GFLOP/s: {s['peak_source_initial']}; "
            f"achieved {s['flops_per_sec_per_device'] / 1e9:.1f} GFLOP/s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("peak", "demo"), required=True)
    parser.add_argument("--probes", type=int, default=10, help="probe runs per budget (peak)")
    parser.add_argument("--long-budget", type=float, default=2.0, help="the longer probe budget in seconds (peak)")
    parser.add_argument("--runs", type=int, default=3, help="demo runs (demo)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per demo run (demo)")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.part == "peak":
        part_peak(args.probes, args.long_budget)
    else:
        part_demo(args.runs, args.steps)


if __name__ == "__main__":
    main()
