"""Strategies side by side on CPU (2 processes, gloo): gradient bytes and step time, ZeRO memory estimate vs peak.

Part ``comm``: ``ddp``, ``ddp_bf16_compress`` and ``ddp_powersgd`` (rank 4, compression from step 2) train the same
MLP in the same two processes, alternating A B C A B C ... ``--repeats`` times; per strategy it prints the gradient
bytes each rank hands to all-reduce per step (plain DDP: every fp32 gradient; the others: counted by the
strategy's hook) and the median step time.

Part ``memory``: per configuration (plain DDP with torch AdamW, DeepSpeed ZeRO-1/2/3), two fresh processes build the
model (inside ``configure_model``, so ZeRO-3 partitions it at construction) and train a few steps; each rank
measures its peak resident memory above the pre-model baseline (``VmHWM`` from ``/proc/self/status`` after
writing 5 to ``/proc/self/clear_refs``, Linux only) and the script prints it next to
``estimate_zero_memory`` for fp32 training (4-byte parameters and gradients; K = 8 for torch AdamW, 12 for
DeepSpeed's ZeRO optimizers, which keep an fp32 master partition).

Run: ``flock /tmp/la-bench.lock python benchmarks/bench_strategies.py`` (about 4 minutes on a 2-core CPU;
``--part comm`` or ``--part memory`` for one half).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMM_STRATEGIES = ("ddp", "ddp_bf16_compress", "ddp_powersgd")
MEMORY_CONFIGS = ("ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _mlp_task(width: int, batches: int, batch_size: int, build_in_configure_model: bool) -> Any:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None
            if not build_in_configure_model:
                self.configure_model()

        def configure_model(self) -> None:
            if self.net is None:
                self.net = nn.Sequential(
                    nn.Linear(width, 2 * width),
                    nn.ReLU(),
                    nn.Linear(2 * width, 2 * width),
                    nn.ReLU(),
                    nn.Linear(2 * width, width),
                )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            data = torch.randn(2 * batch_size * batches, width, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=batch_size)

    return MLP()


def _child_comm(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    import lightning_accel  # noqa: F401
    from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._last: float | None = None

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            now = time.perf_counter()
            if self._last is not None and trainer.global_step > 5:
                self.times.append(now - self._last)
            self._last = now

    def make(name: str) -> Any:
        if name == "ddp_powersgd":
            return DDPCompressionStrategy(compression="powersgd", matrix_approximation_rank=4, start_powerSGD_iter=2)
        return name

    results: dict[str, dict[str, list[float]]] = {n: {"time": [], "bytes": [], "rate": []} for n in COMM_STRATEGIES}
    rank = 0
    for _ in range(args.repeats):
        for name in COMM_STRATEGIES:
            torch.manual_seed(0)
            timer = StepTimes()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=make(name),
                max_steps=args.steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[timer],
            )
            model = _mlp_task(args.width, args.steps, args.batch_size, build_in_configure_model=False)
            trainer.fit(model)
            rank = trainer.global_rank
            stats = getattr(trainer.strategy, "comm_stats", None)
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            if stats is None:  # plain DDP all-reduces every fp32 gradient once per step
                per_step, rate = grad_bytes, 1.0
            else:  # the window after PowerSGD's 2 warm-up steps is what a long run sees
                per_step, rate = stats.bytes_sent / stats.steps, stats.compression_rate
                if name == "ddp_powersgd":
                    warm = 2 * grad_bytes
                    per_step = (stats.bytes_sent - warm) / (stats.steps - 2)
                    rate = (stats.bytes_before - warm) / (stats.bytes_sent - warm)
            results[name]["time"].append(statistics.median(timer.times))
            results[name]["bytes"].append(per_step)
            results[name]["rate"].append(rate)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def _child_memory(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    import lightning_accel  # noqa: F401

    # fresh processes per configuration: the baseline excludes the model, the peak includes everything after
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.config,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # the strategy is set up inside fit; reset the peak right before the model exists
    model = _mlp_task(args.width, 4, args.batch_size, build_in_configure_model=True)
    _reset_peak_rss()
    baseline = _status_kb("VmRSS")
    trainer.fit(model)
    peak = _status_kb("VmHWM")
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(
        json.dumps({"peak_above_baseline": (peak - baseline) * 1024, "params": params})
    )


def _run_child(extra: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, __file__, *extra], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"child {extra} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "comm", "memory"), default="all")
    parser.add_argument("--repeats", type=int, default=3, help="A B C rounds for the comm part (default 3)")
    parser.add_argument("--steps", type=int, default=25, help="steps per comm fit (default 25; first 5 not timed)")
    parser.add_argument("--width", type=int, default=512, help="MLP width for the comm part (default 512)")
    parser.add_argument(
        "--memory-widths",
        type=int,
        nargs=2,
        default=(1024, 2048),
        help="two MLP widths for the memory part (default 1024 2048)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--child", choices=("comm", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:  # one rank of a 2-process child; it ends its process group (DeepSpeed's too)
        from lightning_accel.strategies.shutdown import exit_distributed

        (_child_comm if args.child == "comm" else _child_memory)(args)
        exit_distributed()

    tmp = Path(tempfile.mkdtemp(prefix="bench_strategies_"))
    if args.part in ("all", "comm"):
        out = tmp / "comm.json"
        _run_child(
            [
                "--child",
                "comm",
                "--out",
                str(out),
                "--repeats",
                str(args.repeats),
                "--steps",
                str(args.steps),
                "--width",
                str(args.width),
                "--batch-size",
                str(args.batch_size),
            ]
        )
        res = json.loads(out.read_text())
        base_t = statistics.median(res["ddp"]["time"])
        base_b = statistics.median(res["ddp"]["bytes"])
        print(
            f"\n## DDP gradient compression, 2 CPU processes (gloo), MLP width {args.width} "
            f"(batch {args.batch_size}/rank), median of {args.repeats} alternating rounds\n"
        )
        print("| strategy | bytes all-reduced / step / rank | vs ddp | compression rate | step time (ms) | vs ddp |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in COMM_STRATEGIES:
            t = statistics.median(res[name]["time"])
            b = statistics.median(res[name]["bytes"])
            r = statistics.median(res[name]["rate"])
            print(f"| `{name}` | {b:,.0f} | {b / base_b:.3f}x | {r:.2f} | {t * 1e3:.1f} | {t / base_t:.2f}x |")
    if args.part in ("all", "memory"):
        from lightning_accel.core.memory import estimate_zero_memory

        widths = args.memory_widths
        print(
            f"\n## ZeRO model-state memory on CPU: estimate vs measured peak, 2 processes, fp32, AdamW, MLP widths "
            f"{widths[0]} and {widths[1]}\n"
        )
        print(
            "Measured: peak RSS above the pre-model baseline, max over the 2 ranks. The per-parameter columns are "
            "the slope between the two widths, which cancels fixed overheads (imports, gloo, DataLoader).\n"
        )
        print(
            "| configuration | params (small / large) | estimate / rank, MB (small / large) | measured / rank, MB "
            "(small / large) | estimate B/param | measured B/param (slope) |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for config in MEMORY_CONFIGS:
            rows = []
            for width in widths:
                out = tmp / f"mem_{config}_{width}"
                _run_child(
                    [
                        "--child",
                        "memory",
                        "--config",
                        config,
                        "--out",
                        str(out),
                        "--width",
                        str(width),
                        "--batch-size",
                        str(args.batch_size),
                    ]
                )
                ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
                params = ranks[0]["params"]
                stage = 0 if config == "ddp" else int(config[-1])
                est = estimate_zero_memory(
                    params,
                    2,
                    stage,
                    param_bytes=4,
                    grad_bytes=4,
                    optimizer_bytes_per_param=8 if config == "ddp" else 12,
                ).device_total
                rows.append((params, est, max(r["peak_above_baseline"] for r in ranks)))
            (p0, e0, m0), (p1, e1, m1) = rows
            print(
                f"| `{config}` | {p0:,} / {p1:,} | {e0 / 1e6:.0f} / {e1 / 1e6:.0f} | {m0 / 1e6:.0f} / {m1 / 1e6:.0f} "
                f"| {(e1 - e0) / (p1 - p0):.1f} | {(m1 - m0) / (p1 - p0):.1f} |"
            )


if __name__ == "__main__":
    main()
