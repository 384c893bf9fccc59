"""Checkpoints written in the background: the ordered plugin, the cost model, and the Autopilot's trial of it.

The Autopilot tests plant a slow disk (a CheckpointIO whose write sleeps) and slow steps (a sleep in the step), so
the decision follows from sleeps, not from this machine's speed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel as la
from lightning_accel.checkpoint_io import OrderedAsyncCheckpointIO
from lightning_accel.core.checkpoint_cost import (
    HIDDEN_FRACTION,
    TRIAL_PERIODS,
    checkpoint_share,
    steps_between_saves,
    why_not_trial,
)


class SlowDiskIO(TorchCheckpointIO):
    """Lightning's writer after ``delay_s`` (a slow disk), recording the order of writes and removals."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.log: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(self.delay_s)
        super().save_checkpoint(checkpoint, path, storage_options)
        self.log.append(("save", Path(path).name))

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        self.log.append(("remove", Path(path).name))


# ------------------------------------------------------------------------------------------------ the plugin
@pytest.mark.parametrize("plugin", [AsyncCheckpointIO, OrderedAsyncCheckpointIO])
def test_a_removal_right_after_a_queued_write_removes_the_file_only_when_ordered(plugin, tmp_path) -> None:
    base = SlowDiskIO(delay_s=0.2)
    io = plugin(base)
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")  # ModelCheckpoint(save_top_k=1) drops it for a better one
    io.teardown()
    if plugin is OrderedAsyncCheckpointIO:
        assert base.log == [("save", "a.ckpt"), ("remove", "a.ckpt")] and not (tmp_path / "a.ckpt").exists()
    else:  # Lightning's: the removal ran first, found nothing, and the dropped checkpoint stays on disk
        assert base.log == [("remove", "a.ckpt"), ("save", "a.ckpt")] and (tmp_path / "a.ckpt").exists()


def test_a_load_waits_for_the_write_before_it_and_the_tensors_are_those_of_the_save(tmp_path) -> None:
    io = OrderedAsyncCheckpointIO(SlowDiskIO(delay_s=0.2))
    weights = torch.zeros(4)
    io.save_checkpoint({"w": weights}, tmp_path / "a.ckpt")
    weights.add_(1.0)  # training goes on while the write is queued: the checkpoint holds the values at the save
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["w"], torch.zeros(4))
    io.teardown()


def test_wait_raises_the_error_of_a_failed_write(tmp_path) -> None:
    class Broken(TorchCheckpointIO):
        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.1)  # fails after the save returned to the training thread
            raise OSError("disk full")

    io = OrderedAsyncCheckpointIO(Broken())
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.ckpt")
    with pytest.raises(OSError, match="disk full"):
        io.wait()


# ------------------------------------------------------------------------------------------------ the cost model
def test_the_cadence_share_and_pay_back_of_saves() -> None:
    assert steps_between_saves(50, None, 10) == 50
    assert steps_between_saves(0, 2, 30) == 60
    assert steps_between_saves(0, 0, 30) is None and steps_between_saves(None, 1, None) is None
    assert checkpoint_share(1.0, 9, 1.0) == pytest.approx(0.1)
    # one 1 s save every 9 steps of 1 s: 10 % of the fit
    assert why_not_trial(1.0, 9, 1.0, None, 5) is None  # a fit of unknown length
    assert "under the 5 %" in why_not_trial(0.1, 9, 1.0, None, 5)
    # the trial's five periods of a save + 5 steps cost 30 s; each save left hides 0.8 s of its write
    cost = TRIAL_PERIODS * (1.0 + 5 * 1.0)
    enough = int(cost / HIDDEN_FRACTION) + 1
    assert why_not_trial(1.0, 9, 1.0, 9 * enough, 5) is None
    assert "less than the ~30.0 s a trial costs" in why_not_trial(1.0, 9, 1.0, 9 * (enough - 1), 5)


# ------------------------------------------------------------------------------------------------ the Autopilot
class StepSleeper(pl.LightningModule):
    def __init__(self, step_sleep_s: float = 0.01) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.step_sleep_s = step_sleep_s
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_sleep_s)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # the fit's steps only, never a trial's
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(
        TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )


def _fit(tmp_path: Path, callbacks: list, io: SlowDiskIO, every: int = 10, max_steps: int = 200):
    model = StepSleeper()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[io],
        callbacks=[*callbacks, checkpoint],
    )
    trainer.fit(model, _data())
    return trainer, model, checkpoint


@pytest.fixture
def slow_disk_bound(monkeypatch):
    """The no-measurement bound sees a tiny model's checkpoint as costly (the planted slow disk is slower than
    any real one), so the measured save decides."""
    import lightning_accel.callbacks.autopilot.checkpoint_trial as trial

    monkeypatch.setattr(trial, "SLOW_DISK_BYTES_PER_S", 1e2)


def test_a_checkpoint_heavy_fit_writes_in_the_background_and_trains_the_same_run(tmp_path, slow_disk_bound) -> None:
    # one save every 10 steps of 10 ms costs 0.15 s: 60 % of the fit, hidden behind the next steps in the background
    autopilot = la.Autopilot(
        only=["async_checkpoint"], measure_steps=10, budget_seconds=60, save_plan=False, print_summary=False
    )
    trainer, model, _ = _fit(tmp_path / "a", [autopilot], SlowDiskIO(delay_s=0.15))
    row = next(r for r in autopilot.records if r.name == "async_checkpoint")
    assert row.kept, row.reason
    assert "saving measured" in row.reason and "in the background" in row.reason
    io = trainer.strategy.checkpoint_io
    assert isinstance(io, OrderedAsyncCheckpointIO) and io._executor is None  # its thread ended with the fit
    assert [c.name for c in autopilot.kept] == ["async_checkpoint"]
    assert "lightning_accel.OrderedAsyncCheckpointIO" in autopilot.yaml
    assert "la.OrderedAsyncCheckpointIO()" in autopilot.python
    saved = sorted(p.name for p in (tmp_path / "a" / "ckpt").iterdir())
    assert len(saved) == 20 and not [p for p in saved if "autopilot" in p]  # every save there, the trial's gone
    # the same run as without the Autopilot: same losses, and the last checkpoint holds the final weights
    vanilla_trainer, vanilla, _ = _fit(tmp_path / "b", [], SlowDiskIO(delay_s=0.0))
    assert model.losses == vanilla.losses
    last = torch.load(tmp_path / "a" / "ckpt" / "epoch=3-step=200.ckpt", weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(last["state_dict"][key], value)


def test_cheap_saves_are_measured_once_and_left_alone(tmp_path, slow_disk_bound, monkeypatch) -> None:
    import lightning_accel.core.checkpoint_cost as cost

    monkeypatch.setattr(cost, "MIN_SHARE", 0.5)  # "cheap" whatever a busy machine makes of a tiny model's save
    autopilot = la.Autopilot(
        only=["async_checkpoint"], measure_steps=10, budget_seconds=60, save_plan=False, print_summary=False
    )
    trainer, _, _ = _fit(tmp_path, [autopilot], SlowDiskIO(delay_s=0.0), every=50, max_steps=400)
    row = next(r for r in autopilot.records if r.name == "async_checkpoint")  # a save of a few ms every 0.5 s
    assert not row.kept and row.reason.startswith("not trialled: one save measured"), row.reason
    assert "under the 50 %" in row.reason
    assert type(trainer.strategy.checkpoint_io) is SlowDiskIO and autopilot.kept == []


def test_no_row_when_even_a_slow_disk_would_make_the_saves_cheap(tmp_path) -> None:
    autopilot = la.Autopilot(
        only=["async_checkpoint"], measure_steps=4, budget_seconds=60, save_plan=False, print_summary=False
    )
    _fit(tmp_path, [autopilot], SlowDiskIO(), every=10, max_steps=100)  # the real bound: a tiny model
    assert not [r for r in autopilot.records if r.name == "async_checkpoint"]


def test_frozen_checkpoint_io_is_never_trialled(tmp_path, slow_disk_bound) -> None:
    frozen = la.Autopilot(
        freeze=["checkpoint_io"],
        only=["async_checkpoint", "micro_batch"],
        measure_steps=10,
        budget_seconds=60,
        save_plan=False,
        print_summary=False,
    )
    trainer, _, _ = _fit(tmp_path, [frozen], SlowDiskIO(delay_s=0.15), every=10, max_steps=200)  # as kept above
    assert not [r for r in frozen.records if r.name == "async_checkpoint"]
    assert type(trainer.strategy.checkpoint_io) is SlowDiskIO


def test_a_replayed_plan_installs_the_background_writer(tmp_path, slow_disk_bound) -> None:
    first = la.Autopilot(
        only=["async_checkpoint"],
        measure_steps=10,
        budget_seconds=60,
        save_plan=tmp_path / "plan.json",
        print_summary=False,
    )
    _fit(tmp_path / "a", [first], SlowDiskIO(delay_s=0.15))
    assert [c.name for c in first.kept] == ["async_checkpoint"], first.records
    seen: list[str] = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.append(type(trainer.strategy.checkpoint_io).__name__)

    replay = la.Autopilot(plan=tmp_path / "plan.json", print_summary=False, save_plan=False)
    trainer, _, _ = _fit(tmp_path / "b", [replay, Spy()], SlowDiskIO(), max_steps=20)
    assert seen == ["OrderedAsyncCheckpointIO"]
    assert len(list((tmp_path / "b" / "ckpt").iterdir())) == 2


def test_a_fit_too_short_for_a_step_search_still_gets_the_background_writer(tmp_path, slow_disk_bound) -> None:
    autopilot = la.Autopilot(only=["async_checkpoint"], measure_steps=10, save_plan=False, print_summary=False)
    trainer, _, _ = _fit(tmp_path, [autopilot], SlowDiskIO(delay_s=0.15))
    assert autopilot.plan.stopped.startswith("not searched")  # no step fix on offer: the estimate's steps only
    row = next(r for r in autopilot.records if r.name == "async_checkpoint")
    assert row.kept, row.reason
    assert isinstance(trainer.strategy.checkpoint_io, OrderedAsyncCheckpointIO)


def test_the_trial_times_the_step_again_on_its_first_period(tmp_path, slow_disk_bound, monkeypatch) -> None:
    # the step time handed over by a short fit's estimate is 3 steps; one CI run's came out at 8x the step and the
    # background writer was costed out of its trial: the first measured period's 10 steps time the step again
    original = la.Autopilot._checkpoint_trial

    def inflated(self, run) -> None:
        self._step_seconds *= 8
        original(self, run)

    monkeypatch.setattr(la.Autopilot, "_checkpoint_trial", inflated)
    autopilot = la.Autopilot(only=["async_checkpoint"], measure_steps=10, save_plan=False, print_summary=False)
    _fit(tmp_path, [autopilot], SlowDiskIO(delay_s=0.15))
    row = next(r for r in autopilot.records if r.name == "async_checkpoint")
    assert row.kept, row.reason
