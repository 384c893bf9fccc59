import subprocess
import sys

import pytest

from lightning_accel.cli import main
from lightning_accel.demo.data import markov_tokens
from lightning_accel.demo.run import DemoConfig, run_demo
from tests.conftest import REPO


def test_markov_tokens_are_learnable_and_seeded():
    a = markov_tokens(5000, 64, branching=4, seed=1)
    assert (a == markov_tokens(5000, 64, branching=4, seed=1)).all()
    assert a.min() >= 0 and a.max() < 64
    # each token has at most 4 successors
    successors = {}
    for x, y in zip(a[:-1], a[1:]):
        successors.setdefault(int(x), set()).add(int(y))
    assert max(len(s) for s in successors.values()) <= 4
    with pytest.raises(ValueError, match="branching"):
        markov_tokens(10, 8, branching=9)


def test_demo_runs_and_reports_mfu():
    result = run_demo(DemoConfig(steps=20, window=5, val_every=10, progress_bar=False))
    summary = result["mfu_monitor"]
    assert summary["samples_per_sec"] > 0 and summary["tokens_per_sec"] == pytest.approx(
        summary["samples_per_sec"] * 64
    )
    assert summary["peak_source"].startswith(("hardware: ", "probe: ", "achieved by window"))
    assert 0 < summary["mfu"] <= 1  # a window above the peak raises the peak: MFU is a fraction
    assert summary["mfu"] == pytest.approx(summary["flops_per_sec_per_device"] / summary["peak_flops"])
    assert result["train_loss"] < 5.545  # learning: below a uniform guess over 256 tokens


def test_demo_cli_prints_summary_and_rejects_bad_input(capsys):
    assert main(["demo", "--steps", "8", "--window", "3", "--no-progress-bar"]) == 0
    out = capsys.readouterr().out
    assert "MFUMonitor summary" in out and "demo finished" in out
    assert main(["demo", "--batch-size", "0"]) == 2
    assert "--batch-size must be an integer >= 1, got 0" in capsys.readouterr().err


@pytest.mark.distributed
def test_demo_cli_two_process_ddp_on_cpu():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.cli",
            "demo",
            "--devices",
            "2",
            "--steps",
            "8",
            "--window",
            "3",
            "--no-progress-bar",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("MFUMonitor summary") == 1  # printed by rank 0 only
    assert "cpu × 2" in proc.stdout


def test_the_demo_progress_bar_shows_the_steps_and_no_negative_epoch_total():
    # Lightning's Rich bar prints "Epoch {current}/{max_epochs - 1}"; a run for max_steps has max_epochs=-1
    import lightning.pytorch as pl

    from lightning_accel.demo.progress import last_epoch

    assert last_epoch(max_steps=10, global_step=0, current_epoch=0, batches_per_epoch=4) == 2
    assert last_epoch(max_steps=10, global_step=8, current_epoch=2, batches_per_epoch=4) == 2
    assert last_epoch(max_steps=10, global_step=0, current_epoch=0, batches_per_epoch=7, accumulate=2) == 2
    assert last_epoch(max_steps=10, global_step=0, current_epoch=0, batches_per_epoch=float("inf")) is None

    seen = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            task = trainer.progress_bar_callback.train_progress_bar
            seen.append((str(task.description).strip(), task.total))

    cfg = DemoConfig(steps=3, n_layer=1, d_model=32, seq_len=16, batch_size=4, window=1, val_every=3, doctor=False)
    cfg.quiet, cfg.extra_callbacks = True, [Record()]
    trainer = run_demo(cfg)["trainer"]
    assert trainer.max_epochs == -1 and trainer.global_step == 3  # the training is the demo's as it was
    assert seen == [("Epoch 0/0", 3)] * 3
