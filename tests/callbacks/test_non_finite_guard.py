"""NonFiniteGuard on CPU: skips bad steps without touching weights or Adam state, names parameters, aborts."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_accel.callbacks.non_finite_guard import NonFiniteGuard
from lightning_accel.precision import AutoMixedPrecision


class Net(pl.LightningModule):
    """``nan_loss_at``: steps whose loss is nan; ``nan_grad_at``: steps where one entry of fc1.weight.grad is nan."""

    def __init__(
        self, nan_loss_at: set[int] = frozenset(), nan_grad_at: set[int] = frozenset(), nan_from: int | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 1)
        self.nan_loss_at, self.nan_grad_at, self.nan_from = set(nan_loss_at), set(nan_grad_at), nan_from
        self.logged: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))).float(), y)
        if self.global_step in self.nan_loss_at or (self.nan_from is not None and self.global_step >= self.nan_from):
            loss = loss * float("nan")
        return loss

    def on_after_backward(self) -> None:
        if self.global_step in self.nan_grad_at:
            self.fc1.weight.grad[0, 0] = float("nan")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.logged.append({k: float(v) for k, v in self.trainer.callback_metrics.items()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(96, 6, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=8)


class Spy(Callback):
    def __init__(self) -> None:
        self.before: dict[int, Any] = {}
        self.after: dict[int, Any] = {}

    def _snap(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return (
            {k: v.clone() for k, v in pl_module.state_dict().items()},
            copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.before[trainer.global_step] = self._snap(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self.after[trainer.global_step] = self._snap(trainer, pl_module)


def fit(model: pl.LightningModule, steps: int, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        log_every_n_steps=1,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


def assert_same(a: Any, b: Any) -> None:
    weights_a, opt_a = a
    weights_b, opt_b = b
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
    assert opt_a.keys() == opt_b.keys()
    for k in opt_a:
        for name in opt_a[k]:
            assert torch.equal(torch.as_tensor(opt_a[k][name]), torch.as_tensor(opt_b[k][name])), (k, name)


def test_bad_steps_are_skipped_bit_for_bit_and_named() -> None:
    guard, spy = NonFiniteGuard(max_consecutive=3), Spy()
    model = Net(nan_loss_at={2}, nan_grad_at={4})
    with pytest.warns(UserWarning, match=r"step 4: non-finite gradients in fc1\.weight; skipped"):
        trainer = fit(model, 7, [guard, spy])
    # steps 2 and 4 were skipped: weights AND AdamW moments/step counters unchanged (Lightning's global_step
    # still advances on a skipped step, so after[k + 1] is the state at the end of step k)
    assert_same(spy.before[2], spy.after[3])
    assert_same(spy.before[4], spy.after[5])
    # good steps changed the weights
    assert not torch.equal(spy.before[3][0]["fc1.weight"], spy.after[4][0]["fc1.weight"])
    assert guard.bad_steps == 2 and guard.skipped_steps == 2 and guard.consecutive == 0
    assert guard.last_bad_params == ["fc1.weight"]
    assert model.logged[-1]["nonfinite/bad_steps"] == 2.0
    assert model.logged[-1]["nonfinite/skipped_steps"] == 2.0
    assert torch.isfinite(model.fc1.weight).all()
    assert "step" not in vars(trainer.optimizers[0])  # the wrapper is gone after fit
    assert guard.state_dict() == {"bad_steps": 2, "skipped_steps": 2, "consecutive": 0}


def test_stops_after_max_consecutive_bad_steps_without_writing_bad_values() -> None:
    guard, spy = NonFiniteGuard(max_consecutive=3), Spy()
    model = Net(nan_from=3)
    with pytest.raises(
        RuntimeError,
        match=r"3 consecutive optimizer steps .*\(loss nan; non-finite gradients in "
        r"fc1\.weight, fc1\.bias, fc2\.weight, fc2\.bias.* none of these steps",
    ):
        fit(model, 20, [guard, spy])
    assert guard.bad_steps == 3 and guard.consecutive == 3
    weights_before_bad, _ = spy.before[3]
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights_before_bad[k]), k


def test_nan_loss_in_one_accumulated_micro_batch_skips_the_whole_step() -> None:
    class MicroNaN(Net):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == 2 else loss  # first micro-batch of optimizer step 1

    guard, spy = NonFiniteGuard(), Spy()
    with pytest.warns(UserWarning, match="loss nan"):
        fit(MicroNaN(), 3, [guard, spy], accumulate_grad_batches=2)
    assert guard.bad_steps == 1 and guard.skipped_steps == 1
    assert_same(spy.before[1], spy.after[2])


def test_with_gradscaler_the_scaler_skips_and_the_guard_counts_and_logs_amp_stats() -> None:
    guard = NonFiniteGuard()
    plugin = AutoMixedPrecision(dtype="fp16", init_scale=2.0**8)
    model = Net(nan_grad_at={1})
    with pytest.warns(UserWarning, match="GradScaler skips it"):
        fit(model, 3, [guard], plugins=[plugin])
    assert guard.bad_steps == 1 and guard.skipped_steps == 0  # the scaler did the skipping
    assert plugin.skipped_steps == 1 and plugin.loss_scale == 2.0**7
    last = model.logged[-1]
    assert last["amp/loss_scale"] == 2.0**7 and last["amp/skipped_steps"] == 1.0 and last["amp/total_steps"] == 3.0


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="max_consecutive=0"):
        NonFiniteGuard(max_consecutive=0)
    with pytest.raises(ValueError, match="max_names"):
        NonFiniteGuard(max_names=-1)
