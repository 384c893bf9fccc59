"""The order of BottleneckDoctor's findings against the measured gain of removing each planted cause alone.

Two runs with several causes of clearly different sizes planted at once (sleeps, so that the sizes do not depend on
the machine's speed):

* ``single`` (1 process): slow validation (``validation_step`` sleeps, plus a tail that Lightning runs before
  ``on_validation_start``: ``on_validation_model_eval`` sleeps, so the next training batch waits for it), a slow
  loader (``__getitem__`` sleeps) and slow checkpoint saves (``on_save_checkpoint`` sleeps, every 25 steps);
* ``ddp`` (2 processes, gloo): a loader slow on every rank and rank 1 slower still (a straggler; rank 0 waits for
  it in the all-reduce).

Each round runs the full fit, then the fit with each cause removed alone (the order rotates from round to round);
the gain of a cause is ``1 - fit time without it / fit time with all``, the median over rounds with its range, of
the fit after start-up (from the first measured batch to the fit's end, the basis of the doctor's savings: wall time
between the doctor's hooks) and of the whole ``trainer.fit`` call (which under DDP also holds the launch of the
second process, a few noisy seconds that no cause changes). Causes are ranked by the first. The doctor's findings
come from the full fits; the order matches when the findings of the planted causes come in the
order of their measured gains (and no finding that no cause explains, such as ``communication``, comes before
them).

    python benchmarks/bench_doctor_findings.py --scenario single --rounds 3
    python benchmarks/bench_doctor_findings.py --scenario ddp --rounds 3
    python benchmarks/bench_doctor_findings.py --scenario single --rounds 1 --code ../older-checkout
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

REPO = Path(__file__).resolve().parent.parent

SINGLE = r"""
import json, os, sys, time
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor


def findings(report):
    # a doctor that lists the fit's findings apart (and has no saving) shows them after the step's
    shown = report.findings + [f for f in report.fit_findings if f not in report.findings]
    return [[f.rule, getattr(f, "saving", None), f.evidence] for f in shown]


def after_startup(report):
    # the fit clock runs from setup (after the launch of the other ranks) to the fit's end
    return report.fit["wall"] - report.fit["seconds"]["startup"]


torch.set_num_threads(1)
REMOVE = os.environ.get("REMOVE", "")
LOADER = 0.0 if REMOVE == "loader" else 0.0015        # per sample: 6 ms per batch of 4, ~0.9 s in all
VALIDATION = 0.03                                      # per validation batch: 4 x 30 ms per run
TAIL = 0.2                                             # before on_validation_start: in the next batch's wait
CHECKPOINT = 0.09                                      # per save, every 25 steps


class Data(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        if LOADER:
            time.sleep(LOADER)
        return torch.randn(64)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 64)

    def training_step(self, x, i):
        time.sleep(0.006)
        return self.net(x).pow(2).mean()

    def validation_step(self, x, i):
        time.sleep(VALIDATION)

    def on_validation_model_eval(self):
        super().on_validation_model_eval()
        time.sleep(TAIL)  # e.g. swapping in EMA weights: Lightning runs it before on_validation_start

    def on_save_checkpoint(self, checkpoint):
        time.sleep(CHECKPOINT)

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(16, 64), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


doctor = BottleneckDoctor(window=10, warmup_batches=2, report_path=False, print_report=False, warn=False)
callbacks = [doctor]
if REMOVE != "checkpoint":
    callbacks.append(ModelCheckpoint(dirpath=os.path.join(os.getcwd(), "ckpt"), every_n_train_steps=25, save_top_k=1))
trainer = pl.Trainer(accelerator="cpu", max_steps=152, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=REMOVE != "checkpoint", callbacks=callbacks,
                     val_check_interval=30, limit_val_batches=0 if REMOVE == "validation" else 4,
                     num_sanity_val_steps=0)
start = time.perf_counter()
trainer.fit(Model())
wall = time.perf_counter() - start
with open(os.environ["OUT"], "w") as fh:
    json.dump({"wall": wall, "after_startup": after_startup(doctor.report),
                   "findings": findings(doctor.report)}, fh)
"""

DDP = r"""
import json, os, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor


def findings(report):
    # a doctor that lists the fit's findings apart (and has no saving) shows them after the step's
    shown = report.findings + [f for f in report.fit_findings if f not in report.findings]
    return [[f.rule, getattr(f, "saving", None), f.evidence] for f in shown]


def after_startup(report):
    # the fit clock runs from setup (after the launch of the other ranks) to the fit's end
    return report.fit["wall"] - report.fit["seconds"]["startup"]


torch.set_num_threads(1)
REMOVE = os.environ.get("REMOVE", "")
RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOADER = 0.0 if REMOVE == "loader" else 0.001                      # per sample on every rank: 8 ms per batch
STRAGGLER = 0.003 if RANK == 1 and REMOVE != "straggler" else 0.0  # per sample more on rank 1: 24 ms per batch


class Data(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        if LOADER + STRAGGLER:
            time.sleep(LOADER + STRAGGLER)
        return torch.randn(128)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))

    def training_step(self, x, i):
        return (self.net(x) - x).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


doctor = BottleneckDoctor(window=10, warmup_batches=2, report_path=False, print_report=False, warn=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=122, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[doctor])
start = time.perf_counter()
trainer.fit(Model())
wall = time.perf_counter() - start
if trainer.global_rank == 0:
    with open(os.environ["OUT"], "w") as fh:
        json.dump({"wall": wall, "after_startup": after_startup(doctor.report),
                       "findings": findings(doctor.report)}, fh)

if __name__ == "__main__":
    from lightning_accel.strategies.shutdown import exit_distributed
    exit_distributed()
"""

#: scenario → (script, the causes removed one at a time, the finding each cause's fix is)
SCENARIOS = {
    "single": (
        SINGLE,
        ("validation", "loader", "checkpoint"),
        {"validation": "validation_heavy", "loader": "data_wait", "checkpoint": "checkpoint_heavy"},
    ),
    "ddp": (DDP, ("straggler", "loader"), {"straggler": "straggler", "loader": "data_wait"}),
}


def run(script: str, remove: str, workdir: Path, code: Path) -> dict:
    out = workdir / f"out_{remove or 'all'}.json"
    out.unlink(missing_ok=True)
    path = workdir / "script.py"
    path.write_text(script)
    env = {
        **os.environ,
        "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "REMOVE": remove,
        "OUT": str(out),
    }
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=workdir, env=env, capture_output=True, text=True, check=False, timeout=600
    )
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the {remove or 'full'} fit failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="single")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--code",
        type=Path,
        default=REPO,
        help="the checkout whose lightning_accel runs the fits (another version of the doctor)",
    )
    args = parser.parse_args()
    if not (args.code / "lightning_accel" / "__init__.py").is_file():
        parser.error(f"--code {args.code}: no lightning_accel package there; give a checkout of this repository")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1 round")
    script, causes, finding_of = SCENARIOS[args.scenario]
    configs = ["", *causes]
    walls: dict[str, list[float]] = {c: [] for c in configs}
    after: dict[str, list[float]] = {c: [] for c in configs}
    orders: list[list[tuple[str, float | None]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rotation = configs[r % len(configs) :] + configs[: r % len(configs)]
            for remove in rotation:
                t0 = time.perf_counter()
                result = run(script, remove, Path(tmp), args.code.resolve())
                walls[remove].append(result["wall"])
                after[remove].append(result["after_startup"])
                if not remove:
                    orders.append([(rule, saving) for rule, saving, _ in result["findings"]])
                print(
                    f"round {r + 1}: {'without ' + remove if remove else 'all causes':<20} fit "
                    f"{result['wall']:.2f} s, {result['after_startup']:.2f} s after start-up "
                    f"({time.perf_counter() - t0:.0f} s with the interpreter's)",
                    flush=True,
                )

    def gain(times: dict[str, list[float]], cause: str) -> list[float]:
        return [1 - w / f for w, f in zip(times[cause], times[""])]

    def cell(values: list[float], pct: bool = False) -> str:
        k = 100 if pct else 1
        return f"{k * statistics.median(values):.{1 if pct else 2}f} ({k * min(values):.1f}-{k * max(values):.1f})"

    by_gain = sorted(causes, key=lambda c: -statistics.median(gain(after, c)))
    print(
        f"\nscenario {args.scenario}: {args.rounds} round(s); with all causes the fit after start-up takes "
        f"{cell(after[''])} s, the whole fit {cell(walls[''])} s (median, range)"
    )
    print(
        "| cause removed alone | fit after start-up, s | gain after start-up | whole fit, s | gain of the whole fit "
        "| finding |"
    )
    print("|---|---|---|---|---|---|")
    for c in by_gain:
        print(
            f"| {c} | {cell(after[c])} | {cell(gain(after, c), pct=True)} % | {cell(walls[c])} | "
            f"{cell(gain(walls, c), pct=True)} % | `{finding_of[c]}` |"
        )
    expected = [finding_of[c] for c in by_gain]
    for r, order in enumerate(orders, 1):
        shown = ", ".join(
            f"{rule} {100 * saving:.1f} %" if saving is not None else f"{rule} n/a" for rule, saving in order
        )
        planted = [rule for rule, _ in order if rule in expected]
        first = [rule for rule, _ in order[: len(expected)]]
        verdict = "matches" if planted == expected and first == expected else "DOES NOT MATCH"
        print(f"round {r}: the doctor's findings (saving, share of the fit): {shown} -> order {verdict}")


if __name__ == "__main__":
    main()
