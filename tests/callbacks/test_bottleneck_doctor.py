"""BottleneckDoctor on planted bottlenecks (CPU): each sleep of a few ms makes one stage dominate."""

import json
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import STAGES

SLEEP = 0.010  # seconds: dominates a tiny step even on a loaded 2-core machine


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny ops on 2 intra-op threads wait for each other on a busy machine; one thread keeps compute small and steady.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RandomData(Dataset):
    def __init__(self, dim, sleep_per_sample=0.0, n=4096):
        self.x = torch.randn(n, dim)
        self.sleep = sleep_per_sample

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.sleep)
        return self.x[i]


class RandomBatches(Dataset):
    """Whole batches per item (``DataLoader(batch_size=None)``): no per-sample Python loop, no collate."""

    def __init__(self, dim, batch, n=64):
        self.x = torch.randn(n, batch, dim)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


class SlowSGD(torch.optim.SGD):
    def __init__(self, params, sleep, **kw):
        super().__init__(params, **kw)
        self.sleep = sleep

    def step(self, closure=None):
        loss = super().step(closure)  # runs the closure (forward + backward) first in automatic optimization
        time.sleep(self.sleep)
        return loss


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Planted(pl.LightningModule):
    def __init__(
        self,
        *,
        dim=32,
        hidden=32,
        batch=8,
        data=0.0,
        transfer=0.0,
        backward=0.0,
        optimizer=0.0,
        manual=False,
        pre_batched=False,
    ):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))
        self.dim, self.batch = dim, batch
        self.sleeps = dict(data=data, transfer=transfer, backward=backward, optimizer=optimizer)
        self.automatic_optimization = not manual
        self.pre_batched = pre_batched

    def _loss(self, x):
        y = self.net(x)
        if self.sleeps["backward"]:
            y = SleepInBackward.apply(y, self.sleeps["backward"])
        return (y - x).pow(2).mean()

    def training_step(self, x, batch_idx):
        loss = self._loss(x)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if self.sleeps["transfer"]:
            time.sleep(self.sleeps["transfer"])
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self):
        if self.pre_batched:
            return DataLoader(RandomBatches(self.dim, self.batch), batch_size=None)
        return DataLoader(RandomData(self.dim, self.sleeps["data"] / self.batch), batch_size=self.batch)

    def configure_optimizers(self):
        return SlowSGD(self.parameters(), self.sleeps["optimizer"], lr=0.01)


def fit(model, doctor=None, max_steps=12, **trainer_kwargs):
    # Tiny windows of tiny steps: closing a window (mostly Lightning's self.log, ~1 ms per key on a busy 2-core
    # machine) would show up as "other" next to the planted stage, so these runs do not log.
    doctor = doctor or BottleneckDoctor(
        window=4, warmup_batches=2, report_path=False, print_report=False, warn_interval_s=0, log_metrics=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
        **trainer_kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    messages = [str(w.message) for w in caught if "BottleneckDoctor" in str(w.message)]
    return doctor.report, messages, trainer


def check_shares(report):
    assert set(report.shares) == set(STAGES)
    assert sum(report.shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert report.step_seconds == pytest.approx(sum(report.stage_seconds.values()), rel=1e-6)


def test_slow_dataset_is_diagnosed_as_data_with_the_dataloader_fix():
    report, messages, _ = fit(Planted(data=SLEEP))
    check_shares(report)
    assert report.bottleneck == "data" and report.shares["data"] > 0.5
    finding = report.findings[0]
    assert finding.rule == "data_wait" and finding.stage == "data"
    assert "num_workers=0" in finding.evidence
    assert "DataLoader(num_workers=" in finding.fix and "DataLoaderTuner" in finding.fix
    assert report.context.num_workers == 0 and report.context.pin_memory is False
    # warned during training, once (the fix does not change between windows)
    data_warnings = [m for m in messages if "data is holding the run back" in m]
    assert len(data_warnings) == 1 and "DataLoaderTuner" in data_warnings[0]
    assert report.samples_per_sec is not None and 0 < report.samples_per_sec < 8 / SLEEP


@pytest.mark.parametrize("mode", ["automatic", "accumulate", "manual"])
def test_slow_optimizer_is_diagnosed_as_optimizer(mode):
    model = Planted(optimizer=SLEEP, manual=mode == "manual")
    kwargs = {"accumulate_grad_batches": 2} if mode == "accumulate" else {}
    report, _, _ = fit(model, max_steps=8 if mode == "accumulate" else 12, **kwargs)
    check_shares(report)
    assert report.bottleneck == "optimizer"
    finding = next(f for f in report.findings if f.rule == "optimizer")
    assert "SlowSGD" in finding.evidence and "foreach=True" in finding.fix and "deepspeed_zero1" in finding.fix
    if mode == "accumulate":
        assert report.context.accumulate_grad_batches == 2 and "accumulate_grad_batches" not in finding.fix


def test_slow_transfer_is_diagnosed_as_transfer_with_pin_memory_fix():
    report, _, _ = fit(Planted(transfer=SLEEP))
    check_shares(report)
    assert report.bottleneck == "transfer"
    finding = report.findings[0]
    assert finding.stage == "transfer" and "pin_memory=True + DevicePrefetcher" in finding.fix


def test_slow_backward_is_diagnosed_as_backward():
    report, _, _ = fit(Planted(backward=SLEEP))
    check_shares(report)
    assert report.bottleneck == "backward" and report.shares["backward"] > 0.5
    assert report.findings == []  # no rule fires for compute on a CPU


def test_balanced_compute_bound_run_gets_no_warning_and_logs_metrics(tmp_path):
    doctor = BottleneckDoctor(window=4, warmup_batches=2, report_path=tmp_path / "doctor.json", print_report=False)
    report, messages, trainer = fit(
        Planted(dim=512, hidden=1024, batch=512, pre_batched=True), doctor=doctor, max_steps=18
    )
    check_shares(report)
    assert report.bottleneck in ("forward", "backward"), report.timeline
    assert report.findings == [] and messages == []
    assert report.shares["data"] < 0.10
    for key in (
        "doctor/share_data",
        "doctor/share_forward",
        "doctor/share_other",
        "doctor/data_wait_pct",
        "doctor/step_ms",
        "doctor/cpu_process_pct",
        "doctor/cpu_workers_pct",
    ):
        assert key in trainer.callback_metrics, key
    assert "doctor/gpu_util_pct" not in trainer.callback_metrics
    # files: the JSON loads back to the same report; the PNG is a PNG
    assert DoctorReport.load(tmp_path / "doctor.json") == report
    from lightning_accel._imports import is_available

    if is_available("matplotlib"):  # the PNG needs the plots extra
        assert [p.name for p in doctor.files] == ["doctor.json", "doctor.png"]
        assert (tmp_path / "doctor.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert [p.name for p in doctor.files] == ["doctor.json"]
    # compute-bound: after the first window the attribution profiled 4 batches (1 warm-up + 3 recorded), which
    # no stage window counts: 16 = 12 measured + 4 profiled
    assert report.attribution["window"]["batches"] == 4 and report.attribution["window"]["first_batch"] == 6
    assert report.windows == 3 and report.batches == 12
    assert {s.rule for s in report.skipped} >= {"gpu_utilisation", "communication"}
    # the strategy's batch_to_device is restored after fit
    assert "batch_to_device" not in vars(trainer.strategy)


def test_too_short_run_reports_that_there_was_too_little_data(tmp_path):
    doctor = BottleneckDoctor(window=4, warmup_batches=3, report_path=tmp_path / "r.json", print_report=False)
    report, messages, _ = fit(Planted(), doctor=doctor, max_steps=2)
    assert report.bottleneck is None and report.shares == {} and report.findings == []
    assert any("too little data" in n for n in report.notes)
    assert json.loads((tmp_path / "r.json").read_text())["bottleneck"] is None
    assert not (tmp_path / "r.png").exists()


def test_measuring_problem_warns_once_and_training_goes_on(monkeypatch):
    from lightning_accel.core.timing import StageTimer

    def broken_flush(self):
        raise RuntimeError("event query failed")

    monkeypatch.setattr(StageTimer, "flush", broken_flush)
    report, messages, trainer = fit(Planted())
    assert trainer.global_step == 12
    problems = [m for m in messages if "measuring problem" in m]
    assert len(problems) == 1 and "event query failed" in problems[0]
    assert any("stage timing stopped" in n for n in report.notes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window"),
        ({"warmup_batches": -1}, "warmup_batches"),
        ({"thresholds": {"data_share": 1.5}}, "data_share"),
        ({"thresholds": {"nope": 0.1}}, "unknown threshold"),
        ({"thresholds": 0.1}, "thresholds"),
        ({"report_path": 3}, "report_path"),
        ({"warn_interval_s": -1}, "warn_interval_s"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BottleneckDoctor(**kwargs)


def test_custom_thresholds_are_used_and_reported():
    doctor = BottleneckDoctor(
        window=4, warmup_batches=2, report_path=False, print_report=False, thresholds={"optimizer_share": 0.99}
    )
    report, _, _ = fit(Planted(optimizer=SLEEP), doctor=doctor)
    assert report.bottleneck == "optimizer" and "optimizer" not in {f.rule for f in report.findings}
    assert report.thresholds["optimizer_share"] == 0.99


class SlowValidation(Planted):
    def validation_step(self, x, batch_idx):
        time.sleep(0.02)

    def val_dataloader(self):
        return DataLoader(RandomData(self.dim), batch_size=self.batch)


def test_validation_inside_fit_is_not_counted():
    report, _, _ = fit(
        SlowValidation(backward=SLEEP), val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0
    )
    check_shares(report)
    # 40 ms of validation every 2 batches would be > 50 % of the time if it leaked into the data wait or "other"
    assert report.bottleneck == "backward"
    assert report.shares["data"] < 0.25 and report.shares["other"] < 0.25


def test_two_fits_with_one_doctor_and_epoch_boundaries():
    doctor = BottleneckDoctor(window=4, warmup_batches=1, report_path=False, print_report=False)
    model = Planted(optimizer=SLEEP)
    model.train_dataloader = lambda: DataLoader(RandomData(32, n=40), batch_size=8)  # 5 batches per epoch
    for _ in range(2):
        report, _, trainer = fit(model, doctor=doctor, max_steps=14)
        check_shares(report)
        assert report.bottleneck == "optimizer" and trainer.current_epoch >= 2
    assert "batch_to_device" not in vars(trainer.strategy)


@pytest.mark.gpu
def test_gpu_run_uses_cuda_events_and_finds_the_data_bottleneck():
    doctor = BottleneckDoctor(window=4, warmup_batches=2, report_path=False, print_report=False)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
    )
    trainer.fit(Planted(data=SLEEP))
    report = doctor.report
    check_shares(report)
    assert report.bottleneck == "data" and report.context.device_type == "cuda"
    assert report.context.device_capability is not None
    assert "memory_peak_frac" in report.utilisation
    skipped = {s.rule for s in report.skipped}
    assert "fp32_compute" not in skipped


def test_mfu_monitor_throughput_and_mfu_reach_the_report():
    from lightning_accel.callbacks.mfu_monitor import MFUMonitor

    monitor = MFUMonitor(window=4, print_summary=False, prog_bar=False)
    # no attribution window: its batches are in the monitor's windows and in none of the doctor's, which in a
    # 14-step fit would be most of the difference
    doctor = BottleneckDoctor(
        window=4, warmup_batches=2, report_path=False, print_report=False, attribute_compute=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=14,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor, monitor],
    )
    trainer.fit(Planted(backward=SLEEP))
    assert monitor.summary["mfu"] is not None
    assert doctor.report.mfu == monitor.summary["mfu"]
    # both measure the same run: throughput agrees within the noise of different windows
    assert doctor.report.samples_per_sec == pytest.approx(monitor.summary["samples_per_sec"], rel=0.3)


def test_precision_plugin_loss_scale_stats_are_reported():
    from types import SimpleNamespace

    from lightning_accel.callbacks.doctor.bottleneck_doctor import _precision_stats

    plugin = SimpleNamespace(loss_scale=torch.tensor(32768.0), skipped_steps=3, total_steps=100, other=1)
    assert _precision_stats(SimpleNamespace(precision_plugin=plugin)) == {
        "loss_scale": 32768.0,
        "skipped_steps": 3,
        "total_steps": 100,
    }
    assert _precision_stats(SimpleNamespace(precision_plugin=object())) == {}


def test_a_new_finding_asks_profile_window_for_a_trace(tmp_path):
    from lightning_accel import ProfileWindow

    window = ProfileWindow(dirpath=tmp_path, wait=0, warmup=0, active=2)
    doctor = BottleneckDoctor(
        window=4, warmup_batches=2, report_path=False, print_report=False, warn_interval_s=0, log_metrics=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=16,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor, window],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Planted(data=SLEEP))
    assert doctor.report.bottleneck == "data"
    assert len(window.windows) == 1  # traced once, on the first data finding, not the whole run
    table = next(tmp_path.glob("top_ops_step*_rank0.txt")).read_text()
    assert "BottleneckDoctor finding: [data]" in table


def test_a_report_path_ending_in_html_writes_the_page_and_the_json_beside_it(tmp_path):
    pytest.importorskip("matplotlib")
    doctor = BottleneckDoctor(
        window=4, warmup_batches=2, report_path=tmp_path / "run.html", print_report=False, log_metrics=False
    )
    model = Planted(dim=64, hidden=64, batch=32, pre_batched=True)
    report, _, _ = fit(model, doctor=doctor, max_steps=10, default_root_dir=tmp_path / "exp3")
    assert [p.name for p in doctor.files] == ["run.json", "run.png", "run.html"]
    assert DoctorReport.load(tmp_path / "run.json") == report
    page = (tmp_path / "run.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "Step breakdown" in page and page.count("<svg") >= 2
    # titled after the run (the module's class and its run folder), not the page's file name
    assert report.run == {"model": "Planted", "name": "exp3"} and "<h1>Planted · exp3</h1>" in page
    # each window's throughput is in the report, so the page can plot it
    assert all(w["samples_per_sec"] > 0 for w in report.timeline)
