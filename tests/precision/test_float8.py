"""Float8Training on CPU through torchao's emulation: which layers it converts and why the others stay, the refusal
on devices without FP8 matmuls, training close to the plain model, checkpoints that move both ways, and MFUMonitor's
two denominators for an FP8 run."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.precision.float8 import Float8Training, float8_layers

try:  # torchao can fail to import on a torch it was not built for, not only be missing
    from torchao.float8.float8_linear import Float8Linear
except Exception:  # noqa: BLE001
    Float8Linear = None

needs_torchao = pytest.mark.skipif(Float8Linear is None, reason="needs torchao: pip install 'lightning-accel[torchao]'")


class LM(pl.LightningModule):
    """An embedding, two 64-wide blocks, a head tied to the embedding, and a 10-wide linear FP8 cannot take."""

    def __init__(self, fp8: dict | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
        self.odd = nn.Linear(64, 10)
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.roll(1, 1).flatten())
        loss = loss + 1e-3 * self.odd(h).square().mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 32, (64, 16), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8)


def fit(module: pl.LightningModule, callbacks: list, steps: int = 8, **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=callbacks, **kwargs,
    )  # fmt: skip
    trainer.fit(module)
    return trainer


def test_which_layers_it_converts_and_why_it_leaves_the_others() -> None:
    model = LM()
    chosen, left = float8_layers(model, min_size=0)
    assert chosen == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert "divisible by 16" in left["odd"] and "output head" in left["head"]
    assert float8_layers(model, min_size=0, include_head=True)[0][-1] == "head"
    assert float8_layers(model, min_size=0, skip=["blocks.1.*"])[0] == ["blocks.0.0", "blocks.0.2"]
    assert float8_layers(model, min_size=0, module_filter=lambda m, n: m.out_features == 64)[0] == [
        "blocks.0.2",
        "blocks.1.2",
    ]
    assert "min_size=100" in float8_layers(model, min_size=100)[1]["blocks.0.0"]
    # torchao's own size rule (measured on H100): these layers are all too small for FP8 to pay
    assert float8_layers(model)[0] == [] and "below torchao's size" in float8_layers(model)[1]["blocks.0.0"]
    big = nn.Sequential(nn.Linear(4096, 1024), nn.Linear(4096, 2048), nn.Linear(16, 16))  # the last: the head
    assert float8_layers(big)[0] == ["1"]  # tensorwise: K <= 4096 and N <= 1024 is too small
    assert float8_layers(big, recipe="rowwise")[0] == []  # rowwise wants N > 2048 as well


def test_it_refuses_devices_without_fp8_matmuls_in_one_line_naming_them(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match=r"cpu has no FP8 matmuls .*emulate=True"):
        Float8Training()._check_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"A100-SXM4-80GB \(cuda:0\) has compute capability 8\.0; .*>= 8\.9"):
        Float8Training()._check_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    Float8Training()._check_device(torch.device("cuda", 0))  # Hopper: no error
    Float8Training(emulate=True)._check_device(torch.device("cpu"))


def test_bad_arguments_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"recipe='delayed'.*'tensorwise'"):
        Float8Training(recipe="delayed")
    with pytest.raises(ValueError, match=r"min_size=-1"):
        Float8Training(min_size=-1)
    with pytest.raises(ValueError, match="tensorwise recipe only"):
        Float8Training(recipe="rowwise", fsdp_float8_all_gather=True)


@needs_torchao
def test_emulated_fp8_trains_close_to_the_plain_model() -> None:
    plain = LM()
    fit(plain, [])
    module = LM()
    callback = Float8Training(emulate=True, min_size=0)
    fit(module, [callback])
    assert callback.converted == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert all(isinstance(module.blocks[i][j], Float8Linear) for i in (0, 1) for j in (0, 2))
    assert type(module.head) is nn.Linear and type(module.odd) is nn.Linear
    assert callback.compute_dtype is None  # emulated: the matmuls ran in fp32, the peak stays fp32's
    assert module.losses[-1] < module.losses[0]  # it trains
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(plain.losses), rtol=0.03, atol=0.0)
    assert module.losses != plain.losses  # really through the FP8 casts


@needs_torchao
def test_one_callback_converts_each_model_it_fits_once() -> None:
    callback = Float8Training(emulate=True, min_size=0)
    first = LM()
    fit(first, [callback], steps=2)
    fit(first, [callback], steps=2)  # the same model again: already converted, left as it is
    assert isinstance(first.blocks[0][0], Float8Linear) and len(first.losses) == 4
    second = LM()
    fit(second, [callback], steps=2)  # a new model under the same callback is converted too
    assert isinstance(second.blocks[0][0], Float8Linear) and callback.converted[0] == "blocks.0.0"


@needs_torchao
def test_a_model_with_nothing_to_convert_is_refused_with_the_reasons() -> None:
    with pytest.raises(ValueError, match=r"no layer of LM to train in FP8 \(blocks\.0\.0: 64 -> 128: below torchao"):
        fit(LM(), [Float8Training(emulate=True)], steps=1)


@needs_torchao
def test_checkpoints_hold_plain_weights_both_ways(tmp_path) -> None:
    module = LM()
    trainer = fit(module, [Float8Training(emulate=True, min_size=0)], steps=4)
    path = tmp_path / "fp8.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all(type(v) is torch.Tensor for v in state.values())
    plain = LM()
    plain.load_state_dict(state)  # strict: the same keys as the unconverted model
    assert torch.equal(plain.blocks[0][0].weight, module.blocks[0][0].weight.detach())
    resumed = LM()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(resumed, ckpt_path=path)  # the FP8 checkpoint resumes without FP8
    assert trainer.global_step == 6 and len(resumed.losses) == 2
    plain_path = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(plain_path)
    again = LM()
    callback = Float8Training(emulate=True, min_size=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(again, ckpt_path=plain_path)  # and a plain checkpoint resumes under FP8
    assert trainer.global_step == 8 and callback.converted and isinstance(again.blocks[0][0], Float8Linear)


def test_without_compile_it_warns_that_fp8_is_slower(monkeypatch) -> None:
    pytest.importorskip("torchao.float8")
    from lightning_accel.callbacks.torch_compile import TorchCompile

    monkeypatch.setattr(Float8Training, "_check_device", lambda self, device: None)  # as on a Hopper GPU
    monkeypatch.setattr("torchao.float8.convert_to_float8_training", lambda module, **kw: module)
    for callbacks, warned in (([], True), ([TorchCompile()], False)):
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), callbacks=callbacks)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Float8Training(min_size=0).setup(trainer, LM(), "fit")  # type: ignore[arg-type]
        assert any("without TorchCompile" in str(w.message) for w in caught) is warned


def test_mfu_monitor_reports_an_fp8_run_against_both_peaks(monkeypatch) -> None:
    from lightning.pytorch.callbacks import Callback

    from lightning_accel.callbacks import mfu_monitor
    from lightning_accel.callbacks.mfu_monitor import MFUMonitor
    from lightning_accel.core.peak import PeakFlops

    peaks = {"fp8": 2e12, "bf16": 1e12}
    monkeypatch.setattr(
        mfu_monitor, "resolve_peak_flops", lambda device, dtype, override=None: PeakFlops(peaks[dtype], "table", dtype)
    )

    class Fp8(Callback):  # what Float8Training says once it converted layers on an FP8 GPU
        compute_dtype = "fp8"

    monitor = MFUMonitor(window=2, warmup_batches=1, print_summary=False)
    fit(LM(), [Fp8(), monitor], steps=8)
    s = monitor.summary
    assert s["dtype"] == "fp8" and s["peak_flops"] == 2e12
    assert s["mfu_bf16_peak"] == pytest.approx(2 * s["mfu"], rel=1e-6)
    assert "MFU (bf16 peak)" in str([c._cells for c in monitor._summary_table().columns])
