"""Several planted causes at once: the doctor's findings come in the order of what removing each cause saves.

The causes are sleeps of clearly different sizes (so the order does not depend on the machine's speed);
``benchmarks/bench_doctor_findings.py`` measures the fit with each one removed alone and checks the same order
against the measured gains (BENCHMARKS.md, "BottleneckDoctor: the order of the findings").
"""

import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor
from tests.callbacks.test_bottleneck_doctor import one_thread  # noqa: F401 - the autouse fixture: 1 torch thread
from tests.conftest import read_rank_json


class SlowData(Dataset):
    def __init__(self, sleep):
        self.sleep = sleep

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(self.sleep)
        return torch.randn(64)


class ThreeCauses(pl.LightningModule):
    """5 validation runs of 0.12 s, each with 0.2 s that Lightning runs before on_validation_start (1.6 s); a
    loader that waits 6 ms per batch (0.9 s over 150 batches); 6 checkpoint saves of 90 ms (0.54 s)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 64)

    def training_step(self, x, i):
        time.sleep(0.006)
        return self.net(x).pow(2).mean()

    def validation_step(self, x, i):
        time.sleep(0.03)

    def on_validation_model_eval(self):
        super().on_validation_model_eval()
        time.sleep(0.2)  # Lightning runs it before on_validation_start: the doctor times the loop from its run

    def on_save_checkpoint(self, checkpoint):
        time.sleep(0.09)

    def train_dataloader(self):
        return DataLoader(SlowData(0.0015), batch_size=4)

    def val_dataloader(self):
        return DataLoader(torch.randn(16, 64), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_validation_its_tail_the_loader_and_checkpoints_come_largest_first(tmp_path):
    doctor = BottleneckDoctor(window=10, warmup_batches=2, report_path=False, print_report=False, warn=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=25, save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=152,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor, ckpt],
        val_check_interval=30,
        limit_val_batches=4,
        num_sanity_val_steps=0,
    )
    trainer.fit(ThreeCauses())
    report = doctor.report
    rules = [f.rule for f in report.findings]
    # validation with what Lightning runs before on_validation_start is the largest cause, and none of it is
    # blamed on the loader
    assert rules[:3] == ["validation_heavy", "data_wait", "checkpoint_heavy"], report.findings
    validation, data, _ = report.findings[:3]
    assert report.fit["seconds"]["validation"] >= 5 * (0.2 + 4 * 0.03)
    assert validation.saving > data.saving
    assert "step_variability" not in rules
    savings = [f.saving for f in report.findings[:3]]
    assert savings == sorted(savings, reverse=True) and all(0 < s < 1 for s in savings)


DDP_SCRIPT = """
import json, os, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

torch.set_num_threads(1)
# every rank waits 8 ms per batch for its loader; rank 1 waits 24 ms more (a straggler: rank 0 waits for it in the
# all-reduce)
SLEEP = 0.004 if int(os.environ.get("LOCAL_RANK", "0")) == 1 else 0.001


class Data(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(SLEEP)
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
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=62, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[doctor])
trainer.fit(Model())
with open(f"order_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(doctor.report.to_dict(), fh)
"""


@pytest.mark.distributed
def test_a_straggler_and_a_slow_loader_on_every_rank_come_largest_first_and_the_network_not_at_all(
    ddp_script, tmp_path
):
    ddp_script(DDP_SCRIPT, timeout=240)
    report, _ = read_rank_json(tmp_path, "order")
    rules = [f["rule"] for f in report["findings"]]
    # the straggler's 24 ms, then the 8 ms every rank waits; rank 0's wait in the all-reduce is the straggler's
    assert rules[:2] == ["straggler", "data_wait"], report["findings"]
    assert "communication" not in rules
    straggler, data = report["findings"][:2]
    assert straggler["stage"] == "data" and straggler["saving"] > data["saving"] > 0
    assert "which the straggler finding accounts for" in data["evidence"]
