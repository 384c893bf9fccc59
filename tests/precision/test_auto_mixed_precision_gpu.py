"""AutoMixedPrecision on a real CUDA GPU (skipped without one): the dtype rule and fp16 scaling on the device."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_accel.precision import AutoMixedPrecision
from tests.precision.test_auto_mixed_precision import Net, WeightSpy


def gpu_trainer(plugin: AutoMixedPrecision, steps: int, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="gpu",
        devices=1,
        plugins=[plugin],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.gpu
def test_auto_picks_bf16_on_ampere_or_newer_else_fp16_and_islands_stay_fp32() -> None:
    plugin = AutoMixedPrecision(fp32_modules=[nn.LayerNorm])
    model = Net()
    gpu_trainer(plugin, 2).fit(model)
    expected = torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16
    assert plugin.compute_dtype == expected
    assert (plugin.scaler is not None) == (expected == torch.float16)
    assert model.seen_dtypes == {"fc1": expected, "norm": torch.float32, "head": expected}


@pytest.mark.gpu
def test_fp16_overflow_on_gpu_is_skipped_and_counted() -> None:
    plugin = AutoMixedPrecision(dtype="fp16", init_scale=2.0**8)
    spy = WeightSpy()
    gpu_trainer(plugin, 4, callbacks=[spy]).fit(Net(overflow_at=2))
    assert plugin.skipped_steps == 1 and plugin.total_steps == 4 and plugin.loss_scale == 2.0**7
    for k in spy.before[2]:
        assert torch.equal(spy.before[2][k], spy.after[2][k]), k
