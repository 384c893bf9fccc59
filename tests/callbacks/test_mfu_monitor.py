import re
import types
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel import MFUMonitor
from tests.helpers import FakeClock

B, IN, OUT = 4, 32, 2
STEP_S = 0.01  # fake seconds a training step takes
FLOPS_PER_BATCH = 4 * B * IN * OUT  # forward 2·B·IN·OUT + weight grad 2·B·IN·OUT (inputs need no grad)


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeClock(1000.0)
    monkeypatch.setattr("lightning_accel.core.throughput.time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


class LinearModel(pl.LightningModule):
    def __init__(self, clock=None, val_seconds=0.0):
        super().__init__()
        self.layer = nn.Linear(IN, OUT)
        self.clock, self.val_seconds = clock, val_seconds

    def training_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock.now += STEP_S
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock.now += self.val_seconds

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(B * 64, IN)), batch_size=B)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(B * 2, IN)), batch_size=B)


def trainer(callbacks, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=24,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


def test_mfu_equals_hand_computed_value_with_mocked_time_and_peak(fake_time):
    peak = 1e6
    monitor = MFUMonitor(window=5, warmup_batches=4, peak_flops=peak, print_summary=False)
    trainer([monitor]).fit(LinearModel(fake_time))
    s = monitor.summary
    assert s["flops_per_batch"] == FLOPS_PER_BATCH  # counted automatically on the first batch
    assert s["batches_measured"] == 20  # 24 batches - 4 warm-up
    assert s["samples_per_sec"] == pytest.approx(B / STEP_S)
    assert s["flops_per_sec_per_device"] == pytest.approx(FLOPS_PER_BATCH / STEP_S)
    assert s["mfu"] == pytest.approx(FLOPS_PER_BATCH / STEP_S / peak)
    assert s["peak_source"] == "given by the user"
    assert s["tokens_per_sec"] is None  # float features: no sequence dimension
    assert len(monitor.history) == 4 and all(h["mfu"] == pytest.approx(s["mfu"]) for h in monitor.history)


def test_logged_keys_reach_the_logger(fake_time, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    monitor = MFUMonitor(window=5, warmup_batches=0, peak_flops=1e6, print_summary=False)
    trainer([monitor], logger=CSVLogger(tmp_path, name="m"), log_every_n_steps=5, max_steps=20).fit(
        LinearModel(fake_time)
    )
    text = (tmp_path / "m" / "version_0" / "metrics.csv").read_text()
    header = text.splitlines()[0].split(",")
    for key in ("perf/samples_per_sec", "perf/batches_per_sec", "perf/tflops_per_sec_per_device", "perf/mfu"):
        assert key in header
    rows = [dict(zip(header, line.split(","))) for line in text.splitlines()[1:]]
    mfus = [float(r["perf/mfu"]) for r in rows if r.get("perf/mfu")]
    assert mfus and all(m == pytest.approx(FLOPS_PER_BATCH / STEP_S / 1e6) for m in mfus)


def test_gradient_accumulation_counts_every_micro_batch(fake_time):
    monitor = MFUMonitor(window=4, warmup_batches=2, flops_per_batch=1000.0, peak_flops=1e6, print_summary=False)
    t = trainer([monitor], accumulate_grad_batches=2, max_steps=10)
    t.fit(LinearModel(fake_time))
    assert t.global_step == 10
    s = monitor.summary
    assert s["batches_measured"] == 18  # 20 micro-batches - 2 warm-up
    assert s["samples_per_sec"] == pytest.approx(B / STEP_S)  # not halved or doubled by accumulation
    assert s["mfu"] == pytest.approx(1000.0 / STEP_S / 1e6)


def test_validation_time_inside_training_is_excluded(fake_time):
    monitor = MFUMonitor(window=5, warmup_batches=0, flops_per_batch=1000.0, peak_flops=1e6, print_summary=False)
    t = trainer([monitor], limit_val_batches=2, val_check_interval=5, check_val_every_n_epoch=None, max_steps=20)
    t.fit(LinearModel(fake_time, val_seconds=3.0))  # each validation run costs 6 fake seconds
    assert monitor.summary["samples_per_sec"] == pytest.approx(B / STEP_S)


def test_warmup_from_other_callbacks_such_as_torch_compile(fake_time):
    class CompileLike(pl.Callback):
        warmup_batches = 6

    monitor = MFUMonitor(window=2, warmup_batches=2, flops_per_batch=1.0, peak_flops=1e6, print_summary=False)
    trainer([monitor, CompileLike()], max_steps=20).fit(LinearModel(fake_time))
    assert monitor.summary["warmup_batches"] == 8
    assert monitor.summary["batches_measured"] == 12


def test_tokens_from_a_sequence_batch_and_from_the_module():
    class TokenModel(LinearModel):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, IN)

        def training_step(self, batch, batch_idx):
            return self.layer(self.emb(batch[0])).sum()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, 50, (B * 16, 7))), batch_size=B)

    monitor = MFUMonitor(window=3, warmup_batches=1, print_summary=False)
    trainer([monitor], max_steps=10).fit(TokenModel())
    s = monitor.summary
    assert s["tokens_per_sec"] == pytest.approx(s["samples_per_sec"] * 7)

    class CustomTokens(TokenModel):
        def tokens_per_batch(self, batch):
            return 5

    monitor = MFUMonitor(window=3, warmup_batches=1, print_summary=False)
    trainer([monitor], max_steps=10).fit(CustomTokens())
    assert monitor.summary["tokens_per_sec"] == pytest.approx(monitor.summary["samples_per_sec"] * 5 / B)


def test_cpu_peak_from_the_hardware_or_the_probe_when_no_table_entry():
    monitor = MFUMonitor(window=3, warmup_batches=1, print_summary=False)
    trainer([monitor], max_steps=8).fit(LinearModel())
    s = monitor.summary
    assert s["peak_source"].startswith(("hardware: ", "probe: ", "achieved by window")) and s["peak_flops"] > 0
    assert 0 < s["mfu"] <= 1
    assert s["mfu"] == pytest.approx(s["flops_per_sec_per_device"] / s["peak_flops"])
    assert all(h["mfu"] <= 1 for h in monitor.history)


class SpeedingUpModel(LinearModel):
    """Steps take STEP_S, but the 11th to 15th (the third window of 5 after 4 warm-up batches) half of it."""

    def training_step(self, batch, batch_idx):
        self.clock.now += STEP_S / 2 if 14 <= batch_idx < 19 else STEP_S
        return self.layer(batch[0]).sum()


def logged_mfus(tmp_path):
    text = (tmp_path / "m" / "version_0" / "metrics.csv").read_text().splitlines()
    rows = [dict(zip(text[0].split(","), line.split(","))) for line in text[1:]]
    return [float(r["perf/mfu"]) for r in rows if r.get("perf/mfu")]


def test_a_probe_that_under_reads_is_raised_and_mfu_stays_a_fraction(fake_time, tmp_path, capsys):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accel.core import peak

    achieved = FLOPS_PER_BATCH / STEP_S  # 102.4 kFLOP/s; the probe reads half of it
    monitor = MFUMonitor(window=5, warmup_batches=4)
    t = trainer([monitor], logger=CSVLogger(tmp_path, name="m"), log_every_n_steps=5, max_steps=24)
    with (
        mock.patch.object(peak, "cpu_hardware_peak", return_value=None),
        mock.patch.object(peak, "measure_peak_flops", return_value=achieved / 2),
        pytest.warns(UserWarning, match="raised") as record,
    ):
        t.fit(SpeedingUpModel(fake_time))
    raised = [str(w.message) for w in record if "raised" in str(w.message)]
    assert len(raised) == 1  # one warning, though the third window raises the peak again
    assert "102.4 kFLOP/s" in raised[0] and "peak 51.2 kFLOP/s (measured: probe: 51.2 kFLOP/s" in raised[0]
    assert "200.0 %" in raised[0] and "The peak read low" in raised[0]
    # windows: 102.4 k (raises the peak, 1.0), 102.4 k (1.0), 204.8 k (raises again, 1.0), 102.4 k (0.5)
    assert [h["mfu"] for h in monitor.history] == pytest.approx([1.0, 1.0, 1.0, 0.5])
    assert logged_mfus(tmp_path) == pytest.approx([1.0, 1.0, 1.0, 0.5])
    s = monitor.summary
    assert s["peak_flops"] == pytest.approx(2 * achieved) and s["peak_raises"] == 2
    assert s["peak_flops_initial"] == achieved / 2 and s["peak_source_initial"].startswith("probe: 51.2 kFLOP/s")
    assert s["peak_source"].startswith("achieved by window 3 (204.8 kFLOP/s), raised from the measured peak 51.2")
    # the summary divides every window by the final peak: 4 windows of 5 batches over 0.05 + 0.05 + 0.025 + 0.05 s
    assert s["mfu"] == pytest.approx(20 * FLOPS_PER_BATCH / 0.175 / (2 * achieved))
    assert s["mfu"] == pytest.approx(s["flops_per_sec_per_device"] / s["peak_flops"])
    out = capsys.readouterr().out
    assert "peak raised" in out and "achieved ÷ final peak" in out


def test_gpu_window_above_the_datasheet_warns_with_the_numbers(fake_time, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accel.core.peak import PeakFlops

    datasheet = PeakFlops(80e3, "table", "NVIDIA H100 80GB HBM3, bf16 dense: NVIDIA H100 datasheet (SXM5)")
    monitor = MFUMonitor(window=5, warmup_batches=4, print_summary=False)
    t = trainer([monitor], logger=CSVLogger(tmp_path, name="m"), log_every_n_steps=5, max_steps=14)
    with (
        mock.patch("lightning_accel.callbacks.mfu_monitor.resolve_peak_flops", return_value=datasheet),
        pytest.warns(UserWarning, match="cannot run faster than its datasheet") as record,
    ):
        t.fit(LinearModel(fake_time))
    message = next(str(w.message) for w in record if "datasheet" in str(w.message))
    assert "achieved 102.4 kFLOP/s" in message and "128.0 % of the peak 80.0 kFLOP/s (table: NVIDIA H100" in message
    assert f"the FLOP count ({FLOPS_PER_BATCH} FLOP per batch, counted on the first batch" in message
    assert "faster dtype than fp32" in message and "flops_per_batch=" in message
    assert logged_mfus(tmp_path) == pytest.approx([1.0, 1.0])
    s = monitor.summary
    assert s["peak_flops_initial"] == 80e3 and "datasheet" in s["peak_source_initial"]
    assert s["peak_flops"] == pytest.approx(FLOPS_PER_BATCH / STEP_S) and s["mfu"] == pytest.approx(1.0)


def test_model_without_counted_flops_warns_once_and_keeps_training():
    class Elementwise(LinearModel):
        def training_step(self, batch, batch_idx):
            return (batch[0] * self.layer.weight.sum()).sum()  # no matmul anywhere

    monitor = MFUMonitor(window=3, warmup_batches=1, print_summary=False)
    t = trainer([monitor], max_steps=8)
    with pytest.warns(UserWarning, match="counted no FLOPs") as record:
        t.fit(Elementwise())
    assert sum("counted no FLOPs" in str(w.message) for w in record) == 1
    assert t.global_step == 8
    assert monitor.summary["mfu"] is None and monitor.summary["samples_per_sec"] > 0


def test_too_short_run_reports_why_instead_of_dividing_by_zero():
    monitor = MFUMonitor(window=50, warmup_batches=5, print_summary=True)
    trainer([monitor], max_steps=3).fit(LinearModel())
    assert "too few batches" in monitor.summary["note"]
    assert monitor.summary["batches_measured"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(window=0),
        dict(window=1.5),
        dict(warmup_batches=-1),
        dict(flops_per_batch=0),
        dict(peak_flops=-3.0),
        dict(peak_flops="fast"),
    ],
)
def test_invalid_arguments_name_the_value(kwargs):
    with pytest.raises(ValueError, match=repr(next(iter(kwargs.values())))):
        MFUMonitor(**kwargs)


def test_summary_printed_as_table(capsys):
    monitor = MFUMonitor(window=3, warmup_batches=1, peak_flops=1e9)
    trainer([monitor], max_steps=8).fit(LinearModel())
    out = capsys.readouterr().out
    assert "MFUMonitor summary" in out and "MFU" in out and "samples/s" in out


@pytest.mark.distributed
def test_ddp_two_processes_reports_global_throughput(ddp_script, tmp_path):
    ddp_script(f"""
        import json, types
        import lightning.pytorch as pl
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import lightning_accel.core.throughput as tp
        from lightning_accel import MFUMonitor

        from tests.helpers import FakeClock
        clock = FakeClock()
        tp.time = types.SimpleNamespace(perf_counter=lambda: clock.now)

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear({IN}, {OUT})
            def training_step(self, batch, batch_idx):
                # rank 1 is twice as slow: the global rate must be the sum of both ranks' rates
                clock.now += {STEP_S} * (1 + self.global_rank)
                return self.layer(batch[0]).sum()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn({B} * 64, {IN})), batch_size={B})

        monitor = MFUMonitor(window=4, warmup_batches=2, peak_flops=1e6, print_summary=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=14, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[monitor])
        trainer.fit(M())
        with open(f"summary_rank{{trainer.global_rank}}.json", "w") as f:
            json.dump(monitor.summary, f)
    """)
    from tests.conftest import read_rank_json

    s0, s1 = read_rank_json(tmp_path, "summary")
    assert s0 == s1  # every rank reports the same (gathered) numbers
    assert s0["devices"] == 2
    assert s0["flops_per_batch"] == FLOPS_PER_BATCH
    assert s0["samples_per_sec"] == pytest.approx(B / STEP_S + B / (2 * STEP_S))
    per_device = (FLOPS_PER_BATCH / STEP_S + FLOPS_PER_BATCH / (2 * STEP_S)) / 2
    assert s0["flops_per_sec_per_device"] == pytest.approx(per_device)
    assert s0["mfu"] == pytest.approx(per_device / 1e6)
    assert s0["batches_measured"] == 24  # 2 ranks × (14 - 2)


def test_recomputed_flops_reported_by_a_callback_are_not_model_flops(fake_time):
    class CheckpointingLike(pl.Callback):
        recompute_flops = 100  # FLOPs re-run per micro-batch, as ActivationCheckpointing reports them

    monitor = MFUMonitor(window=5, warmup_batches=4, peak_flops=1e6, print_summary=False)
    trainer([monitor, CheckpointingLike()], max_steps=14).fit(LinearModel(fake_time))
    assert monitor.summary["flops_per_batch"] == FLOPS_PER_BATCH - 100
    assert "recomputed by activation checkpointing" in monitor.summary["flops_source"]
    assert monitor.summary["mfu"] == pytest.approx((FLOPS_PER_BATCH - 100) / STEP_S / 1e6)


@pytest.mark.distributed
def test_ddp_ranks_of_one_device_kind_share_the_raised_peak(ddp_script, tmp_path):
    ddp_script(f"""
        import json, types
        import lightning.pytorch as pl
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import lightning_accel.core.throughput as tp
        from lightning_accel import MFUMonitor

        from tests.helpers import FakeClock
        clock = FakeClock()
        tp.time = types.SimpleNamespace(perf_counter=lambda: clock.now)

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear({IN}, {OUT})
            def training_step(self, batch, batch_idx):
                clock.now += {STEP_S} * (1 + self.global_rank)  # rank 0 runs above the given peak, rank 1 below
                return self.layer(batch[0]).sum()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn({B} * 64, {IN})), batch_size={B})

        monitor = MFUMonitor(window=4, warmup_batches=2, peak_flops=6e4, print_summary=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=14, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[monitor])
        trainer.fit(M())
        with open(f"summary_rank{{trainer.global_rank}}.json", "w") as f:
            json.dump(dict(monitor.summary, history=monitor.history), f)
    """)
    from tests.conftest import read_rank_json

    s0, s1 = read_rank_json(tmp_path, "summary")
    assert s0 == s1  # the raised peak, its source and the MFU are the same on every rank
    fast = FLOPS_PER_BATCH / STEP_S
    # later windows run at the same rate: they may raise it again by a rounding error of the window's seconds
    assert s0["peak_flops"] == pytest.approx(fast) and s0["peak_flops_initial"] == 6e4 and s0["peak_raises"] >= 1
    assert re.fullmatch(
        r"achieved by window \d on rank 0 \(102.4 kFLOP/s\), raised from the user peak 60.0 kFLOP/s "
        r"\(given by the user\)",
        s0["peak_source"],
    )
    assert [h["mfu"] for h in s0["history"]] == pytest.approx([0.75, 0.75, 0.75])  # (1.0 + 0.5) / 2 per window
    assert s0["mfu"] == pytest.approx(0.75)
