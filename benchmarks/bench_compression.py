"""Gradient compression hooks side by side on the demo GPT, 2 CPU processes (gloo): bytes per step, step time,
final loss; then the α–β projection's verdict per interconnect preset.

Strategies: ``ddp``, ``ddp_bf16_compress``, ``ddp_powersgd`` (rank 4), ``ddp_topk`` (density 0.01), ``ddp_qsgd``
(7 levels, 4 bits). Every compressor starts after the same ``--warmup`` plain steps (PowerSGD's start_powerSGD_iter,
Top-K's / QSGD's start_iter), all fits use the same seed and data and run in the same two processes, alternating
A B C D E ... ``--repeats`` times. Per strategy (medians over the repeats, with the min-max spread):

* bytes per step each rank hands to the collectives after the warm-up (plain DDP: every fp32 gradient);
* step time (median of the steps after the warm-up and 5 more) and its ratio to ``ddp`` in the same round;
* final training loss: the mean of the last 10 steps' losses after ``--steps`` steps (same seed: the hooks'
  effect on convergence).

The projection (``core/scaling.py``) then scales a GPT-2-small-sized workload (124 M parameters, a 0.1 s compute
step: the order of an H100 step of 8 × 1024 tokens at 40 % MFU) and the demo GPT (its measured 2-process ddp step
as compute) to 8 and 64 devices on each preset link, and names the strategy that projects fastest.

    flock -x /tmp/la-cpu.lock python benchmarks/bench_compression.py --steps 60 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

STRATEGIES = ("ddp", "ddp_bf16_compress", "ddp_powersgd", "ddp_topk", "ddp_qsgd")


def _make(name: str, warmup: int) -> Any:
    from lightning_accel.strategies.ddp_compression import DDPCompressionStrategy

    if name == "ddp_powersgd":
        return DDPCompressionStrategy(compression="powersgd", matrix_approximation_rank=4, start_powerSGD_iter=warmup)
    if name == "ddp_topk":
        # the same warm-up as the others, then 1 % at once: this benchmark measures bytes and step time at the
        # target density (bench_topk_convergence.py measures the defaults' convergence)
        return DDPCompressionStrategy(
            compression="topk", density=0.01, start_iter=warmup, adaptive_warmup_steps=warmup, density_warmup_steps=0
        )
    if name == "ddp_qsgd":
        return DDPCompressionStrategy(compression="qsgd", levels=7, start_iter=warmup)
    return name


def _fits(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    import lightning_accel  # noqa: F401  (registers the strings)
    from lightning_accel.demo.task import DemoDataModule, GPTTask

    torch.set_num_threads(1)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self._last: float | None = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            now = time.perf_counter()
            if self._last is not None and trainer.global_step > args.warmup + 5:
                self.times.append(now - self._last)
            self._last = now
            self.losses.append(float(outputs["loss"]))

    out: dict[str, Any] = {n: {"time": [], "bytes": [], "loss": [], "ratio": []} for n in STRATEGIES}
    rank, params = 0, 0
    for _ in range(args.repeats):
        ddp_time = None
        for name in STRATEGIES:
            pl.seed_everything(0, verbose=False)
            record = Record()
            task = GPTTask()
            data = DemoDataModule(batch_size=args.batch_size, train_tokens=200_000, val_tokens=10_000)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=_make(name, args.warmup),
                max_steps=args.steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                callbacks=[record],
            )
            trainer.fit(task, datamodule=data)
            rank = trainer.global_rank
            params = sum(p.numel() for p in task.parameters())
            stats = getattr(trainer.strategy, "comm_stats", None)
            grad_bytes = params * 4
            if stats is None:
                per_step = grad_bytes
            else:  # after the warm-up, what a long run sends
                warm = args.warmup * grad_bytes if name != "ddp_bf16_compress" else 0
                steps = stats.steps - (args.warmup if name != "ddp_bf16_compress" else 0)
                per_step = (stats.bytes_sent - warm) / steps
            step = statistics.median(record.times)
            ddp_time = step if name == "ddp" else ddp_time
            out[name]["time"].append(step)
            out[name]["ratio"].append(step / ddp_time)
            out[name]["bytes"].append(per_step)
            out[name]["loss"].append(statistics.fmean(record.losses[-10:]))
    shapes = [list(p.shape) for p in GPTTask().parameters()]
    return {"rank": rank, "params": params, "shapes": shapes, "results": out}


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _report(data: dict[str, Any], args: argparse.Namespace) -> None:
    from lightning_accel.core.scaling import INTERCONNECTS, ScalingWorkload, powersgd_compression_ratio, project_scaling

    res, params = data["results"], data["params"]
    print(
        f"demo GPT ({params / 1e6:.2f} M parameters), 2 CPU processes (gloo, 1 thread each), {args.steps} steps, "
        f"batch {args.batch_size}, compression from step {args.warmup}; medians of {args.repeats} rounds "
        "[min-max]"
    )
    print(f"{'strategy':<18} {'bytes/step':>31} {'ratio':>7} {'step ms':>22} {'vs ddp':>18} {'final loss':>24}")
    for name in STRATEGIES:
        r = res[name]
        rate = params * 4 / statistics.median(r["bytes"])
        print(
            f"{name:<18} {_spread(r['bytes'], ',.0f'):>31} {rate:>6.1f}x "
            f"{_spread([t * 1e3 for t in r['time']], '.1f'):>22} {_spread(r['ratio'], '.2f'):>18} "
            f"{_spread(r['loss'], '.4f'):>24}"
        )
    ratio = powersgd_compression_ratio(data["shapes"], rank=4)
    gpt2 = ScalingWorkload(compute_s=0.1, params=124_000_000, powersgd_ratio=50.0)
    demo = ScalingWorkload(compute_s=statistics.median(res["ddp"]["time"]), params=params, powersgd_ratio=ratio)
    print("\nprojection (core/scaling.py): efficiency at 8 / 64 devices; fastest strategy")
    for label, w in (("GPT-2 small, 0.1 s step", gpt2), ("demo GPT, measured step", demo)):
        for link in INTERCONNECTS:
            pts = project_scaling(w, link, n=(8, 64), strategies=STRATEGIES)
            eff = {(p.strategy, p.n): p.efficiency for p in pts}
            cells = "  ".join(
                f"{s.replace('ddp_', '').replace('_compress', '')} {eff[s, 8]:.2f}/{eff[s, 64]:.2f}" for s in STRATEGIES
            )
            best = [max(STRATEGIES, key=lambda s, n=n: (eff[s, n], -STRATEGIES.index(s))) for n in (8, 64)]
            print(f"  {label:<24} {link:<15} {cells}   best: {best[0]} (8), {best[1]} (64)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10, help="plain all-reduce steps before compressing")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup + 15 or args.repeats < 1:
        parser.error(f"--steps {args.steps} must exceed --warmup + 15 = {args.warmup + 15}; --repeats >= 1")
    data = _fits(args)
    if data["rank"] == 0:
        _report(data, args)
        if args.out:
            Path(args.out).write_text(json.dumps(data["results"]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
