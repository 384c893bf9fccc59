"""Top-K's convergence against plain DDP: final training loss of ``ddp_topk`` (its defaults: density 1 %, DGC's
density warm-up, momentum correction for momentum SGD, 100 plain steps for Adam-family optimizers) vs ``ddp``,
2 CPU processes (gloo), the same seed and data.

One piece is one model and one optimizer: ``--model mlp`` (a 2-hidden-layer MLP, 85 k parameters, on a fixed
random teacher's 10-class labels) or ``--model gpt`` (the demo GPT of ``lightning-accel demo`` on its Markov
tokens), ``--optimizer adamw`` or ``sgd`` (momentum 0.9). Each piece runs ``ddp`` and ``ddp_topk`` alternately,
``--repeats`` times with seeds 0, 1, ...; both strategies are distributed (Lightning's ``DistributedSampler`` in
both), so a pair differs only in the gradient exchange. Final loss: the mean over both ranks of the last
``--last`` steps' training losses. Pieces write JSON (``--out``); ``--report`` prints the table of all of them:
per piece the median final loss of each strategy, the gap ``topk / ddp - 1`` per seed (median [min-max]); with
``--plain`` also Top-K without the recipe (error feedback and 2 plain steps only: the collection's earlier default).

    flock /tmp/cpu.lock python benchmarks/bench_topk_convergence.py --model mlp --optimizer adamw --out r/mlp-adamw.json
    python benchmarks/bench_topk_convergence.py --report r/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def _tasks(model: str, optimizer: str) -> tuple[Any, Any]:
    """(LightningModule, DataModule or train loader) for one piece."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    def make_optimizer(params: Any, lr_adamw: float, lr_sgd: float) -> torch.optim.Optimizer:
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=lr_adamw, weight_decay=0.01)
        return torch.optim.SGD(params, lr=lr_sgd, momentum=0.9)

    if model == "gpt":
        from lightning_accel.demo.task import DemoDataModule, GPTTask

        class Task(GPTTask):
            def configure_optimizers(self) -> torch.optim.Optimizer:
                if optimizer == "adamw":
                    return super().configure_optimizers()  # the demo's own: AdamW, lr 3e-3, betas (0.9, 0.95)
                return make_optimizer(self.parameters(), 0.0, 0.1)

        return Task(), DemoDataModule(batch_size=16, train_tokens=200_000, val_tokens=10_000)

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), 1e-3, 0.05)

    g = torch.Generator().manual_seed(1234)  # the data and the teacher: the same for every seed
    x = torch.randn(16384, 64, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    hidden = torch.randn(64, 64, generator=g) / 8
    y = (torch.tanh(x @ hidden) @ teacher).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    return MLP(), torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)


def _strategy(name: str) -> Any:
    if name != "topk_plain":
        return name
    from lightning_accel.strategies.ddp_compression import ddp_topk

    # Top-K without DGC's recipe (error feedback and 2 plain steps only), for reference
    return ddp_topk(density_warmup_steps=0, momentum_correction=False, adaptive_warmup_steps=0)


def _piece(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    import lightning_accel  # noqa: F401  (registers the strings)

    torch.set_num_threads(1)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            self.losses.append(float(outputs["loss"]))

    names = ("ddp", "ddp_topk") + (("topk_plain",) if args.plain else ())
    out: dict[str, Any] = {name: [] for name in names}
    out.update(density=[], compressed_steps=[])
    for seed in range(args.first_seed, args.first_seed + args.repeats):
        for name in names:
            pl.seed_everything(seed, verbose=False)
            task, data = _tasks(args.model, args.optimizer)
            record = Record()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=_strategy(name),
                max_steps=args.steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                callbacks=[record],
            )
            if isinstance(data, pl.LightningDataModule):
                trainer.fit(task, datamodule=data)
            else:
                trainer.fit(task, train_dataloaders=data)
            final = torch.tensor(statistics.fmean(record.losses[-args.last :]))
            final = float(trainer.strategy.reduce(final, reduce_op="mean"))  # both ranks' batches
            out[name].append(final)
            if name == "ddp_topk":
                state = trainer.strategy.compressor_state
                out["density"].append(state.current_density)
                out["compressed_steps"].append(trainer.strategy.comm_stats.compressed_steps)
            out["rank"] = trainer.global_rank
    return out


def _report(paths: list[str]) -> None:
    print("final training loss (mean of the last steps, both ranks), median over seeds; gap = topk/ddp - 1")
    print(f"{'piece':<12} {'seeds':>5} {'ddp':>8} {'ddp_topk':>9} {'gap median [min-max]':>26} {'no recipe':>10}")
    pieces: dict[str, dict[str, Any]] = {}
    for path in paths:  # a piece run in chunks of seeds: its files are merged
        part = json.loads(Path(path).read_text())
        merged = pieces.setdefault(part["piece"], {"piece": part["piece"]})
        for key in ("ddp", "ddp_topk", "topk_plain"):
            merged.setdefault(key, []).extend(part.get(key, []))
    for r in pieces.values():
        gaps = [t / d - 1 for d, t in zip(r["ddp"], r["ddp_topk"])]
        print(
            f"{r['piece']:<12} {len(gaps):>5} {statistics.median(r['ddp']):>8.4f} "
            f"{statistics.median(r['ddp_topk']):>9.4f} "
            f"{statistics.median(gaps):>+10.1%} [{min(gaps):+.1%} {max(gaps):+.1%}]"
            + (f" {statistics.median(r['topk_plain']):>10.4f}" if r.get("topk_plain") else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--last", type=int, default=32, help="steps whose losses make the final loss")
    parser.add_argument("--repeats", type=int, default=1, help="seeds (each one ddp then ddp_topk)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first-seed, first-seed + 1, ...")
    parser.add_argument("--plain", action="store_true", help="also run Top-K without DGC's recipe")
    parser.add_argument("--out", default=None, help="write this piece's JSON here")
    parser.add_argument("--report", nargs="+", default=None, help="print the table of these pieces' JSON files")
    args = parser.parse_args()
    if args.report:
        _report(args.report)
        return
    if args.steps <= args.last or args.repeats < 1:
        parser.error(f"--steps {args.steps} must exceed --last {args.last}; --repeats >= 1")
    out = _piece(args)
    if out["rank"] == 0:
        out["piece"] = f"{args.model}-{args.optimizer}"
        print(json.dumps(out))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
