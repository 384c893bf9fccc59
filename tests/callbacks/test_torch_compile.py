"""TorchCompile on CPU: same loss as eager, clean checkpoint keys, eager fallback, MFUMonitor warm-up."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_accel.callbacks.torch_compile import TorchCompile


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    """Each test starts with empty dynamo caches and counters (cache entries are per process)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 1))
        self.loss_fn = nn.MSELoss()  # no parameters: not a default target

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(48, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=8)


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.values.append(float(outputs["loss"]))


def fit(callbacks: list[Callback], steps: int = 4, **kwargs: Any) -> tuple[pl.Trainer, Net]:
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit(model)
    return trainer, model


def eager_losses(steps: int = 4) -> list[float]:
    losses = Losses()
    fit([losses], steps)
    return losses.values


def test_compiled_training_matches_eager_and_checkpoint_keys_are_clean(tmp_path: Any) -> None:
    compile_cb, losses = TorchCompile(backend="aot_eager"), Losses()
    trainer, model = fit([compile_cb, losses])
    assert compile_cb.compiled_names == ["model"] and compile_cb.fallback_reason is None
    assert model.model._compiled_call_impl is not None
    assert compile_cb.first_call_seconds["model"] > 0
    assert graphs_compiled() >= 1  # really compiled, not silently eager
    torch.testing.assert_close(losses.values, eager_losses(), rtol=1e-5, atol=1e-6)
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    keys = list(torch.load(path, weights_only=False)["state_dict"])
    assert keys == list(Net().state_dict()) and not any("_orig_mod" in k for k in keys)
    fresh = Net()
    fresh.load_state_dict(torch.load(path, weights_only=False)["state_dict"])  # loads into a plain eager model


def test_a_failing_backend_falls_back_to_eager_with_one_warning() -> None:
    def broken_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("backend exploded")

    compile_cb, losses = TorchCompile(backend=broken_backend), Losses()
    with pytest.warns(UserWarning, match="compiling model failed.*backend exploded.*Running eagerly") as record:
        _, model = fit([compile_cb, losses])
    assert sum("TorchCompile" in str(w.message) for w in record) == 1
    assert compile_cb.fallback_reason is not None and compile_cb.compiled_names == []
    assert model.model._compiled_call_impl is None
    assert losses.values == eager_losses()  # bit-identical: the same eager computation


def test_unavailable_torch_compile_falls_back_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", unavailable)
    compile_cb = TorchCompile()
    with pytest.warns(UserWarning, match="torch.compile is unavailable here.*not supported on this Python"):
        fit([compile_cb], steps=1)
    assert compile_cb.compiled_names == []


def test_listed_submodules_and_bad_targets() -> None:
    compile_cb = TorchCompile(modules=["model.0", nn.LayerNorm], backend="eager")
    _, model = fit([compile_cb], steps=1)
    assert compile_cb.compiled_names == ["model.0", "model.2"]
    assert model.model[0]._compiled_call_impl is not None and model.model[1]._compiled_call_impl is None
    with pytest.raises(
        ValueError,
        match=r"'encoder\.\*' matched no submodule of Net; names present include "
        r"\['model', 'model\.0'",
    ):
        fit([TorchCompile(modules=["encoder.*"])], steps=1)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="mode='fast'"):
        TorchCompile(mode="fast")
    with pytest.raises(ValueError, match="warmup_batches"):
        TorchCompile(warmup_batches=-1)
    with pytest.raises(ValueError, match="not both"):
        TorchCompile(mode="max-autotune", options={"max_autotune": True})


def test_mfu_monitor_leaves_out_the_compile_warmup() -> None:
    from lightning_accel.callbacks.mfu_monitor import MFUMonitor
    from lightning_accel.core.flops import count_flops

    monitor = MFUMonitor(window=2, warmup_batches=1, peak_flops=1e12, print_summary=False)
    compile_cb = TorchCompile(backend="aot_eager", warmup_batches=2)
    fit([compile_cb, monitor], steps=6)
    assert monitor.summary["warmup_batches"] == 3
    # the FLOP-counting first batch ran eagerly (exact model FLOPs); compilation still happened afterwards
    assert monitor.summary["flops_per_batch"] == count_flops(Net().model, torch.randn(8, 8))
    assert compile_cb.fallback_reason is None and graphs_compiled() >= 1


@pytest.mark.slow
def test_inductor_matches_eager() -> None:
    compile_cb, losses = TorchCompile(), Losses()  # inductor: generates and builds C++ (gcc), ~10-60 s on CPU
    fit([compile_cb, losses])
    assert compile_cb.fallback_reason is None, compile_cb.fallback_reason
    assert graphs_compiled() >= 1
    torch.testing.assert_close(losses.values, eager_losses(), rtol=1e-4, atol=1e-5)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Deep(Net):
    """An embedding, four identical blocks in a ModuleList (each with an inner Sequential), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.ModuleDict(
            {"embed": nn.Linear(8, 16), "blocks": nn.ModuleList(Block() for _ in range(4)), "head": nn.Linear(16, 1)}
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.model["embed"](x)
        for block in self.model["blocks"]:
            h = block(h)
        return self.loss_fn(self.model["head"](h), y)


def fit_deep(callbacks: list[Callback], steps: int = 3) -> Deep:
    model = Deep()
    pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=callbacks,
    ).fit(model)  # fmt: skip
    return model


def test_regions_compile_each_repeated_block_once_and_train_as_eager() -> None:
    eager = Losses()
    fit_deep([eager])
    torch._dynamo.reset()
    compile_cb, losses = TorchCompile(regions=True, backend="aot_eager"), Losses()
    before = graphs_compiled()  # the counters outlive dynamo's reset
    model = fit_deep([compile_cb, losses])
    blocks = [f"model.blocks.{i}" for i in range(4)]
    assert compile_cb.compiled_names == blocks  # not the inner Sequentials, not the embedding or the head
    assert all(b._compiled_call_impl is not None for b in model.model["blocks"])
    assert model.model["head"]._compiled_call_impl is None and model.model["embed"]._compiled_call_impl is None
    from lightning_accel.callbacks.torch_compile import REGIONS_SHARE_GRAPHS_FROM, _torch_release

    if _torch_release() >= REGIONS_SHARE_GRAPHS_FROM:
        assert graphs_compiled() - before == 1  # the four blocks share one graph: the cold start of one block
    else:  # an older torch guards each block (TorchCompile warns so): one graph per block, none run eagerly
        assert graphs_compiled() - before == 4
    assert set(compile_cb.first_call_seconds) == set(blocks)
    torch.testing.assert_close(losses.values, eager.values, rtol=1e-5, atol=1e-6)


def test_regions_refuse_a_target_without_repeated_blocks() -> None:
    with pytest.raises(ValueError, match=r"regions=True\): model \(Sequential\) has no nn\.ModuleList"):
        fit([TorchCompile(regions=True, backend="eager")], steps=1)
    with pytest.raises(ValueError, match="regions='auto'"):
        TorchCompile(regions="auto")  # type: ignore[arg-type]
