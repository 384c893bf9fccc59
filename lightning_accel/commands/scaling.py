"""``lightning-accel scaling``: will it scale? The demo GPT at 1 and N processes (same per-device batch), the
measured scaling efficiency and exposed communication, and the α–β projection to hundreds of devices.

Each measurement runs in its own interpreter (``python -m lightning_accel.commands.scaling --worker ...``; Lightning's
launcher starts the other ranks of the N-process run from the same command). The N-process run also times
all-reduces of 16 KiB … 16 MiB after training and fits the link's latency and bandwidth
(:func:`~lightning_accel.core.scaling.fit_interconnect`), so the projection is validated at N against the measured
run on the same link before it is extrapolated over the chosen interconnect.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_accel._atomic import atomic_path, atomic_write_text

ORDER = 35

#: the cost model's name for a strategy string (None: not modelled)
_MODELLED = {
    "ddp": "ddp",
    "ddp_fp16_compress": "ddp_fp16_compress",
    "ddp_bf16_compress": "ddp_bf16_compress",
    "ddp_powersgd": "ddp_powersgd",
    "deepspeed_zero1": "zero1",
    "deepspeed_zero2": "zero2",
    "deepspeed_zero3": "zero3",
    "fsdp2": "zero3",
    "tp": "tp",
    "pp": "pp",
}
_SIZES = (2**12, 2**16, 2**20, 2**22)  # fp32 elements of the all-reduce probe: 16 KiB ... 16 MiB


# ----------------------------------------------------------------------------------------------- worker
def _allreduce_probe() -> dict[str, list[float]]:
    """Median seconds of all-reduces of :data:`_SIZES` on the current process group (every rank calls it)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    sizes, seconds = [], []
    for numel in _SIZES:
        x = torch.ones(numel)
        dist.all_reduce(x)  # warm-up
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        sizes.append(float(numel * 4))
        seconds.append(statistics.median(times))
    return {"sizes": sizes, "seconds": seconds}


def _worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    import lightning.pytorch as pl

    from lightning_accel.demo.run import DemoConfig, run_demo

    probe: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.world_size > 1:
                probe.update(_allreduce_probe())

    cfg = DemoConfig(
        steps=args.steps,
        devices=args.devices,
        strategy=args.strategy if args.devices > 1 else None,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        n_layer=args.n_layer,
        d_model=args.d_model,
        seed=args.seed,
        window=args.window,
        val_every=args.steps,
        progress_bar=False,
        quiet=True,
        extra_callbacks=[Probe()],
    )
    result = run_demo(cfg)
    trainer = result["trainer"]
    if trainer.global_rank != 0:
        return 0
    summary, report = result["mfu_monitor"], result["doctor"]
    if not summary.get("samples_per_sec"):
        raise ValueError(f"scaling: too few steps to measure ({summary.get('note')}); raise --steps")
    params = [tuple(p.shape) for p in trainer.lightning_module.parameters()]
    shares = dict(report.shares) if report is not None else {}
    measured = bool(report is not None and getattr(report.context, "communication_measured", False))
    from lightning_accel.strategies.model_parallel import batch_replicas

    batches = args.devices // batch_replicas(trainer.strategy)  # different batches per step (TP ranks share one)
    out = {
        "devices": args.devices,
        "strategy": args.strategy,
        "samples_per_sec": summary["samples_per_sec"],
        "step_s": args.batch_size * batches / summary["samples_per_sec"],
        "param_shapes": params,
        "comm_share": shares.get("communication") if measured else None,
        "allreduce": probe or None,
    }
    atomic_write_text(Path(args.out), json.dumps(out))
    return 0


# ----------------------------------------------------------------------------------------------- parent
def _measure(args: argparse.Namespace, devices: int, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "lightning_accel.commands.scaling",
        "--worker",
        "--out",
        str(out),
        "--devices",
        str(devices),
        "--strategy",
        args.strategy,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--n-layer",
        str(args.n_layer),
        "--d-model",
        str(args.d_model),
        "--seed",
        str(args.seed),
        "--window",
        str(args.window),
        "--threads",
        str(args.threads),
    ]
    launch = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout)[-3000:]
        errors = [line.split("ValueError: ", 1)[1] for line in tail.splitlines() if "ValueError: " in line]
        if errors:  # the run refused its configuration (e.g. a model tp cannot plan): one clear line
            raise ValueError(f"the {devices}-process run ({args.strategy}) refused: {errors[-1]}")
        raise RuntimeError(f"scaling: the {devices}-process run failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def _parse_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--project {text!r}: give device counts separated by commas, e.g. 8,64,512") from None
    bad = [c for c in counts if c < 1]
    if not counts or bad:
        raise ValueError(f"--project {text!r}: device counts must be integers >= 1 (got {bad or 'none'})")
    return counts


def scaling_report(
    one: dict[str, Any],
    many: dict[str, Any],
    *,
    project: list[int],
    interconnect: Any,
    tp_size: int,
    n_layer: int,
    d_model: int,
    tokens_per_step: int,
) -> dict[str, Any]:
    """Efficiency, validation of the model at N and the projection (pure: from the two workers' results)."""
    from lightning_accel.core.scaling import (
        ScalingWorkload,
        fit_interconnect,
        powersgd_compression_ratio,
        project_scaling,
        scaling_efficiency,
    )

    n = many["devices"]
    strategy = many["strategy"]
    efficiency = scaling_efficiency(one["samples_per_sec"], many["samples_per_sec"], n)
    shapes = [tuple(s) for s in one["param_shapes"]]
    params = sum(int(_prod(s)) for s in shapes)
    workload = ScalingWorkload(
        compute_s=one["step_s"],
        params=params,
        powersgd_ratio=powersgd_compression_ratio(shapes),
        n_layers=n_layer,
        hidden_size=d_model,
        tokens_per_step=tokens_per_step,
    )
    out: dict[str, Any] = {
        "devices": n,
        "strategy": strategy,
        "throughput_1": one["samples_per_sec"],
        "throughput_n": many["samples_per_sec"],
        "efficiency": efficiency,
        "step_1_s": one["step_s"],
        "step_n_s": many["step_s"],
        # weak scaling: what the N-process step spends beyond the 1-process step
        "overhead_share": max(0.0, 1 - one["step_s"] / many["step_s"]),
        "comm_share": many.get("comm_share"),
        "params": params,
    }
    modelled = _MODELLED.get(strategy)
    if many.get("allreduce") and modelled:
        link = fit_interconnect(many["allreduce"]["sizes"], many["allreduce"]["seconds"], n)
        # the measured pp run: n stages, n micro-batches (the strategy's default), no TP
        sizes = {"tp_size": 1, "pp_size": n, "microbatches": n} if modelled == "pp" else {"tp_size": n}
        (at_n,) = project_scaling(workload, link, n=[n], strategies=[modelled], tp_interconnect=link, **sizes)
        out["measured_link"] = {"bandwidth_gbs": link.bandwidth / 1e9, "latency_us": link.latency * 1e6}
        out["predicted_efficiency"] = at_n.efficiency
        out["predicted_exposed_s"] = at_n.exposed_s
        if many.get("comm_share") is not None:
            out["measured_exposed_s"] = many["comm_share"] * many["step_s"]
    names = ["ddp", "ddp_bf16_compress", "ddp_powersgd", "zero1", "zero2", "zero3", "tp", "pp"]
    points = project_scaling(workload, interconnect, n=project, strategies=names, tp_size=tp_size)
    out["projection"] = [
        {
            "strategy": p.strategy,
            "n": p.n,
            "tp_size": p.tp_size,
            "step_s": p.step_s,
            "exposed_share": p.exposed_share,
            "efficiency": p.efficiency,
        }
        for p in points
    ]
    out["fixes"] = _fixes(out, workload, interconnect, project, tp_size)
    return out


def _prod(shape: Any) -> int:
    total = 1
    for s in shape:
        total *= int(s)
    return total


def _fixes(out: dict[str, Any], workload: Any, interconnect: Any, project: list[int], tp_size: int) -> list[str]:
    """The fixes to name (pure): for the measured run when its efficiency is below 0.9, then for the projection
    when ddp projects below 0.9 at the largest count, then for memory when model states outgrow one device."""
    from dataclasses import replace

    from lightning_accel.core.scaling import project_scaling

    fixes: list[str] = []
    eff, n, lost = out["efficiency"], out["devices"], out["overhead_share"]
    if eff < 0.9:
        comm = out.get("comm_share")
        head = f"measured efficiency {eff:.0%} at {n} processes: the {n}-process step is {lost:.0%} longer"
        if comm is None:
            fixes.append(
                f"{head}; communication was not timed under {out['strategy']} (no DDP comm hook): run "
                "--strategy ddp to see the all-reduce's share"
            )
        elif comm >= 0.5 * lost:
            fixes.append(
                f"{head}, mostly exposed all-reduce ({comm:.0%} of the step): strategy='ddp_bf16_compress' "
                "halves its bytes (then 'ddp_powersgd'), accumulate_grad_batches=k divides it by k"
            )
        else:
            fixes.append(
                f"{head}, but exposed all-reduce is only {comm:.0%} of it: the rest is compute slowed by "
                "running N processes (shared cores, memory bandwidth) or a straggler: see the doctor's "
                "per-rank shares"
            )
    big = max(project)
    by = {p["strategy"]: p for p in out["projection"] if p["n"] == big}
    ddp = by["ddp"]["efficiency"]
    if ddp < 0.9:
        best = max(by.values(), key=lambda p: p["efficiency"])
        if best["efficiency"] > ddp + 0.02:  # name another strategy only when it clearly helps
            hint = {
                "ddp_bf16_compress": "strategy='ddp_bf16_compress' (half the bytes)",
                "ddp_powersgd": "strategy='ddp_powersgd' (low-rank gradients; compare the loss curve once)",
                "tp": f"tensor parallelism inside the node (strategy='fsdp2_tp', TP {tp_size})",
                "pp": f"pipeline parallelism across nodes x TP {tp_size} inside (strategy='pp_ddp')",
                "zero1": "strategy='deepspeed_zero1'",
                "zero2": "strategy='deepspeed_zero2'",
                "zero3": "strategy='deepspeed_zero3'",
            }[best["strategy"]]
            fixes.append(f"at {big} devices ddp projects {ddp:.0%}; {hint} projects {best['efficiency']:.0%}")
        (acc,) = project_scaling(
            replace(workload, compute_s=4 * workload.compute_s), interconnect, n=[big], strategies=["ddp"]
        )
        fixes.append(
            f"accumulate_grad_batches=4 (one all-reduce per 4 micro-batches) lifts ddp at {big} devices to "
            f"{acc.efficiency:.0%}"
        )
    states = 16 * workload.params  # fp32 weights + gradients + Adam's two moments
    if ddp < 0.9 or states > 40e9:
        fixes.append(
            f"model states are ~{states / 1e9:.1f} GB per device under DDP (16 B/parameter with Adam): "
            "ZeRO-1/2 shard them for as many bytes as DDP (2Ψ), ZeRO-3 / fsdp2 for 1.5× (3Ψ) — choose a "
            "stage for memory, not speed (lightning-accel estimate-zero); past one node's memory, "
            "tensor parallelism inside the node ('fsdp2_tp')"
        )
    return fixes


def _print(report: dict[str, Any], interconnect: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    n = report["devices"]
    m = Table(
        title=f"measured: demo GPT, 1 vs {n} processes ({report['strategy']}), same per-device batch",
        header_style="bold",
    )
    for col in ("processes", "samples/s", "step (ms)", "efficiency", "exposed comm (doctor)"):
        m.add_column(col, justify="right")
    m.add_row("1", f"{report['throughput_1']:,.1f}", f"{1e3 * report['step_1_s']:,.1f}", "1.00", "-")
    comm = report["comm_share"]
    m.add_row(
        str(n),
        f"{report['throughput_n']:,.1f}",
        f"{1e3 * report['step_n_s']:,.1f}",
        f"{report['efficiency']:.2f}",
        "not timed" if comm is None else f"{comm:.1%}",
    )
    console.print(m)
    if "predicted_efficiency" in report:
        link = report["measured_link"]
        measured = report.get("measured_exposed_s")
        console.print(
            f"model check at {n}: all-reduce probe fits {link['bandwidth_gbs']:.2f} GB/s, "
            f"{link['latency_us']:.0f} µs; predicted exposed communication "
            f"{1e3 * report['predicted_exposed_s']:.2f} ms/step"
            + ("" if measured is None else f" (measured by the doctor: {1e3 * measured:.2f} ms)")
            + f", predicted efficiency {report['predicted_efficiency']:.2f} (measured "
            f"{report['efficiency']:.2f}: the rest is compute slowed by sharing cores, memory "
            "bandwidth or a straggler)"
        )
    counts = sorted({p["n"] for p in report["projection"]})
    t = Table(
        title=f"projected efficiency on {interconnect.name} ({interconnect.bandwidth / 1e9:g} GB/s, "
        f"{interconnect.latency * 1e6:g} µs), {report['params'] / 1e6:.2f} M parameters, "
        f"step {1e3 * report['step_1_s']:.1f} ms",
        header_style="bold",
    )
    t.add_column("strategy")
    for c in counts:
        t.add_column(f"N={c}", justify="right")
    rows: dict[str, dict[int, Any]] = {}
    for p in report["projection"]:
        rows.setdefault(p["strategy"], {})[p["n"]] = p
    for name, by_n in rows.items():
        t.add_row(
            name + (" (TP×DP)" if name == "tp" else ""),
            *[f"{by_n[c]['efficiency']:.2f}" if c in by_n else "-" for c in counts],
        )
    console.print(t)
    for fix in report["fixes"]:
        console.print(f"- {fix}")


def _plot(report: dict[str, Any], path: str) -> None:
    from lightning_accel._imports import require

    matplotlib = require("matplotlib", "lightning-accel scaling --plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows: dict[str, list[tuple[int, float]]] = {}
    for p in report["projection"]:
        rows.setdefault(p["strategy"], []).append((p["n"], p["efficiency"]))
    for name, pts in rows.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.plot([report["devices"]], [report["efficiency"]], "k*", markersize=12, label="measured")
    if "predicted_efficiency" in report:
        ax.plot(
            [report["devices"]],
            [report["predicted_efficiency"]],
            "kx",
            markersize=10,
            label="model on the measured link",
        )
    ax.set_title(f"{report['params'] / 1e6:.2f} M params, measured {report['strategy']} at {report['devices']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png")


def _run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from lightning_accel.core.scaling import Interconnect, get_interconnect

    if args.devices < 2:
        raise ValueError(f"scaling: --devices {args.devices}: compare 1 with N >= 2 processes")
    project = _parse_counts(args.project)
    if args.bandwidth_gbs is not None:
        link = Interconnect("custom", args.bandwidth_gbs * 1e9, (args.latency_us or 0.0) * 1e-6)
    else:
        link = get_interconnect(args.interconnect)
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_accel  # noqa: F401

    if args.strategy not in StrategyRegistry:
        raise ValueError(
            f"scaling: --strategy {args.strategy!r} is not a registered strategy; use e.g. ddp, "
            "ddp_bf16_compress, fsdp2"
        )
    with tempfile.TemporaryDirectory() as tmp:
        one = _measure(args, 1, Path(tmp) / "one.json")
        many = _measure(args, args.devices, Path(tmp) / "many.json")
    report = scaling_report(
        one,
        many,
        project=project,
        interconnect=link,
        tp_size=args.tp_size,
        n_layer=args.n_layer,
        d_model=args.d_model,
        tokens_per_step=args.batch_size * args.seq_len,
    )
    _print(report, link)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(report, indent=2))
    if args.plot:
        _plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "scaling",
        help="measured scaling efficiency at 1 vs N processes and a projection to hundreds of devices",
        description="Train the demo GPT at 1 and N processes with the same per-device batch, print throughput, "
        "scaling efficiency (throughput_N / (N x throughput_1)) and the exposed communication share, "
        "check the α-β communication model against the N-process run, and project efficiency for "
        "ddp, compression, ZeRO-1/2/3 and TP x DP to the --project device counts.",
    )
    parser.add_argument("--devices", type=int, default=2, help="N processes to compare with 1 (default %(default)s)")
    parser.add_argument("--strategy", default="ddp", help="strategy of the N-process run (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="per-device batch (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="default %(default)s")
    parser.add_argument("--n-layer", type=int, default=4, help="default %(default)s")
    parser.add_argument("--d-model", type=int, default=128, help="default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument("--window", type=int, default=5, help="MFUMonitor window in steps (default %(default)s)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default %(default)s: one core each, a fair 1 vs N)",
    )
    parser.add_argument("--project", default="8,64,512", help="device counts to project (default %(default)s)")
    parser.add_argument(
        "--interconnect",
        default="infiniband_ndr",
        help="link of the projection: nvlink, infiniband_ndr, 100gbe, 25gbe (default %(default)s)",
    )
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="custom link: GB/s per device")
    parser.add_argument("--latency-us", type=float, default=None, help="custom link: µs per message step")
    parser.add_argument("--tp-size", type=int, default=8, help="TP size of the TP x DP projection (default 8)")
    parser.add_argument("--json", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None, help="save the projection plot here (needs matplotlib)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run (default %(default)s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=_run)


if __name__ == "__main__":  # a worker: python -m lightning_accel.commands.scaling --worker ...
    _parser = argparse.ArgumentParser(prog="lightning-accel scaling")
    _sub = _parser.add_subparsers(dest="command")
    register(_sub)
    sys.exit(_run(_parser.parse_args(["scaling", *sys.argv[1:]])))
