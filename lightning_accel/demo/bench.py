"""``lightning-accel bench``: the demo task as vanilla Lightning and with the collection's recommended stack for the
device, side by side (alternating runs, medians), in one table.

This is how the README's headline claims are produced: every variant runs the same model, data, seed and steps;
``MFUMonitor`` measures throughput and MFU (warm-up and compilation excluded), ``BottleneckDoctor`` the stage shares,
and the process's peak memory is read around each run (CUDA allocator peak on a GPU, peak RSS on Linux CPUs).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from lightning_accel._checks import check_int
from lightning_accel.demo.run import DemoConfig, run_demo

__all__ = ["BenchResult", "recommended_stack", "run_bench"]


def recommended_stack(accelerator: str) -> dict[str, Any]:
    """The demo switches of the recommended stack for the device (as ``DemoConfig`` fields), and why.

    Both: ``AutoMixedPrecision(dtype="auto")`` (bf16/fp16 where the device runs them faster, else fp32 kept),
    ``TorchCompile`` (fusion, fewer launches) and ``DevicePrefetcher`` (the next batch is fetched — on a GPU pinned
    and copied on a side stream — while the step runs). The data is already memory-mapped (``TokenMemmapDataset``)
    in both variants.
    """
    return {"precision": "auto", "compile": True, "prefetch": True}


@dataclasses.dataclass
class BenchResult:
    """Medians over rounds of one variant."""

    name: str
    samples_per_sec: float
    mfu: float | None
    shares: dict[str, float]
    peak_memory_bytes: float | None
    rounds: list[float]
    search_seconds: float | None = None
    kept: list[str] = dataclasses.field(default_factory=list)


def _peak_meter(accelerator: str) -> Any:
    import torch

    from lightning_accel.core.memory_probe import PeakMemoryMeter

    device = torch.device("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    return PeakMemoryMeter(device)


def _one_run(cfg: DemoConfig) -> dict[str, Any]:
    meter = _peak_meter(cfg.accelerator)
    meter.reset()
    result = run_demo(cfg)
    summary, report = result["mfu_monitor"], result["doctor"]
    plan = result.get("autopilot")
    return {
        "samples_per_sec": summary.get("samples_per_sec") or 0.0,
        "mfu": summary.get("mfu"),
        "shares": dict(report.shares) if report is not None else {},
        "peak": float(meter.peak_bytes()),
        "search_seconds": plan.search_seconds if plan is not None else None,
        "kept": [k["change"] for k in plan.kept] if plan is not None else [],
    }


def run_bench(
    *,
    steps: int = 120,
    rounds: int = 2,
    accelerator: str = "cpu",
    batch_size: int = 32,
    compile_backend: str = "inductor",
    seed: int = 0,
    autopilot: bool = True,
    autopilot_budget: float = 30.0,
) -> list[BenchResult]:
    """Run vanilla, the recommended stack and (with ``autopilot``) the Autopilot ``rounds`` times each,
    alternating (A B C, C B A, ...); medians. The Autopilot's search runs before training and is not in its
    samples/s (``MFUMonitor`` measures the training); its seconds are reported beside it.

    Args:
        steps: optimizer steps per run (warm-up and compilation are excluded by ``MFUMonitor``).
        rounds: runs per variant.
        accelerator: ``"cpu"`` or ``"gpu"``.
        batch_size: per-device batch size for both variants.
        compile_backend: ``torch.compile`` backend of the stack (``"inductor"``; ``"aot_eager"`` for a quick check).
        seed: seed of data, weights and order.
        autopilot: add the Autopilot variant: ``Autopilot(budget_seconds=autopilot_budget)`` on the vanilla run with
            ``AutoMixedPrecision(dtype="fp32")`` (vanilla's numbers; the plugin lets the Autopilot trial the dtype).
        autopilot_budget: seconds the Autopilot may search per run.
    """
    for name, value in (("steps", steps), ("rounds", rounds), ("batch_size", batch_size)):
        check_int("bench", name, value, flag=True)
    base = DemoConfig(
        steps=steps,
        accelerator=accelerator,
        batch_size=batch_size,
        seed=seed,
        window=10,
        val_every=steps,
        progress_bar=False,
        quiet=True,
        compile_backend=compile_backend,
    )
    variants = {
        "vanilla Lightning": base,
        "recommended stack": dataclasses.replace(base, **recommended_stack(accelerator)),
    }
    if autopilot:
        # AutoMixedPrecision in fp32: vanilla's numbers, and the plugin the Autopilot needs to trial the dtype
        variants["Autopilot"] = dataclasses.replace(
            base, autopilot=True, autopilot_budget=autopilot_budget, precision="amp:fp32"
        )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name].append(_one_run(dataclasses.replace(variants[name])))
    results = []
    for name, rs in runs.items():
        mfus = [x["mfu"] for x in rs if x["mfu"] is not None]
        stages = {s for x in rs for s in x["shares"]}
        results.append(
            BenchResult(
                name=name,
                samples_per_sec=statistics.median(x["samples_per_sec"] for x in rs),
                mfu=statistics.median(mfus) if mfus else None,
                shares={s: statistics.median(x["shares"].get(s, 0.0) for x in rs) for s in stages},
                peak_memory_bytes=statistics.median(x["peak"] for x in rs),
                rounds=[x["samples_per_sec"] for x in rs],
                search_seconds=(
                    statistics.median(x["search_seconds"] for x in rs)
                    if all(x["search_seconds"] is not None for x in rs)
                    else None
                ),
                kept=rs[-1]["kept"],
            )
        )
    return results


def bench_table(results: list[BenchResult], *, title: str) -> Any:
    """A rich table: samples/s, MFU, the largest stage shares, peak memory and the ratio to the first variant."""
    from rich.table import Table

    base = results[0].samples_per_sec or float("nan")
    stages = sorted(
        {s for r in results for s, v in r.shares.items() if v >= 0.02},
        key=lambda s: -max(r.shares.get(s, 0.0) for r in results),
    )
    table = Table(title=title, header_style="bold")
    for col in ("variant", "samples/s (median)", "× vanilla", "MFU", *[f"{s} %" for s in stages], "peak memory"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.samples_per_sec:,.1f}",
            f"{r.samples_per_sec / base:.2f}",
            "n/a" if r.mfu is None else f"{100 * r.mfu:.1f} %",
            *[f"{100 * r.shares.get(s, 0.0):.1f}" for s in stages],
            "n/a" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 1e6:,.0f} MB",
        )
    return table
