"""Pipeline parallelism on 2 CPU processes: the measured bubble vs (P-1)/(m+P-1), and the step time vs one process.

    python benchmarks/bench_pipeline.py [--steps 14] [--layers 8] [--width 256]
    python benchmarks/bench_pipeline.py --projection     # the 70B-class projection only (no processes)
    python benchmarks/bench_pipeline.py --balance        # balance="parameters" vs "time" (1F1B, m=4), 2 processes

Trains the demo GPT (``--layers`` blocks of width ``--width``, batch 16 x 64 tokens) with ``strategy="pp"``
(GPipe, 2 stages, one torch thread per process) for m in {1, 2, 4, 8} micro-batches, and reads each rank's bubble
from ``PipelineStrategy.stats`` (1 - the time its stage computed / the schedule's wall time, steps after the first
two). Rank 0 then times the same global batch in one process (plain forward/backward/step, one thread). Lightning's
DDP launcher re-runs this script for rank 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # noqa: F401  (registers "pp")
from lightning_accel.core.pipeline_plan import bubble_fraction
from lightning_accel.demo.model import GPT, GPTConfig
from lightning_accel.strategies.pipeline import PipelineStrategy

SEQ, BATCH, VOCAB = 64, 16, 256


class Task(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, data: torch.Tensor) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.data = data

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data[:, :-1], self.data[:, 1:]), batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Times(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t)


def projection() -> None:
    """What ``project_scaling`` says for a 70B-class model (Llama-2-70B shape) on 64 and 512 H100s."""
    from lightning_accel.core.scaling import ScalingWorkload, project_scaling

    params, tokens = 70 * 10**9, 8 * 4096  # 8 sequences of 4096 tokens per model replica per step
    # one device's step at 40 % MFU of the H100's 989 TFLOP/s dense bf16 (6 FLOPs per parameter and token)
    compute = 6 * params * tokens / (989e12 * 0.4)
    w = ScalingWorkload(
        compute_s=compute,
        params=params,
        grad_bytes=2,
        param_bytes=2,
        n_layers=80,
        hidden_size=8192,
        tokens_per_step=tokens,
        activation_bytes=2,
    )
    print(
        f"70B-class projection (80 layers, hidden 8192, bf16, {tokens} tokens per replica step, "
        f"InfiniBand NDR between nodes, NVLink inside): efficiency = ideal / projected step"
    )
    print(f"{'strategy':<34} {'N=64':>7} {'N=512':>7}")
    rows = [
        ("TP 8 x DP (no PP)", dict(strategies=["tp"], tp_size=8)),
        ("ZeRO-3 (no PP)", dict(strategies=["zero3"])),
        ("PP 4 x TP 8 x DP, m=16", dict(strategies=["pp"], tp_size=8, pp_size=4, microbatches=16)),
        ("PP 8 x TP 8 x DP, m=32", dict(strategies=["pp"], tp_size=8, pp_size=8, microbatches=32)),
        ("PP 8 x TP 8 x DP, m=8", dict(strategies=["pp"], tp_size=8, pp_size=8, microbatches=8)),
    ]
    for name, kw in rows:
        points = project_scaling(w, "infiniband_ndr", n=[64, 512], **kw)
        print(f"{name:<34} " + " ".join(f"{p.efficiency:>7.2f}" for p in points))


def balance(cfg: GPTConfig, data: torch.Tensor, steps: int) -> None:
    """1F1B, m=4 on 2 stages: the plan and median step time by parameter count and by measured time (measured on
    one micro-batch's shape, BATCH/4 x SEQ)."""
    out = []
    for how in ("parameters", "time"):
        times = Times()
        strategy = PipelineStrategy(microbatches=4, balance=how, balance_shape=(BATCH // 4, SEQ), print_plan=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            max_steps=steps,
            logger=False,
            strategy=strategy,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[times],
        )
        trainer.fit(Task(cfg, data))
        mine = {"bubble": strategy.stats.bubble(skip=2), "step": statistics.median(times.times[2:])}
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, mine)
        out.append(
            {
                "balance": how,
                "plan": [[r.start, r.stop - 1] for r in strategy.plan.blocks],
                "costs": list(strategy.plan.costs),
                "bubbles": [g["bubble"] for g in gathered],
                "step_ms": 1e3 * max(g["step"] for g in gathered),
            }
        )
    if trainer.global_rank == 0:
        for row in out:
            print(
                f"balance={row['balance']:<10} blocks per stage {row['plan']}  bubble rank0/1 "
                f"{row['bubbles'][0]:.3f}/{row['bubbles'][1]:.3f}  median step {row['step_ms']:.1f} ms"
            )
        print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--projection", action="store_true", help="print the 70B-class projection and stop")
    parser.add_argument("--balance", action="store_true", help="compare balance='parameters' with 'time' and stop")
    args = parser.parse_args()
    if args.projection:
        projection()
        return
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=args.layers, n_head=4, d_model=args.width)
    data = torch.randint(0, VOCAB, (BATCH * args.steps, SEQ + 1), generator=torch.Generator().manual_seed(0))
    if args.balance:
        balance(cfg, data, args.steps)
        return
    rows = []
    rank = 0
    for m in (1, 2, 4, 8):
        times = Times()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            max_steps=args.steps,
            logger=False,
            strategy=PipelineStrategy(schedule="gpipe", microbatches=m, print_plan=False),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[times],
        )
        trainer.fit(Task(cfg, data))
        stats = trainer.strategy.stats
        mine = {"bubble": stats.bubble(skip=2), "step": statistics.median(times.times[2:])}
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, mine)
        rank = trainer.global_rank
        rows.append((m, [g["bubble"] for g in gathered], statistics.median(g["step"] for g in gathered)))
    if rank != 0:
        return
    # one process, the same global batch, the same optimizer
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one = []
    for i in range(args.steps):
        start = time.perf_counter()
        rows_i = data[i * BATCH : (i + 1) * BATCH]
        F.cross_entropy(model(rows_i[:, :-1]).flatten(0, 1), rows_i[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        one.append(time.perf_counter() - start)
    one_step = statistics.median(one[2:])
    print(
        f"demo GPT {args.layers} x {args.width}, batch {BATCH} x {SEQ}, GPipe on 2 stages (2 processes, 1 thread "
        f"each) vs 1 process (1 thread): median step {one_step * 1e3:.1f} ms in one process"
    )
    print(f"{'m':>3} {'bubble rank0':>13} {'bubble rank1':>13} {'(P-1)/(m+P-1)':>14} {'step ms':>9} {'vs 1 proc':>10}")
    for m, bubbles, step in rows:
        print(
            f"{m:>3} {bubbles[0]:>13.3f} {bubbles[1]:>13.3f} {bubble_fraction(2, m):>14.3f} {step * 1e3:>9.1f} "
            f"{one_step / step:>9.2f}x"
        )
    print(json.dumps({"one_step_s": one_step, "rows": rows}))


if __name__ == "__main__":
    main()
    from lightning_accel.strategies.shutdown import exit_distributed

    exit_distributed()
