"""The one training-step runner (``StepRunner.optimizer_step``) on its own: a tiny float64 model and a stand-in
Trainer, so accumulation, skipped losses, manual optimization, the GradScaler and DDP ``no_sync`` are checked
exactly, without the fit loop."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from lightning_accel.callbacks._fit.step_runner import StepRunner


class Tiny(pl.LightningModule):
    """Linear regression in float64; a batch whose first target is NaN returns ``None`` (asks to be skipped)."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1).double()
        self.automatic_optimization = not manual
        self.calls: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls.append(batch_idx)
        x, y = batch
        if torch.isnan(y[0]):
            return None
        return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}


class Recorder:
    """Records the calls made on it, in order, into a shared list."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log


class RecordingPrecision(Precision):
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    @contextlib.contextmanager
    def train_step_context(self) -> Any:
        self.log.append("context")
        yield


class FakeScaler(Recorder):
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.log.append("scale")
        return loss * 4.0

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append("scaler.step")
        optimizer.step()

    def update(self) -> None:
        self.log.append("update")


class RecordingSGD(torch.optim.SGD):
    def __init__(self, params: Any, log: list[Any]) -> None:
        super().__init__(params, lr=0.1)
        self.log = log

    def step(self, closure: Any = None) -> Any:
        self.log.append("opt.step")
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.log.append("zero_grad")
        super().zero_grad(set_to_none=set_to_none)


class DDPLike(torch.nn.Module):
    """Stands in for the DDP wrapper: its forward is the strategy's training_step, ``no_sync`` is recorded."""

    def __init__(self, module: pl.LightningModule, log: list[Any]) -> None:
        super().__init__()
        self.module, self.log, self.syncing = module, log, True

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, batch: Any, batch_idx: int) -> Any:
        self.log.append(("strategy", batch_idx, self.syncing))
        return self.module.training_step(batch, batch_idx)


def _runner(module: Tiny, *, scaler: Any = None, world_size: int = 1) -> tuple[StepRunner, list[Any]]:
    log: list[Any] = []
    precision = RecordingPrecision(log)
    if scaler is not None:
        precision.scaler = scaler(log)
    model = DDPLike(module, log)
    strategy = SimpleNamespace(root_device=torch.device("cpu"), model=model, training_step=model)
    trainer = SimpleNamespace(
        strategy=strategy,
        precision_plugin=precision,
        world_size=world_size,
        optimizers=[RecordingSGD(module.parameters(), log)],
    )
    return StepRunner(trainer, module), log  # type: ignore[arg-type]


def _batch(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, generator=g, dtype=torch.float64)
    y = torch.randn(8, 1, generator=g, dtype=torch.float64)
    return x[rows], y[rows]


def test_two_accumulated_micro_batches_give_the_gradient_and_update_of_one_double_batch() -> None:
    whole, whole_log = _runner(Tiny())
    one = whole.optimizer_step([_batch(slice(0, 8))], 1, capture=True)
    split, split_log = _runner(Tiny())
    two = split.optimizer_step([_batch(slice(0, 4)), _batch(slice(4, 8))], 2, capture=True)
    assert one.stepped and two.stepped
    torch.testing.assert_close(two.grad, one.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(two.update, one.update, rtol=1e-12, atol=1e-14)
    assert not torch.equal(two.update, torch.zeros_like(two.update))
    torch.testing.assert_close(split.module.net.weight, whole.module.net.weight, rtol=1e-12, atol=1e-14)
    # the losses are kept as training_step returned them (not divided), one per micro-batch, in order
    assert len(two.losses) == 2
    assert float(two.losses[0] + two.losses[1]) / 2 == pytest.approx(float(one.losses[0]), rel=1e-12)
    # the plain-module path: each forward in the precision plugin's context, batch_idx the micro-batch's index;
    # one optimizer step after both backwards, the gradients zeroed after it
    assert split.module.calls == [0, 1]
    assert split_log == ["context", "context", "opt.step", "zero_grad"]
    assert all(p.grad is None for p in split.module.parameters())


def test_a_none_loss_skips_its_backward_and_no_loss_at_all_skips_the_optimizer_step() -> None:
    skipped = _batch(slice(0, 4))
    skipped = (skipped[0], torch.full_like(skipped[1], float("nan")))
    runner, _ = _runner(Tiny())
    part = runner.optimizer_step([skipped, _batch(slice(4, 8))], 2, capture=True)
    alone, _ = _runner(Tiny())
    ref = alone.optimizer_step([_batch(slice(4, 8))], 1, capture=True)
    assert len(part.losses) == 1 and part.stepped
    torch.testing.assert_close(part.grad, ref.grad / 2, rtol=1e-12, atol=1e-14)  # still divided by the 2 batches

    runner, log = _runner(Tiny())
    before = [p.detach().clone() for p in runner.module.parameters()]
    none = runner.optimizer_step([skipped, skipped], 2, capture=True)
    assert none.losses == [] and not none.stepped and none.update is None
    assert "opt.step" not in log and "zero_grad" not in log
    assert all(torch.equal(p, b) for p, b in zip(runner.module.parameters(), before))


def test_manual_optimization_runs_training_step_only() -> None:
    runner, log = _runner(Tiny(manual=True), scaler=FakeScaler)
    before = [p.detach().clone() for p in runner.module.parameters()]
    out = runner.optimizer_step([_batch(slice(0, 4)), _batch(slice(4, 8))], 2, capture=True)
    assert runner.module.calls == [0, 1]
    assert log == ["context", "context"]  # no scale, no backward, no optimizer step, no zero_grad
    assert out.losses == [] and not out.stepped and out.grad is None
    assert all(p.grad is None for p in runner.module.parameters())
    assert all(torch.equal(p, b) for p, b in zip(runner.module.parameters(), before))


def test_the_precision_plugins_scaler_scales_every_backward_then_steps_and_updates_once() -> None:
    runner, log = _runner(Tiny(), scaler=FakeScaler)
    out = runner.optimizer_step([_batch(slice(0, 4)), _batch(slice(4, 8))], 2, capture=True)
    assert log == ["context", "scale", "context", "scale", "scaler.step", "opt.step", "update", "zero_grad"]
    plain, _ = _runner(Tiny())
    ref = plain.optimizer_step([_batch(slice(0, 4)), _batch(slice(4, 8))], 2, capture=True)
    # the captured gradient is the scaled one (the probe compares directions)
    torch.testing.assert_close(out.grad, 4.0 * ref.grad, rtol=1e-12, atol=1e-14)


def test_through_the_strategy_all_but_the_last_micro_batch_skip_the_gradient_sync() -> None:
    runner, log = _runner(Tiny(), world_size=2)
    timer = SimpleNamespace(marks=[])
    timer.start = lambda stage, host=False: timer.marks.append(("start", stage))
    timer.stop = lambda stage: timer.marks.append(("stop", stage))
    runner.optimizer_step(
        [_batch(slice(0, 3)), _batch(slice(3, 6)), _batch(slice(6, 8))], 3, through_strategy=True, timer=timer
    )
    assert log == [("strategy", 0, False), ("strategy", 1, False), ("strategy", 2, True), "opt.step", "zero_grad"]
    stages = [s for kind, s in timer.marks if kind == "start"]
    assert stages == ["forward", "backward"] * 3 + ["optimizer"]
    assert timer.marks.count(("stop", "optimizer")) == 1

    single, log = _runner(Tiny(), world_size=1)  # one process: no DDP wrapper to silence
    single.optimizer_step([_batch(slice(0, 4)), _batch(slice(4, 8))], 2, through_strategy=True)
    assert [e for e in log if isinstance(e, tuple)] == [("strategy", 0, True), ("strategy", 1, True)]
