"""AutoMixedPrecision on CPU: dtype choice, fp32 islands, GradScaler (planted overflow, checkpoints, clipping)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_accel.core import precision as core_precision
from lightning_accel.core.precision import Fp32Islands, choose_autocast_dtype
from lightning_accel.precision import AutoMixedPrecision


class Net(pl.LightningModule):
    """Linear -> LayerNorm -> Linear regression; ``overflow_at`` plants a step whose loss overflows fp16."""

    def __init__(self, overflow_at: int | None = None, optimizer: str = "adam") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)
        self.overflow_at = overflow_at
        self.optimizer = optimizer
        self.seen_dtypes: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        self.seen_dtypes["fc1"] = h.dtype
        h = self.norm(h)
        self.seen_dtypes["norm"] = h.dtype
        out = self.head(h)
        self.seen_dtypes["head"] = out.dtype
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if self.overflow_at is not None and self.global_step == self.overflow_at:
            out = out * 1e4  # squared below: ~1e8 > fp16 max (65504) -> inf grads through the fp16 matmuls
        return nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def trainer(plugin: AutoMixedPrecision | None, steps: int, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        plugins=[plugin] if plugin else None,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------- dtype choice
def test_explicit_dtype_unsupported_names_what_device_supports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_precision, "supported_autocast_dtypes", lambda device: ["fp16"])
    with pytest.raises(ValueError, match=r"supports fp16 \(plus 'fp32'\)"):
        choose_autocast_dtype("cpu", "bf16")
    with pytest.raises(ValueError, match="use one of"):
        AutoMixedPrecision(dtype="int8")


@pytest.mark.parametrize(("capability", "expected"), [((8, 0), torch.bfloat16), ((7, 0), torch.float16)])
def test_auto_on_cuda_bf16_in_hardware_else_fp16(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: torch.dtype
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    choice = choose_autocast_dtype("cuda", "auto")
    assert choice.dtype == expected
    assert choice.needs_scaler == (expected == torch.float16)


@pytest.mark.parametrize(
    ("speedups", "expected"),
    [
        ({"bf16": 0.4, "fp16": 0.3}, torch.float32),  # emulated half precision: keep fp32
        ({"bf16": 1.05, "fp16": 1.08}, torch.float32),  # within noise of fp32: keep fp32
        ({"bf16": 1.8, "fp16": 1.9}, torch.bfloat16),  # within 10 % of the fastest: bf16 (no scaler)
        ({"bf16": 1.2, "fp16": 2.0}, torch.float16),  # fp16 clearly fastest (AMX-FP16)
    ],
)
def test_auto_on_cpu_follows_the_probe(
    monkeypatch: pytest.MonkeyPatch, speedups: dict[str, float], expected: torch.dtype
) -> None:
    monkeypatch.setattr(core_precision, "autocast_speedup", lambda device, name: speedups[name])
    choice = choose_autocast_dtype("cpu", "auto")
    assert choice.dtype == expected
    assert choice.speedups == speedups


def test_cpu_probe_is_measured_and_cached() -> None:
    core_precision._PROBE_CACHE.clear()
    first = core_precision.autocast_speedup("cpu", "bf16", size=64, repeats=2)
    assert first > 0
    assert core_precision.autocast_speedup("cpu", "bf16") == first  # cached


def test_plugin_reports_kept_fp32_when_probe_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_precision, "autocast_speedup", lambda device, name: 0.5)
    plugin = AutoMixedPrecision()
    model = Net()
    trainer(plugin, 1).fit(model)
    assert plugin.compute_dtype == torch.float32 and plugin.precision == "32-true"
    assert plugin.scaler is None and plugin.loss_scale is None
    assert model.seen_dtypes["fc1"] == torch.float32
    assert plugin.total_steps == 1 and plugin.skipped_steps == 0
    from lightning_accel.callbacks._fit.trainer_state import compute_dtype

    t = trainer(AutoMixedPrecision(dtype="bf16"), 1)
    t.fit(Net())
    assert compute_dtype(t) == "bf16"  # what MFUMonitor reads


# ---------------------------------------------------------------------------------------------- fp32 islands
def test_islands_run_fp32_while_other_layers_run_bf16() -> None:
    plugin = AutoMixedPrecision(dtype="bf16", fp32_modules=[nn.LayerNorm, "head"])
    model = Net()
    trainer(plugin, 2).fit(model)
    assert model.seen_dtypes == {"fc1": torch.bfloat16, "norm": torch.float32, "head": torch.float32}
    assert plugin.compute_dtype == torch.bfloat16 and plugin.precision == "bf16-mixed"
    assert plugin.scaler is None
    # teardown removed the hooks: outside fit the model is a plain module again
    assert plugin.fp32_module_names == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 8))
    assert model.seen_dtypes["head"] == torch.bfloat16


def test_island_upcasts_half_inputs_restores_autocast_after_an_error_and_survives_deepcopy() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert x.dtype == torch.float32  # upcast on the way in
            assert not torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.LayerNorm(4))
    islands = Fp32Islands(model, [Boom, "2"], "cpu")
    assert islands.names == ["1", "2"] and islands.unmatched == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")  # re-enabled on the way out
        copied = copy.deepcopy(model)
        assert copied[2](torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.float32  # island on the copy
        assert copied[2].forward.__self__ is copied[2]
    islands.remove()
    assert "forward" not in vars(model[1]) and list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_unmatched_fp32_modules_warn_with_their_names() -> None:
    plugin = AutoMixedPrecision(dtype="bf16", fp32_modules=[nn.LayerNorm, nn.Conv2d, "*.softmax"])
    with pytest.warns(UserWarning, match=r"Conv2d, '\*\.softmax' matched no module of Net.*LayerNorm, Linear"):
        trainer(plugin, 1).fit(Net())
    assert plugin.fp32_module_names == []  # removed at teardown


def test_invalid_arguments_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match="growth_factor"):
        AutoMixedPrecision(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        AutoMixedPrecision(backoff_factor=2)
    with pytest.raises(ValueError, match="init_scale"):
        AutoMixedPrecision(init_scale=float("inf"))
    with pytest.raises(ValueError, match="growth_interval"):
        AutoMixedPrecision(growth_interval=0)
    with pytest.raises(ValueError, match="neither nn.Module types nor name patterns"):
        AutoMixedPrecision(fp32_modules=[3])


# ---------------------------------------------------------------------------------------------- GradScaler
class WeightSpy(Callback):
    """Copies the weights and optimizer state at the start and end of every batch."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.opt_after: dict[int, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.before[i] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self.after[i] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.opt_after[i] = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])


def test_planted_fp16_overflow_is_skipped_counted_and_leaves_weights_untouched() -> None:
    plugin = AutoMixedPrecision(dtype="fp16", init_scale=2.0**8)
    spy = WeightSpy()
    trainer(plugin, 4, callbacks=[spy]).fit(Net(overflow_at=2))
    assert plugin.total_steps == 4
    assert plugin.skipped_steps == 1
    assert plugin.loss_scale == 2.0**7  # backed off once (backoff_factor 0.5)
    for k in spy.before[2]:  # the bad step changed nothing, bit for bit
        assert torch.equal(spy.before[2][k], spy.after[2][k]), k
    for k, v in spy.opt_after[2].items():  # Adam moments not polluted either
        assert torch.equal(v["exp_avg"], spy.opt_after[1][k]["exp_avg"])
    assert not torch.equal(spy.before[3]["fc1.weight"], spy.after[3]["fc1.weight"])  # training went on


def test_scaler_state_round_trips_through_a_checkpoint_file(tmp_path: Any) -> None:
    plugin = AutoMixedPrecision(dtype="fp16", init_scale=2.0**8, growth_interval=3, growth_factor=4.0)
    t = trainer(plugin, 5)
    t.fit(Net(overflow_at=1))
    saved_scale = plugin.loss_scale
    assert saved_scale == 2.0**7 * 4  # one back-off at step 1, one growth after 3 clean steps (2, 3, 4)
    path = tmp_path / "amp.ckpt"
    t.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["AutoMixedPrecision"]
    assert state["scaler"]["scale"] == saved_scale and state["scaler"]["growth_interval"] == 3
    assert state["skipped_steps"] == 1 and state["total_steps"] == 5 and state["dtype"] == "float16"

    class ScaleAtStart(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.scale = trainer.precision_plugin.loss_scale
            self.interval = trainer.precision_plugin.scaler.get_growth_interval()

    resumed = AutoMixedPrecision(dtype="fp16")  # default scaler config: the checkpoint's must win
    probe = ScaleAtStart()
    trainer(resumed, 6, callbacks=[probe]).fit(Net(), ckpt_path=path)
    assert probe.scale == saved_scale and probe.interval == 3
    assert resumed.total_steps == 6 and resumed.skipped_steps == 1


class ClipNet(Net):
    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.norms_after_clip: list[float] = []

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms_after_clip.append(
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        )


class GradAtStep(Callback):
    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]).clone())


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradients_are_unscaled_before_clipping_with_accumulation(dtype: str) -> None:
    plugin = AutoMixedPrecision(dtype=dtype, init_scale=2.0**8)  # 2**16 overflows this model's fp16 grads
    model, spy = ClipNet(), GradAtStep()
    trainer(plugin, 2, gradient_clip_val=0.05, accumulate_grad_batches=2, callbacks=[spy]).fit(model)
    ref_model, ref_spy = ClipNet(), GradAtStep()
    trainer(None, 2, gradient_clip_val=0.05, accumulate_grad_batches=2, callbacks=[ref_spy]).fit(ref_model)
    # what on_before_optimizer_step sees is the true (unscaled, accumulated) gradient, as in fp32
    tol = 0.05 if dtype == "bf16" else 0.01
    torch.testing.assert_close(spy.grads[0], ref_spy.grads[0], rtol=tol, atol=tol * float(ref_spy.grads[0].abs().max()))
    assert float(torch.linalg.vector_norm(ref_spy.grads[0])) > 0.05  # so clipping really acted
    assert len(model.norms_after_clip) == 2
    assert all(n <= 0.05 * 1.001 for n in model.norms_after_clip), model.norms_after_clip
    assert plugin.skipped_steps == 0


def test_state_dict_loaded_before_setup_is_applied_when_the_scaler_exists() -> None:
    plugin = AutoMixedPrecision(dtype="fp16")
    plugin.load_state_dict(
        {
            "scaler": {
                "scale": 4.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 7,
                "_growth_tracker": 0,
            },
            "skipped_steps": 3,
            "total_steps": 10,
        }
    )
    assert plugin.scaler is None
    trainer(plugin, 1).fit(Net())
    assert plugin.scaler is not None and plugin.scaler.get_growth_interval() == 7
    assert plugin.total_steps == 11 and plugin.skipped_steps >= 3
