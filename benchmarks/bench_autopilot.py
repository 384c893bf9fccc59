"""Autopilot on CPU scenarios: its final configuration ÷ vanilla and ÷ the best configuration of an exhaustive grid
over the same knobs, the search's cost, and the held-out loss after the same samples.

Each scenario is a small Lightning run with one planted problem (or none). For each:

* **vanilla**: the run as written; **autopilot**: the same run with ``Autopilot(budget_seconds=B)`` (its search
  happens before training and is reported separately); **grid**: every combination of the knobs the Autopilot may
  change in that scenario (the same values it may choose), each set directly in the script;
* training samples/s is measured from ``on_train_batch_end`` after ``--skip`` warm-up batches (data wait included);
  every configuration runs ``--rounds`` times, rounds alternate over the configurations (A B C …, … C B A), and the
  median counts;
* **held-out loss**: after training, the mean loss on fixed held-out batches (another seed), vanilla vs autopilot.
  The Autopilot keeps only changes that pass its numerics guard, and its trial steps are undone, so the two are
  equal for data-loading changes and within rounding for the others.

Scenarios: ``data`` (a ``__getitem__`` that sleeps like network storage, ``num_workers=0``, the DataLoader passed
straight to ``fit``), ``compute`` (the demo GPT on memory-mapped tokens: nothing to fix),
``micro_batch`` (a per-call cost with batch 4 × accumulation 8; 400 optimizer steps, so that 32 × 1's ~0.4 s fit
is measured over more than a few dozen 1 ms batches), ``attention`` (hand-written attention),
``optimizer`` (Adam over many small tensors with the for-loop step), ``short_noisy`` (~20 ms steps of a wide MLP
with momentum SGD and a loader whose per-sample work is a small share of the step: the claimed speed-up against what
training measures where windows are short and the machine's noise is of the order of the gain).

    python benchmarks/bench_autopilot.py                 # all scenarios (~10 minutes on 2 cores)
    python benchmarks/bench_autopilot.py --scenarios data micro_batch --rounds 1
    python benchmarks/bench_autopilot.py --scenarios attention --verbose   # + every trial of every round

Naive real-model scripts (HF GPT-2 / Llama, litgpt, the demo GPT, several causes at once) against hand-tuned fp32
and bf16, and the 300-step whole-fit comparison, live in ``bench_autopilot_real.py`` (every run in its own process;
it builds its short fits from this file's scenarios):

    python benchmarks/bench_autopilot_real.py --scripts gpt2 llama --rounds 5 --out results.jsonl
    python benchmarks/bench_autopilot_real.py --short --rounds 3 --out results.jsonl
    python benchmarks/bench_autopilot_real.py --report results.jsonl --verbose
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel.callbacks.autopilot import Autopilot


# ------------------------------------------------------------------------------------------------ measuring
class Rate(pl.Callback):
    """Training samples/s from ``on_train_batch_end`` timestamps after ``skip`` batches (data wait included)."""

    def __init__(self, skip: int) -> None:
        self.skip, self.stamps, self.samples = skip, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())
        self.samples.append(_samples(batch))

    def rate(self) -> float:
        s = self.skip
        if len(self.stamps) <= s + 1:
            return float("nan")
        return sum(self.samples[s + 1 :]) / (self.stamps[-1] - self.stamps[s])


def _samples(batch: Any) -> int:
    while isinstance(batch, (list, tuple, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(batch.shape[0])


@dataclass
class Scenario:
    name: str
    what: str
    build: Callable[[dict[str, Any]], tuple[pl.LightningModule, Any, dict[str, Any]]]
    knobs: dict[str, list[Any]]
    vanilla: dict[str, Any]
    steps: int
    heldout: Callable[[pl.LightningModule], float]
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ scenarios
class Sleepy(Dataset):
    def __init__(self, n: int, dim: int, sleep_s: float) -> None:
        self.n, self.dim, self.sleep_s = n, dim, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.dim, generator=g)
        return x, x[:8].sum().unsqueeze(0)


class MLP(pl.LightningModule):
    def __init__(
        self,
        dim: int = 256,
        depth: int = 3,
        lr: float = 1e-3,
        optimizer: str = "sgd",
        impl: str = "default",
        extra_tensors: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(dim, dim), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(dim, 1))
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(16)) for _ in range(extra_tensors)])
        self.lr, self.optimizer, self.impl = lr, optimizer, impl

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if len(self.extra):
            out = out + sum(p.sum() for p in self.extra)
        return (out - y).square().mean()

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        flags = {"default": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[self.impl]
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, **flags)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, **flags)


def _heldout_mlp(dim: int) -> Callable[[pl.LightningModule], float]:
    g = torch.Generator().manual_seed(12345)
    x = torch.randn(256, dim, generator=g)
    y = x[:, :8].sum(1, keepdim=True)

    def loss(model: pl.LightningModule) -> float:
        with torch.no_grad():
            return float(model.loss((x, y)))

    return loss


def _callbacks(config: dict[str, Any]) -> list[Any]:
    from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

    return [DevicePrefetcher()] if config.get("prefetch") else []


def _sleepy_mlp(config: dict[str, Any], dim: int, sleep_s: float):
    """An MLP of width ``dim`` over a dataset whose every sample sleeps ``sleep_s``, with the config's loader knobs."""
    workers = config.get("num_workers", 0)
    loader = DataLoader(
        Sleepy(4096, dim, sleep_s),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=config.get("prefetch_factor") if workers else None,
    )
    return MLP(dim=dim, depth=3), loader, {"callbacks": _callbacks(config)}


def build_data(config: dict[str, Any]):
    return _sleepy_mlp(config, 256, 0.0015)


def build_short_noisy(config: dict[str, Any]):
    return _sleepy_mlp(config, 2048, 0.0001)


def build_micro_batch(config: dict[str, Any]):
    micro, accum = config["micro"]
    n = 8192
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 64, generator=g)
    data = TensorDataset(x, x[:, :8].sum(1, keepdim=True))

    class PerCall(MLP):
        def __init__(self) -> None:
            super().__init__(dim=64, depth=6)
            self.batch_size = micro

        def train_dataloader(self):
            return DataLoader(
                data, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(2)
            )

    return PerCall(), None, {"accumulate_grad_batches": accum}


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):  # nanoGPT's manual path
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = torch.softmax(att, dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, d))


class AttentionLM(pl.LightningModule):
    def __init__(self, d: int = 128, heads: int = 4, seq: int = 256, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Attention(d, heads, seq) for _ in range(layers)])
        self.head = nn.Linear(d, d)

    def loss(self, batch) -> torch.Tensor:
        (x,) = batch
        h = x
        for block in self.blocks:
            h = h + block(h)
        return (self.head(h) - x).square().mean()

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def build_attention(config: dict[str, Any]):
    from lightning_accel.attention import use_fused_attention

    model = AttentionLM()
    if config.get("fused_attention"):
        use_fused_attention(model, blocks=[f"blocks.{i}" for i in range(len(model.blocks))])
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(
        TensorDataset(torch.randn(512, 256, 128, generator=g)),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )
    return model, loader, {"callbacks": _callbacks(config)}


def _heldout_attention(model: pl.LightningModule) -> float:
    g = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        return float(model.loss((torch.randn(16, 256, 128, generator=g),)))


def build_optimizer(config: dict[str, Any]):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=g)
    loader = DataLoader(
        TensorDataset(x, x[:, :8].sum(1, keepdim=True)),
        batch_size=32,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )
    return MLP(dim=64, depth=2, optimizer="adam", impl=config.get("impl", "default"), extra_tensors=600), loader, {}


def build_compute(config: dict[str, Any]):
    from lightning_accel.demo.model import GPTConfig
    from lightning_accel.demo.task import DemoDataModule, GPTTask

    task = GPTTask(GPTConfig(seq_len=64, n_layer=4, d_model=128))
    data = DemoDataModule(seq_len=64, batch_size=32, train_tokens=400_000, num_workers=0, seed=0)
    from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

    return task, data, {"callbacks": _callbacks(config), "plugins": [AutoMixedPrecision(dtype=config["dtype"])]}


def _heldout_compute(model: pl.LightningModule) -> float:
    g = torch.Generator().manual_seed(12345)
    tokens = torch.randint(0, 256, (16, 65), generator=g)
    with torch.no_grad():
        logits = model.model(tokens[:, :-1]) if hasattr(model, "model") else model(tokens[:, :-1])
        return float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))


SCENARIOS = {
    "data": Scenario(
        "data",
        "1.5 ms sleep per sample (network-storage-like), num_workers=0, loader passed to fit",
        build_data,
        {"num_workers": [0, 1, 2], "prefetch": [False, True]},
        {"num_workers": 0, "prefetch": False},
        steps=160,
        heldout=_heldout_mlp(256),
    ),
    "short_noisy": Scenario(
        "short_noisy",
        "~20 ms steps (MLP of width 2048, SGD), a loader whose ~0.2 ms per sample is a small share of the step",
        build_short_noisy,
        {"num_workers": [0, 1], "prefetch": [False, True]},
        {"num_workers": 0, "prefetch": False},
        steps=300,
        heldout=_heldout_mlp(2048),
    ),
    "compute": Scenario(
        "compute",
        "demo GPT (0.8 M params) on memory-mapped tokens, AutoMixedPrecision(dtype='fp32')",
        build_compute,
        {"dtype": ["fp32", "bf16"], "prefetch": [False, True]},
        {"dtype": "fp32", "prefetch": False},
        steps=150,
        heldout=_heldout_compute,
    ),
    "micro_batch": Scenario(
        "micro_batch",
        "6-layer MLP of width 64 (per-call cost), batch 4 × accumulate 8",
        build_micro_batch,
        {"micro": [(4, 8), (8, 4), (16, 2), (32, 1)]},
        {"micro": (4, 8)},
        steps=400,
        heldout=_heldout_mlp(64),
    ),
    "attention": Scenario(
        "attention",
        "2 blocks of hand-written causal attention, seq 256, d 128",
        build_attention,
        {"fused_attention": [False, True], "prefetch": [False, True]},
        {"fused_attention": False, "prefetch": False},
        steps=40,
        heldout=_heldout_attention,
    ),
    "optimizer": Scenario(
        "optimizer",
        "Adam(foreach=False) over 600 small tensors + a small MLP",
        build_optimizer,
        {"impl": ["default", "foreach", "fused"]},
        {"impl": "default"},
        steps=150,
        heldout=_heldout_mlp(64),
    ),
}


# ------------------------------------------------------------------------------------------------ running
def fit(
    scenario: Scenario, config: dict[str, Any], skip: int, autopilot: Autopilot | None = None
) -> tuple[float, pl.LightningModule, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model, data, kwargs = scenario.build(config)
    rate = Rate(skip)
    callbacks = ([autopilot] if autopilot is not None else []) + kwargs.pop("callbacks", []) + [rate]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=scenario.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    )
    if data is None:
        trainer.fit(model)
    elif isinstance(data, pl.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, data)
    return rate.rate(), model, trainer


def grid(scenario: Scenario) -> list[dict[str, Any]]:
    keys = list(scenario.knobs)
    return [dict(zip(keys, values)) for values in itertools.product(*(scenario.knobs[k] for k in keys))]


def label(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def run_scenario(scenario: Scenario, rounds: int, skip: int, budget: float, verbose: bool = False) -> dict[str, Any]:
    configs = grid(scenario)
    rates: dict[str, list[float]] = {label(c): [] for c in configs}
    auto_rates: list[float] = []
    vanilla_by_round: list[float] = []
    claims: list[tuple[float | None, float | None, float | None]] = []
    searches: list[float] = []
    kept: list[str] = []
    losses: dict[str, float | None] = {"vanilla": None, "autopilot": None}
    runs: list[dict[str, Any] | None] = [None, *configs]  # None: the vanilla run under the Autopilot
    for r in range(rounds):
        for config in runs if r % 2 == 0 else list(reversed(runs)):
            if config is None:
                autopilot = Autopilot(budget_seconds=budget, print_summary=False, save_plan=False)
                rate, model, _ = fit(scenario, scenario.vanilla, skip, autopilot)
                auto_rates.append(rate)
                searches.append(autopilot.plan.search_seconds or 0.0)
                plan = autopilot.plan
                claims.append((plan.speedup if plan.kept else 1.0, plan.speedup_low, plan.speedup_high))
                kept = [k["change"] for k in autopilot.plan.kept]
                if verbose:  # the Autopilot's own table of this round: every trial with its reason
                    for rec in autopilot.records:
                        rate_s = f"{rec.samples_per_sec:9.1f}" if rec.samples_per_sec else " " * 9
                        print(
                            f"    round {r}: {rec.index:2d} {rec.name:22s} {rate_s} {'kept' if rec.kept else '    '}"
                            f"  {rec.reason}"
                        )
                if losses["autopilot"] is None:
                    losses["autopilot"] = scenario.heldout(model)
                continue
            rate, model, _ = fit(scenario, config, skip)
            rates[label(config)].append(rate)
            if config == scenario.vanilla:
                vanilla_by_round.append(rate)
            if config == scenario.vanilla and losses["vanilla"] is None:
                losses["vanilla"] = scenario.heldout(model)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    best = max(medians, key=lambda k: medians[k])
    return {
        "scenario": scenario.name,
        "what": scenario.what,
        "vanilla": medians[label(scenario.vanilla)],
        "autopilot": statistics.median(auto_rates),
        "grid_best": medians[best],
        "grid_best_config": best,
        "grid": medians,
        "kept": kept,
        # the Autopilot's claimed speed-up per round against what training measured after it (÷ the same round's
        # vanilla run, which ran next to it)
        "claims": claims,
        "measured": [a / v for a, v in zip(auto_rates, vanilla_by_round)],
        "search_seconds": statistics.median(searches),
        "loss_vanilla": losses["vanilla"],
        "loss_autopilot": losses["autopilot"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--verbose", action="store_true", help="print the Autopilot's trials of every round")
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration, alternating (default 2)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up batches not timed (default 10)")
    parser.add_argument(
        "--budget", type=float, default=30.0, help="Autopilot budget in seconds (default 30: 5 %% of a 10-minute fit)"
    )
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rounds={args.rounds}, budget={args.budget} s")
    rows = []
    for name in args.scenarios:
        t0 = time.perf_counter()
        row = run_scenario(SCENARIOS[name], args.rounds, args.skip, args.budget, args.verbose)
        rows.append(row)
        print(f"\n[{name}] {row['what']}  ({time.perf_counter() - t0:.0f} s)")
        for config, rate in row["grid"].items():
            print(f"  grid  {config:<45} {rate:10.1f} samples/s")
        print(f"  autopilot kept: {'; '.join(row['kept']) or 'nothing'}")
        for (claim, low, high), measured in zip(row["claims"], row["measured"]):
            interval = f" [{low:.2f}-{high:.2f}]" if low is not None and high is not None else ""
            print(f"  claimed {claim:.3f}x{interval}, measured {measured:.3f}x (÷ the round's vanilla run)")
    print(
        "\n| scenario | vanilla samples/s | autopilot samples/s | ÷ vanilla | grid best | ÷ grid best | search s | "
        "search ÷ 10-min fit | held-out loss vanilla → autopilot |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scenario']} | {r['vanilla']:.1f} | {r['autopilot']:.1f} | {r['autopilot'] / r['vanilla']:.2f} | "
            f"{r['grid_best']:.1f} ({r['grid_best_config']}) | {r['autopilot'] / r['grid_best']:.2f} | "
            f"{r['search_seconds']:.1f} | {r['search_seconds'] / 600:.1%} | "
            f"{r['loss_vanilla']:.6f} → {r['loss_autopilot']:.6f} |"
        )


if __name__ == "__main__":
    main()
