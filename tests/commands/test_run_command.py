"""``lightning-accel run`` and ``LIGHTNING_ACCEL`` on user scripts that import nothing of ours, run as processes: the
reports appear, the script runs as ``python script.py`` would (argv, ``sys.path[0]``, every exit status), a plan
that fits is applied bit for bit as the same fixes written by hand, one that does not is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_accel.attach import ENV_VAR
from lightning_accel.core.autopilot import AutopilotPlan, model_fingerprint
from tests.conftest import LAUNCH_VARIABLES, REPO

HAS_PLOTS = importlib.util.find_spec("matplotlib") is not None

#: a plain Lightning script: batch 8 × accumulation 4; ``--hand`` writes in by hand the fixes of the plan below
SCRIPT = """
import argparse, sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    parser.add_argument("--end", default="normal", choices=["normal", "exit3", "raise"])
    parser.add_argument("--hand", action="store_true")
    args = parser.parse_args()
    print("ARGV", sys.argv[1:], "PATH0", sys.path[0], flush=True)
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    kwargs, plugins = dict(batch_size=8, accumulate=4), []
    if args.hand:  # the plan's two fixes, written in by hand
        import lightning_accel as la
        kwargs, plugins = dict(batch_size=16, accumulate=2), [la.AutoMixedPrecision(dtype="bf16")]
    loader = DataLoader(data, batch_size=kwargs["batch_size"], shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=args.steps, accumulate_grad_batches=kwargs["accumulate"], plugins=plugins,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = Net()
    trainer.fit(model, loader)
    if args.out:
        torch.save(model.state_dict(), args.out)
    if args.end == "exit3":
        sys.exit(3)
    if args.end == "raise":
        raise RuntimeError("the script's own error")


if __name__ == "__main__":
    main()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and k != ENV_VAR}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=300)


def _lightning_accel_run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "lightning_accel.cli", "run", *args], cwd, **env)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _plan(script: Path, **identity: object) -> AutopilotPlan:
    spec = importlib.util.spec_from_file_location("user_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fields = {
        "fingerprint": model_fingerprint(module.Net()),
        "device": "cpu",
        "world_size": 1,
        "global_batch": 32,
        **identity,
    }
    return AutopilotPlan(
        kept=[
            {"name": "micro_batch", "params": {"batch_size": 16, "accumulate_grad_batches": 2}},
            {"name": "precision", "params": {"dtype": "bf16"}},
        ],
        model="Net",
        **fields,
    )


def test_run_trains_the_script_as_python_would_and_says_where_the_reports_are(script, tmp_path):
    done = _lightning_accel_run(["--html", "--watch", script.name, "--steps", "40"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ARGV ['--steps', '40'] PATH0 {tmp_path}" in done.stdout
    folder = tmp_path / "lightning_accel"  # the script has no logger
    written = ["bottleneck_report.json", "bottleneck_report.windows.jsonl"]
    if HAS_PLOTS:  # the page's plots need matplotlib; without it the doctor says so and writes the rest
        written.append("bottleneck_report.html")
    else:
        assert "pip install 'lightning-accel[plots]'" in done.stderr
    for name in written:
        assert (folder / name).exists(), name
        assert str(folder / name) in done.stderr
    assert f"lightning-accel watch {tmp_path}" in done.stderr
    assert json.loads((folder / "bottleneck_report.json").read_text())["batches"] > 0


@pytest.mark.parametrize(("end", "status"), [("exit3", 3), ("raise", 1)])
def test_the_scripts_exit_status_is_the_runs(script, tmp_path, end, status):
    done = _lightning_accel_run([str(script), "--end", end], tmp_path)
    assert done.returncode == status, done.stderr[-3000:]
    if end == "raise":
        assert "RuntimeError: the script's own error" in done.stderr


def test_a_keyboard_interrupt_ends_the_run_as_it_ends_python(tmp_path):
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    plain = _run([sys.executable, "interrupted.py"], tmp_path)
    done = _lightning_accel_run(["interrupted.py"], tmp_path)
    assert plain.returncode == -signal.SIGINT
    assert done.returncode == plain.returncode


def test_run_dash_m_runs_a_module_with_its_arguments(tmp_path):
    package = tmp_path / "jobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import sys\nprint('MODULE', __name__, sys.argv[1:])\nsys.exit(5)\n")
    done = _lightning_accel_run(["-m", "jobs.train", "--lr", "1"], tmp_path)
    assert done.returncode == 5
    assert "MODULE __main__ ['--lr', '1']" in done.stdout


def test_a_lightning_cli_script_is_attached_by_the_variable_alone(tmp_path):
    pytest.importorskip("jsonargparse")
    (tmp_path / "cli.py").write_text(
        textwrap.dedent(
            """
            import torch
            from lightning.pytorch.cli import LightningCLI
            from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

            if __name__ == "__main__":
                LightningCLI(BoringModel, BoringDataModule)
            """
        )
    )
    args = ["fit", "--trainer.max_steps=30", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"]
    done = _run([sys.executable, "cli.py", *args], tmp_path, **{ENV_VAR: "doctor,mfu"})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = list((tmp_path / "lightning_logs").rglob("bottleneck_report.json"))
    assert len(reports) == 1


def test_a_pytorch_lightning_script_is_attached_too(script, tmp_path):
    pytest.importorskip("pytorch_lightning")
    (tmp_path / "pl_train.py").write_text(
        script.read_text().replace("lightning.pytorch as pl", "pytorch_lightning as pl")
    )
    done = _run([sys.executable, "pl_train.py", "--steps", "30"], tmp_path, **{ENV_VAR: f"doctor,dir:{tmp_path / 'r'}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "r" / "bottleneck_report.json").read_text())["batches"] > 0


@pytest.mark.distributed
def test_under_ddp_every_rank_is_attached_and_rank_zero_writes_one_report(tmp_path):
    (tmp_path / "ddp.py").write_text(
        SCRIPT.replace('accelerator="cpu",', 'accelerator="cpu", devices=2, strategy="ddp",')
    )
    done = _lightning_accel_run(["--report-dir", "reports", "ddp.py", "--steps", "40"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "reports" / "bottleneck_report.json").read_text())
    assert report["world_size"] == 2
    assert len(report["rank_shares"]) == 2  # each rank measured and sent its row
    assert len(list(tmp_path.rglob("bottleneck_report.json"))) == 1


def test_a_plan_that_fits_trains_bit_for_bit_as_the_fixes_written_by_hand(script, tmp_path):
    plan = _plan(script).save(tmp_path / "autopilot_plan.json")
    replayed = _lightning_accel_run(["--plan", str(plan), script.name, "--out", "replayed.pt"], tmp_path)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    by_hand = _run([sys.executable, script.name, "--hand", "--out", "hand.pt"], tmp_path)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    untouched = _run([sys.executable, script.name, "--out", "untouched.pt"], tmp_path)
    a, b, c = (torch.load(tmp_path / f"{n}.pt") for n in ("replayed", "hand", "untouched"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert untouched.returncode == 0 and not all(torch.equal(a[k], c[k]) for k in a)  # the plan changed something


def test_a_plan_made_for_another_run_is_refused_with_what_differs(script, tmp_path):
    plan = _plan(script, global_batch=64, world_size=2).save(tmp_path / "other.json")
    done = _lightning_accel_run(["--plan", str(plan), script.name, "--out", "never.pt"], tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "was not made for this run" in last
    assert "the global batch (plan: 64" in last and "this run: 32" in last
    assert "the number of devices (plan: 2, this run: 1)" in last
    assert not (tmp_path / "never.pt").exists()  # refused before training
