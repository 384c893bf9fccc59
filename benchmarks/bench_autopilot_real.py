"""The Autopilot on naive real-model scripts and on short fits, every run in its own process.

Two parts:

**Real scripts** (:mod:`autopilot_scripts`: HF GPT-2 and HF Llama on eager attention, litgpt's GPT, the demo GPT;
each with Lightning's default fp32, ``AdamW(foreach=False)``, micro-batch 4 × ``accumulate_grad_batches=8`` and a
``num_workers=0`` loader that tokenises every sample, ~1 ms each). Per round, in separate processes, alternating
the order (A B C D, D C B A, …):

* ``vanilla``: the script as written;
* ``hand_fp32`` / ``hand_bf16``: the same knobs set by hand (SDPA, 32 × 1, ``AdamW(foreach=True)``, one worker),
  in fp32 and in ``bf16-mixed``; the better of the two is the *hand-tuned best*;
* ``autopilot``: the script as written plus ``Autopilot()`` at its defaults (``budget=0.05`` of the planned fit);
* ``--grid [KNOB ...]``: every combination of the knobs' values (``autopilot_scripts.GRID``; all knobs when none is
  named), each a run of its own: the best of them is what an exhaustive search reaches, and each search is
  reported against it (72 runs a script, 144 with an attention knob: about 20-40 minutes a script here);
  ``--grid-top K`` runs the K fastest points twice more, and the best is the best median (the fastest of many
  single runs is partly the luckiest).

``bert_cls`` is a classification script with validation (a BERT classifier, ``val_loss`` four times an epoch).

The fit is *planned* 10 minutes long — ``max_steps`` = 600 s ÷ vanilla's seconds per optimizer step, measured by
the round-0 vanilla run, which runs first — so the Autopilot's default budget is 5 % of a 10-minute fit; the run
is then stopped after ``--steps`` optimizer steps (a callback sets ``trainer.should_stop``). Training samples/s
from ``on_train_batch_end`` after ``--skip`` optimizer steps (data wait included; the search happens in
``on_fit_start``, before, and is reported apart: its seconds and its share of the planned 10-minute fit). The
held-out loss is the mean loss on fixed held-out batches (another seed) after the same ``--steps`` optimizer steps
(the same samples in every configuration: the global batch and the sampler's order are the same).

**Short fits** (``--short``): 300-step fits whose whole wall time (``trainer.fit``, the search included) is
compared, vanilla vs ``Autopilot()`` at its defaults: ``short_data`` (the planted ``data`` scenario of
``bench_autopilot.py``: a 1.5 ms sleep per sample, ``num_workers=0``; the data wait is most of the step) and
``short_decode`` (a ``LightningDataModule`` with ``num_workers=0`` and a ~0.4 ms load per sample, batch 32, plain
SGD: the shape the Autopilot's docs recommend it for; run it with ``--short-steps 2000``, ~35 s of steps),
``short_balanced`` (the demo GPT on memory-mapped tokens, Lightning's default precision, nothing planted) and
``short_checkpoint`` (the demo GPT at width 256 with ``ModelCheckpoint(every_n_train_steps=10)``, the newest kept:
a real save of weights + AdamW state to this disk every 10 steps; also ``hand_async``, the same fit with
``OrderedAsyncCheckpointIO`` set by hand).

Every run appends one JSON line to ``--out``; ``--report FILE`` prints the tables from such a file, so repeats
taken in separate sessions (under a CPU lock, a few minutes at a time) add up.

    python benchmarks/bench_autopilot_real.py --scripts gpt2 --rounds 1 --out /tmp/ap.jsonl
    python benchmarks/bench_autopilot_real.py --short --rounds 2 --out /tmp/ap.jsonl
    python benchmarks/bench_autopilot_real.py --report /tmp/ap.jsonl [--verbose]
    python benchmarks/bench_autopilot_real.py --quick      # smoke test: every script, a few steps, one round
    python benchmarks/bench_autopilot_real.py --optimizer-step --scripts gpt2 litgpt   # AdamW's step per knob value
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

RESULT = "RESULT-JSON "
#: extra runs of each of the grid's leading points (``--grid-top``)
GRID_REPEATS = 2
PLANNED_SECONDS = 600.0  # the fit the Autopilot is told about: 10 minutes of vanilla steps


# ------------------------------------------------------------------------------------------------ one run (child)
def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _callbacks(steps: int, skip: int) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    class Rate(pl.Callback):
        """Training samples/s after ``skip`` optimizer steps; stops the fit after ``steps`` optimizer steps."""

        def __init__(self) -> None:
            self.rows: list[tuple[float, int, int]] = []  # (time, global_step after the batch, samples)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            b = batch
            while isinstance(b, (list, tuple, dict)):
                b = next(iter(b.values())) if isinstance(b, dict) else b[0]
            self.rows.append((time.perf_counter(), trainer.global_step, int(b.shape[0])))
            if trainer.global_step >= steps:
                trainer.should_stop = True

        def rate(self) -> float:
            start = next((i for i, r in enumerate(self.rows) if r[1] >= skip), None)
            if start is None or start + 1 >= len(self.rows):
                return float("nan")
            return sum(r[2] for r in self.rows[start + 1 :]) / (self.rows[-1][0] - self.rows[start][0])

    rate = Rate()
    return rate, rate


def _autopilot_row(autopilot: Any) -> dict[str, Any]:
    plan = autopilot.plan
    return {
        "search_seconds": plan.search_seconds or 0.0,
        "kept": [k.get("change") or k.get("name") for k in plan.kept],
        "stopped": plan.stopped,
        "noise": plan.noise,
        "baseline_autopilot": plan.baseline_samples_per_sec,
        "final_autopilot": plan.final_samples_per_sec,
        "claimed_speedup": plan.speedup,
        "claimed_low": plan.speedup_low,
        "claimed_high": plan.speedup_high,
        "claim_source": plan.speedup_source,
        "trials": [
            {
                "index": r.index,
                "name": r.name,
                "change": r.change,
                "samples_per_sec": r.samples_per_sec,
                "vs_baseline": r.vs_baseline,
                "kept": r.kept,
                "reason": r.reason,
                "seconds": r.seconds,
                "shares": r.shares,
                "ratio": getattr(r, "ratio", None),
            }
            for r in autopilot.records
        ],
    }


def run_real(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit of one script in one configuration (in this process)."""
    import lightning.pytorch as pl
    import torch
    from autopilot_scripts import (
        HAND_TUNED,
        SCRIPTS,
        VANILLA,
        build,
        heldout_batches,
        heldout_loss,
        trained_config,
        trainer_arguments,
    )

    _quiet()
    script = SCRIPTS[spec["script"]]
    config = dict(VANILLA)
    if spec["variant"].startswith("hand"):
        config.update(HAND_TUNED, precision="bf16-mixed" if spec["variant"] == "hand_bf16" else "32-true")
    if spec["variant"] == "grid":
        config.update(spec["config"])
    config["micro"] = tuple(config["micro"])
    steps, skip = spec["steps"], spec["skip"]
    samples = (steps + 20) * 32  # the same dataset (and sample order) in every variant; trials may wrap epochs
    pl.seed_everything(0, verbose=False)
    module, kwargs = build(script, config, samples=samples)
    rate, _ = _callbacks(steps, skip)
    callbacks: list[Any] = [rate]
    autopilot = None
    max_steps = steps
    if spec["variant"] == "autopilot":
        from lightning_accel.callbacks.autopilot import Autopilot

        autopilot = Autopilot(print_summary=False, save_plan=False)
        callbacks.insert(0, autopilot)
        max_steps = spec["planned_steps"]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_arguments(script),
        **kwargs,
    )
    t0 = time.perf_counter()
    trainer.fit(module)
    wall = time.perf_counter() - t0
    row = {
        **spec,
        "samples_per_sec": rate.rate(),
        "wall_seconds": wall,
        "global_step": trainer.global_step,
        "loss": heldout_loss(module, heldout_batches(script=script)),
        "val_loss": float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics else None,
        "torch_threads": torch.get_num_threads(),
        "seconds_per_step": None,
    }
    rows = rate.rows
    start = next((i for i, r in enumerate(rows) if r[1] >= skip), None)
    if start is not None and rows[-1][1] > rows[start][1]:
        row["seconds_per_step"] = (rows[-1][0] - rows[start][0]) / (rows[-1][1] - rows[start][1])
    if autopilot is not None:
        row.update(_autopilot_row(autopilot))
    kept = [k.name for k in autopilot.kept] if autopilot is not None else []
    row["trained_config"] = trained_config(trainer, module, rows[-1][2] if rows else config["micro"][0], kept)
    return row


def _decode_fit() -> tuple[Any, Any, dict[str, Any]]:
    """The data-bound shape the Autopilot's docs recommend it for: a ``LightningDataModule`` whose loader has
    ``num_workers=0`` and a ~0.4 ms load per sample that releases the GIL (as file reads and image decoders do),
    batch 32, an MLP, plain SGD."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    class Decoded(Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(0.0004)
            g = torch.Generator().manual_seed(i)
            return torch.randn(64, generator=g), torch.randint(0, 10, (), generator=g)

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Decoded(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Net(), Data(), {}


def run_short(spec: dict[str, Any]) -> dict[str, Any]:
    """One 300-step fit (vanilla or with ``Autopilot()`` at its defaults); its whole wall time."""
    import tempfile

    import bench_autopilot as ba
    import lightning.pytorch as pl

    _quiet()
    steps = spec["steps"]
    pl.seed_everything(0, verbose=False)
    checkpoints = None
    if spec["scenario"] == "short_data":
        model, data, kwargs = ba.build_data({"num_workers": 0})
    elif spec["scenario"] == "short_decode":
        model, data, kwargs = _decode_fit()
    else:
        from lightning_accel.demo.model import GPTConfig
        from lightning_accel.demo.task import DemoDataModule, GPTTask

        width = 128 if spec["scenario"] == "short_balanced" else 256
        model = GPTTask(GPTConfig(seq_len=64, n_layer=4, d_model=width))
        data, kwargs = DemoDataModule(seq_len=64, batch_size=32, train_tokens=400_000, num_workers=0, seed=0), {}
        if spec["scenario"] == "short_checkpoint":  # a save every 10 steps, the newest kept (the last one removed)
            from lightning.pytorch.callbacks import ModelCheckpoint

            checkpoints = tempfile.TemporaryDirectory()
            kwargs["callbacks"] = [ModelCheckpoint(dirpath=checkpoints.name, every_n_train_steps=10, save_top_k=1)]
            if spec["variant"] == "hand_async":
                from lightning_accel.checkpoint_io import OrderedAsyncCheckpointIO

                kwargs["plugins"] = [OrderedAsyncCheckpointIO()]
    rate, _ = _callbacks(steps, 10)
    callbacks: list[Any] = [*kwargs.pop("callbacks", []), rate]
    autopilot = None
    if spec["variant"] == "autopilot":
        from lightning_accel.callbacks.autopilot import Autopilot

        autopilot = Autopilot(print_summary=False, save_plan=False)
        callbacks.insert(0, autopilot)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=checkpoints is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    )
    t0 = time.perf_counter()
    if isinstance(data, pl.LightningDataModule):
        trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, data)
    row = {
        **spec,
        "wall_seconds": time.perf_counter() - t0,
        "samples_per_sec": rate.rate(),
        "global_step": trainer.global_step,
    }
    if checkpoints is not None:
        row["checkpoints_left"] = sorted(os.listdir(checkpoints.name))
        checkpoints.cleanup()
    if autopilot is not None:
        row.update(_autopilot_row(autopilot))
    return row


# ------------------------------------------------------------------------------------------------ driver (parent)
def optimizer_step_ms(name: str, repeats: int = 15) -> dict[str, Any]:
    """One AdamW step (and ``zero_grad``) on script ``name``'s parameters, per optimizer knob value, in ms (median of
    ``repeats``): what the grid's optimizer knob can change of a step, beside the Autopilot's optimizer prior."""
    import torch
    from autopilot_scripts import SCRIPTS, VANILLA, build

    module, _ = build(SCRIPTS[name], dict(VANILLA), samples=64)
    params = [p for p in module.parameters() if p.requires_grad]
    row: dict[str, Any] = {"script": name, "tensors": len(params), "parameters": sum(p.numel() for p in params)}
    arguments = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    for knob, kwargs in arguments.items():
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        for _ in range(3):  # the state is created on the first step
            optimizer.step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
        row[knob] = 1e3 * statistics.median(times)
    return row


def _child(spec: dict[str, Any], out: Path | None, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(HERE.parent),
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"run {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    row = json.loads(lines[-1][len(RESULT) :])
    row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    row["commit"] = _commit()
    if out is not None:
        with out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _say(row: dict[str, Any]) -> None:
    what = row.get("script") or row.get("scenario")
    extra = ""
    if row["variant"] == "grid":
        extra = f"  {_config_name(row['config'])}"
    if row["variant"] == "autopilot":
        extra = f"  search {row['search_seconds']:.1f} s, kept: {'; '.join(row['kept']) or 'nothing'}"
    print(
        f"  {what:14s} {row['variant']:10s} {row['samples_per_sec']:9.1f} samples/s  "
        f"wall {row['wall_seconds']:6.1f} s  loss {row.get('loss', float('nan')):.5f}{extra}",
        flush=True,
    )


def drive_real(
    scripts: list[str],
    rounds: int,
    steps: int,
    skip: int,
    out: Path | None,
    planned: dict[str, int],
    variants: list[str],
    grid_knobs: list[str] | None = None,
    grid_top: int = 0,
) -> list[dict[str, Any]]:
    from autopilot_scripts import SCRIPTS, grid

    rows: list[dict[str, Any]] = []

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        row = _child(spec, out, timeout=900)
        rows.append(row)
        _say(row)
        return row

    for name in scripts:
        # the grid's points run among the other variants, in the same alternating order
        runs: list[tuple[str, dict[str, Any] | None]] = [(v, None) for v in variants]
        if grid_knobs is not None:
            runs += [("grid", c) for c in grid(SCRIPTS[name], grid_knobs)]
        for r in range(rounds):
            order = runs if r % 2 == 0 else list(reversed(runs))
            if name not in planned and ("vanilla", None) in order:  # a vanilla run measures the planned length first
                first = order.index(("vanilla", None))
                order = [("vanilla", None), *order[:first], *order[first + 1 :]]
            for variant, config in order:
                spec = {
                    "kind": "real",
                    "script": name,
                    "variant": variant,
                    "steps": steps,
                    "skip": skip,
                    "planned_steps": planned.get(name, steps),
                    **({"config": config} if config is not None else {}),
                }
                row = run(spec)
                if variant == "vanilla" and name not in planned and row.get("seconds_per_step"):
                    planned[name] = max(steps, math.ceil(PLANNED_SECONDS / row["seconds_per_step"]))
        if grid_knobs is not None and grid_top > 0:
            # the best of many single runs is biased upwards (the luckiest window wins): the leading points run
            # GRID_REPEATS more times, alternating, and the grid's best is the best median
            points = [r for r in rows if r.get("script") == name and r.get("variant") == "grid"]
            top = sorted(points, key=lambda r: -float(r.get("samples_per_sec") or 0.0))[:grid_top]
            for repeat in range(GRID_REPEATS):
                for row in top if repeat % 2 == 0 else list(reversed(top)):
                    run({k: row[k] for k in ("kind", "script", "variant", "steps", "skip", "planned_steps", "config")})
    return rows


def drive_short(scenarios: list[str], rounds: int, steps: int, out: Path | None) -> list[dict[str, Any]]:
    rows = []
    for name in scenarios:
        for r in range(rounds):
            variants = ["vanilla", "autopilot"] + (["hand_async"] if name == "short_checkpoint" else [])
            for variant in variants if r % 2 == 0 else list(reversed(variants)):
                row = _child({"kind": "short", "scenario": name, "variant": variant, "steps": steps}, out, timeout=900)
                rows.append(row)
                _say(row)
    return rows


def _planned_from(path: Path | None) -> dict[str, int]:
    """Planned lengths already measured (the first vanilla run of each script in ``path``), so later sessions
    tell the Autopilot the same fit length."""
    planned: dict[str, int] = {}
    if path is None or not path.exists():
        return planned
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "real" and row["variant"] == "autopilot" and row["script"] not in planned:
            planned[row["script"]] = row["planned_steps"]
    return planned


# ------------------------------------------------------------------------------------------------ report
def _spread(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def _config_name(config: dict[str, Any], pooled: tuple[str, ...] = ()) -> str:
    """A grid point's name; the knobs in ``pooled`` left out (points differing only in them share the name)."""
    micro, accumulate = config["micro"]
    parts = {
        "attention": str(config["attention"]),
        "precision": str(config["precision"]),
        "optimizer": str(config["optimizer"]),
        "micro": f"{micro} × {accumulate}",
        "num_workers": f"{config['num_workers']} workers",
    }
    names = [v for k, v in parts.items() if k not in pooled]
    return ", ".join(names + list(config.get("other", ())))


#: grid knobs whose points are pooled for the kept-configuration column: AdamW's step (for-loop, foreach or fused)
#: moves these scripts' 70-110 ms steps by 1-2 % (``--optimizer-step``: 0.5-2.2 ms), while single runs of one point
#: spread by 10-20 %, so points differing only in it are one configuration measured several times
POOLED_KNOBS = ("optimizer",)


def _best_median(points: dict[str, list[float]]) -> tuple[str, float]:
    """The point with the highest median rate, and that median."""
    return max(((k, statistics.median(v)) for k, v in points.items()), key=lambda kv: kv[1])


def grid_table(real: list[dict[str, Any]]) -> list[str]:
    """Per script with grid runs: the grid's best configuration (median of its runs) and each search's training
    rate ÷ that best, how many searches kept the most common set, and each search's kept configuration (read back
    from its trainer) as the grid measured it, ÷ the grid's best, with the points pooled over :data:`POOLED_KNOBS`:
    the search's choice apart from the noise of the one run after it."""
    lines = [
        "| script | grid points | grid best (samples/s) | each search ÷ grid best | searches ≥ 0.95× | same kept set "
        f"| grid best, pooled over {' and '.join(POOLED_KNOBS)} | each kept configuration ÷ it (its pooled runs) "
        "| kept ≥ 0.95× |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["script"] for r in real):
        points: dict[str, list[float]] = {}
        pooled: dict[str, list[float]] = {}
        for r in real:
            if r["script"] == name and r["variant"] == "grid":
                points.setdefault(_config_name(r["config"]), []).append(r["samples_per_sec"])
                pooled.setdefault(_config_name(r["config"], POOLED_KNOBS), []).append(r["samples_per_sec"])
        auto = [r for r in real if r["script"] == name and r["variant"] == "autopilot"]
        if not points:
            continue
        best_name, best = _best_median(points)
        ratios = [r["samples_per_sec"] / best for r in auto]
        kept = [("; ".join(r["kept"]) or "nothing") for r in auto]
        common = max((kept.count(k) for k in set(kept)), default=0)
        pooled_best_name, pooled_best = _best_median(pooled)
        kept_cells, kept_ratios = [], []
        for r in auto:
            runs = pooled.get(_config_name(r["trained_config"], POOLED_KNOBS)) if r.get("trained_config") else None
            if runs is None:
                kept_cells.append("not in the grid" if r.get("trained_config") else "–")
                continue
            kept_ratios.append(statistics.median(runs) / pooled_best)
            kept_cells.append(f"{kept_ratios[-1]:.2f} ({len(runs)})")
        lines.append(
            f"| {name} | {len(points)} | {best_name} ({best:.1f}, median of {len(points[best_name])}) | "
            f"{', '.join(f'{x:.2f}' for x in ratios) or '–'} | "
            f"{sum(x >= 0.95 for x in ratios)} of {len(ratios)} | {common} of {len(kept)} | "
            f"{pooled_best_name} ({pooled_best:.1f}, median of {len(pooled[pooled_best_name])}) | "
            f"{', '.join(kept_cells) or '–'} | {sum(x >= 0.95 for x in kept_ratios)} of {len(auto)} |"
        )
    return lines


def claims_table(real: list[dict[str, Any]]) -> list[str]:
    """Per script: each search's claimed speed-up (its final paired check, with its 90 % interval) against what its
    training then measured, ÷ the median of the script's vanilla runs (run beside it, before and after)."""
    lines = [
        "| script | kept | claimed [90 % interval], each search | measured ÷ vanilla median | claimed ÷ measured |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["script"] for r in real):
        vanilla = [r["samples_per_sec"] for r in real if r["script"] == name and r["variant"] == "vanilla"]
        auto = [r for r in real if r["script"] == name and r["variant"] == "autopilot"]
        if not vanilla or not auto:
            continue
        base = statistics.median(vanilla)
        claims = [r.get("claimed_speedup") or 1.0 for r in auto]
        measured = [r["samples_per_sec"] / base for r in auto]

        def interval(r: dict[str, Any]) -> str:
            low, high = r.get("claimed_low"), r.get("claimed_high")
            return f" [{low:.2f}–{high:.2f}]" if low is not None and high is not None else ""

        kept: dict[str, int] = {}
        for r in auto:
            key = "; ".join(r["kept"]) or "nothing"
            kept[key] = kept.get(key, 0) + 1
        lines.append(
            f"| {name} | {'<br>'.join(f'{k} ({n})' for k, n in kept.items())} | "
            f"{', '.join(f'{c:.2f}{interval(r)}' for c, r in zip(claims, auto))} | "
            f"{', '.join(f'{m:.2f}' for m in measured)} (vanilla {', '.join(f'{v:.0f}' for v in vanilla)}) | "
            f"{_spread([c / m for c, m in zip(claims, measured)])} |"
        )
    return lines


def report(rows: list[dict[str, Any]], verbose: bool = False, commit: str | None = None) -> str:
    """The tables (markdown) from result rows: per script, and per short-fit scenario."""
    if commit:  # the Autopilot's rows of that commit; vanilla and hand-tuned runs do not depend on its code
        rows = [r for r in rows if r["variant"] != "autopilot" or str(r.get("commit", "")).startswith(commit)]
    lines: list[str] = []
    real = [r for r in rows if r.get("kind") == "real"]
    if real:
        lines += [
            (
                "| script | vanilla samples/s | hand fp32 | hand bf16 | autopilot samples/s (each search) | "
                "÷ vanilla | ÷ hand-tuned best | held-out loss vanilla → autopilot | search s | "
                "search ÷ 10-min fit | kept (how many searches) |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r["script"] for r in real):
            by = {
                v: [r for r in real if r["script"] == name and r["variant"] == v]
                for v in ("vanilla", "hand_fp32", "hand_bf16", "autopilot")
            }
            med = {
                v: statistics.median([r["samples_per_sec"] for r in rs]) if rs else float("nan") for v, rs in by.items()
            }
            if commit and not by["autopilot"]:
                continue
            best = max(med["hand_fp32"], med["hand_bf16"])
            auto = [r["samples_per_sec"] for r in by["autopilot"]]
            losses_v = [r["loss"] for r in by["vanilla"]]
            losses_a = [r["loss"] for r in by["autopilot"]]
            search = [r["search_seconds"] for r in by["autopilot"]]
            kept: dict[str, int] = {}
            for r in by["autopilot"]:
                key = "; ".join(r["kept"]) or "nothing"
                kept[key] = kept.get(key, 0) + 1

            def runs(rs: list[dict[str, Any]]) -> str:
                return ", ".join(f"{r['samples_per_sec']:.0f}" for r in rs)

            lines.append(
                f"| {name} | {med['vanilla']:.1f} ({runs(by['vanilla'])}) | {med['hand_fp32']:.1f} "
                f"({runs(by['hand_fp32'])}) | {med['hand_bf16']:.1f} ({runs(by['hand_bf16'])}) | "
                f"{runs(by['autopilot'])} | {_spread([a / med['vanilla'] for a in auto])} | "
                f"{_spread([a / best for a in auto])} | "
                f"{statistics.median(losses_v) if losses_v else float('nan'):.5f} "
                f"({min(losses_v, default=float('nan')):.5f}–{max(losses_v, default=float('nan')):.5f}) → "
                f"{', '.join(f'{x:.5f}' for x in losses_a)} | {', '.join(f'{s:.1f}' for s in search)} | "
                f"{_spread([100 * s / PLANNED_SECONDS for s in search])} % | "
                f"{'<br>'.join(f'{k} ({n})' for k, n in kept.items())} |"
            )
        lines += ["", *claims_table(real)]
        if any(r["variant"] == "grid" for r in real):
            lines += ["", *grid_table(real)]
    short = [r for r in rows if r.get("kind") == "short"]
    if short and (not commit or any(r["variant"] == "autopilot" for r in short)):
        lines += [
            "",
            (
                "| short fit | vanilla wall s | autopilot wall s (search s) | vanilla ÷ autopilot "
                "wall (each pair) | kept / stopped |"
            ),
            "|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r["scenario"] for r in short):
            v = [r for r in short if r["scenario"] == name and r["variant"] == "vanilla"]
            a = [r for r in short if r["scenario"] == name and r["variant"] == "autopilot"]
            if commit and not a:
                continue
            vm = statistics.median([r["wall_seconds"] for r in v]) if v else float("nan")
            ratios = [vm / r["wall_seconds"] for r in a]
            walls_v = ", ".join(f"{r['wall_seconds']:.1f}" for r in v)
            walls_a = ", ".join(f"{r['wall_seconds']:.1f} ({r['search_seconds']:.1f})" for r in a)
            outcome = "<br>".join(sorted({("; ".join(r["kept"]) or "nothing") + " / " + str(r["stopped"]) for r in a}))
            hand = [r for r in short if r["scenario"] == name and r["variant"] == "hand_async"]
            if hand:  # the fix set by hand, for the same fit
                outcome += "<br>by hand (OrderedAsyncCheckpointIO): " + ", ".join(
                    f"{r['wall_seconds']:.1f} s ({vm / r['wall_seconds']:.2f}×)" for r in hand
                )
            lines.append(f"| {name} | {vm:.1f} ({walls_v}) | {walls_a} | {_spread(ratios)} | {outcome} |")
    if verbose:
        for r in rows:
            if r["variant"] != "autopilot":
                continue
            lines.append(
                f"\n{r.get('script') or r.get('scenario')} @ {r.get('commit')} {r.get('measured_at')}: "
                f"search {r['search_seconds']:.1f} s, noise {r.get('noise')}, stopped: {r.get('stopped')}"
            )
            for t in r["trials"]:
                sps = f"{t['samples_per_sec']:9.1f}" if t["samples_per_sec"] else " " * 9
                vs = f"{t['vs_baseline']:.3f}" if t["vs_baseline"] else "     "
                if t.get("ratio"):
                    vs += f" (paired {t['ratio']:.3f})"
                lines.append(
                    f"    {t['index']:2d} {t['name']:22s} {sps} {vs} {'kept' if t['kept'] else '    '}  "
                    f"{t['change']} — {t['reason']}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from autopilot_scripts import GRID, SCRIPTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--scripts", nargs="+", choices=list(SCRIPTS), default=None)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["vanilla", "hand_fp32", "hand_bf16", "autopilot"],
        choices=["vanilla", "hand_fp32", "hand_bf16", "autopilot"],
    )
    parser.add_argument(
        "--grid",
        nargs="*",
        default=None,
        metavar="KNOB",
        help="also run every combination of these knobs' values (all knobs when none is named)",
    )
    parser.add_argument(
        "--grid-top",
        type=int,
        default=3,
        metavar="K",
        help="with --grid: run the K fastest points twice more; the grid's best is then the best median",
    )
    parser.add_argument("--short", action="store_true", help="the 300-step whole-fit wall-time comparison")
    parser.add_argument(
        "--short-scenarios",
        nargs="+",
        default=["short_data", "short_balanced"],
        choices=["short_data", "short_decode", "short_balanced", "short_checkpoint"],
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps trained per real-script run")
    parser.add_argument("--skip", type=int, default=5, help="optimizer steps not timed (warm-up)")
    parser.add_argument("--short-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="append every run's JSON row here")
    parser.add_argument("--report", type=Path, default=None, help="print the tables of a results file and exit")
    parser.add_argument("--commit", default=None, help="with --report: only the Autopilot rows measured at this commit")
    parser.add_argument("--verbose", action="store_true", help="with --report: every Autopilot trial row")
    parser.add_argument("--quick", action="store_true", help="smoke test: every script, 6 steps, one round")
    parser.add_argument(
        "--optimizer-step", action="store_true", help="with --scripts: time one AdamW step per optimizer knob value"
    )
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        row = run_real(spec) if spec["kind"] == "real" else run_short(spec)
        print(RESULT + json.dumps(row), flush=True)
        return
    if args.report:
        rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        print(report(rows, args.verbose, args.commit))
        return
    if args.quick:
        rows = drive_real([n for n in SCRIPTS if SCRIPTS[n].missing() is None], 1, 6, 2, args.out, {}, args.variants)
        print(report(rows, verbose=True))
        return
    rows = []
    if args.grid is not None and set(args.grid) - set(GRID):
        parser.error(f"--grid {sorted(set(args.grid) - set(GRID))}: the knobs are {sorted(GRID)}")
    if args.scripts:
        missing = [f"{n}: {SCRIPTS[n].missing()}" for n in args.scripts if SCRIPTS[n].missing()]
        if missing:
            parser.error("; ".join(missing))
    if args.optimizer_step:
        print("| script | parameters (tensors) | AdamW step, ms: single / foreach / fused |\n|---|---|---|")
        for name in args.scripts or [n for n in SCRIPTS if SCRIPTS[n].missing() is None]:
            r = optimizer_step_ms(name)
            print(
                f"| {name} | {r['parameters'] / 1e6:.2f} M ({r['tensors']}) | "
                f"{r['single']:.2f} / {r['foreach']:.2f} / {r['fused']:.2f} |"
            )
        return
    if args.scripts:
        rows += drive_real(
            args.scripts,
            args.rounds,
            args.steps,
            args.skip,
            args.out,
            _planned_from(args.out),
            args.variants,
            args.grid,
            args.grid_top,
        )
    if args.short:
        rows += drive_short(args.short_scenarios, args.rounds, args.short_steps, args.out)
    if not rows:
        parser.error("give --scripts, --short, --quick or --report")
    print(report(rows))


if __name__ == "__main__":
    main()
