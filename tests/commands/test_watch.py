"""``lightning-accel watch``: follows a running fit's window log from another process and exits when it ends."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO

FIT = """
import sys, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

torch.set_num_threads(1)


class Slow(Dataset):  # a data-bound run: 3 ms per sample, 24 ms per batch
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.randn(16)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 16)

    def training_step(self, x, i):
        if self.global_step == int(sys.argv[2]):
            raise RuntimeError("planted failure")
        return self.net(x).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(Slow(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


doctor = BottleneckDoctor(window=5, warmup_batches=2, report_path=sys.argv[1], print_report=False,
                          warn=False, log_metrics=False)
trainer = pl.Trainer(accelerator="cpu", max_steps=60, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[doctor])
trainer.fit(Model())
"""


def start_fit(tmp_path, fail_at=-1):
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(FIT))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs" / "run.json"), str(fail_at)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def watch(*args):
    return subprocess.run(
        [sys.executable, "-m", "lightning_accel.cli", "watch", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "120"},
    )


@pytest.mark.slow
def test_watch_follows_a_running_fit_and_exits_when_it_ends(tmp_path):
    fit = start_fit(tmp_path)
    try:
        # started before the fit wrote anything: it waits for the log, then follows it to the end
        result = watch(tmp_path, "--interval", "0.5")
        fit_output = fit.communicate(timeout=600)[0]
    finally:
        fit.kill()
    assert fit.returncode == 0, fit_output
    assert result.returncode == 0, result.stdout + result.stderr
    log = tmp_path / "logs" / "run.windows.jsonl"
    windows = [json.loads(line) for line in log.read_text().splitlines() if '"window"' in line]
    assert len(windows) >= 2
    out = result.stdout
    # it redrew while the fit ran (more than one frame), and its last frame is the fit's last window
    assert out.count("share of step") >= 2, out
    assert f"(batch {windows[-1]['batch']}," in out
    assert "[data]" in out and "DataLoader" in out  # the live finding of a data-bound run, with its fix
    assert "fit finished; report: " + str(tmp_path / "logs" / "run.json") in out.replace("\n", "")


@pytest.mark.slow
def test_watch_exits_1_when_the_fit_fails_and_reads_a_finished_log_at_once(tmp_path):
    fit = start_fit(tmp_path, fail_at=20)
    output = fit.communicate(timeout=600)[0]
    assert fit.returncode == 1 and "planted failure" in output
    started = time.monotonic()
    result = watch(tmp_path / "logs" / "run.windows.jsonl", "--interval", "30")
    assert result.returncode == 1
    assert "fit failed: RuntimeError: planted failure" in result.stdout.replace("\n", "")
    assert time.monotonic() - started < 30 + 60  # the ended log is not followed for another interval


def test_watch_gives_up_when_no_log_appears(tmp_path):
    result = watch(tmp_path, "--wait", "1", "--interval", "0.2")
    assert result.returncode == 1 and "no window log appeared" in result.stdout
    result = watch(tmp_path / "missing")
    assert result.returncode == 2 and "no such folder" in result.stderr
