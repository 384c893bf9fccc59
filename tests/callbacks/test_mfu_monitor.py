import types

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
    defaults = dict(accelerator="cpu", devices=1, max_steps=24, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=0)
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
        LinearModel(fake_time))
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

    monitor = MFUMonitor(window=2, warmup_batches=2, flops_per_batch=1.0, peak_flops=1.0, print_summary=False)
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
    assert s["peak_source"].startswith(("hardware: ", "probe: ")) and s["peak_flops"] > 0
    assert s["mfu"] > 0
    assert s["mfu"] == pytest.approx(s["flops_per_sec_per_device"] / s["peak_flops"])


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


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(window=1.5), dict(warmup_batches=-1),
                                    dict(flops_per_batch=0), dict(peak_flops=-3.0), dict(peak_flops="fast")])
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
