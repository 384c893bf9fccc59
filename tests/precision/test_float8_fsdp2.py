"""2 CPU processes (gloo): ``Float8Training`` under ``fsdp2`` (torchao's emulation), with and without the FP8
all-gather of the sharded weights, trains like the same FP8 model in one process."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import read_rank_json

SCRIPT = r"""
import json
import torch
import torch.nn as nn
import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_accel  # registers the strategy strings
from lightning_accel import Float8Training

torch.set_num_threads(1)
STEPS, BATCH = 4, 4
X = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 16))


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build()
        self.losses = []

    def training_step(self, batch, i):
        loss = self.model(batch[0]).square().mean()
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self):
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(TensorDataset(X), shuffle=False, **kwargs)
        return DataLoader(TensorDataset(X), batch_size=BATCH, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def reference():
    # the same FP8 layers in one process on the whole batch of 2 x BATCH
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from dataclasses import replace

    model = build()
    config = replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in {"0", "2"}, config=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(STEPS):
        loss = model(X[i * 2 * BATCH:(i + 1) * 2 * BATCH]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


out = {"ref": reference()}
for all_gather in (False, True):
    callback = Float8Training(emulate=True, min_size=0, fsdp_float8_all_gather=all_gather)
    t = pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_steps=STEPS, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   use_distributed_sampler=False, callbacks=[callback])
    task = Task()
    t.fit(task)
    out[str(all_gather)] = {"losses": task.losses, "converted": callback.converted,
                            "all_gather": callback._all_gather,
                            "types": [type(m).__name__ for m in task.model],
                            "weight": type(getattr(task.model[0].weight, "_local_tensor", None)).__name__}
with open(f"fp8_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao: pip install torchao")
def test_fsdp2_with_fp8_all_gather_trains_like_one_process(ddp_script, tmp_path):
    ddp_script(SCRIPT, timeout=300)
    rank0, rank1 = read_rank_json(tmp_path, "fp8")
    for all_gather in ("False", "True"):
        r0, r1 = rank0[all_gather], rank1[all_gather]
        assert r0["converted"] == ["model.0", "model.2"]  # the last linear is the head: left out
        assert r0["types"][0] == "Float8Linear" and r0["types"][4] == "Linear"
        assert r0["all_gather"] is (all_gather == "True")
        # torchao's FP8 all-gather holds each shard as a tensor subclass that casts before the gather
        assert (r0["weight"] == "WeightWithDynamicFloat8CastTensor") is (all_gather == "True"), r0["weight"]
        # the mean of the two ranks' losses follows the one-process FP8 run on the whole batch: the activations' and
        # gradients' FP8 scales come from each rank's half of the batch, so the steps after the first drift apart
        # within FP8's rounding (e4m3 keeps 3 mantissa bits)
        mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
        assert mean[0] == pytest.approx(rank0["ref"][0], rel=1e-3)
        assert mean == pytest.approx(rank0["ref"], rel=0.02)
    # the FP8 all-gather casts each shard with the scale of the whole weight (its amax all-reduced): the same FP8
    # weights as casting after a plain all-gather
    assert rank0["True"]["losses"] == pytest.approx(rank0["False"]["losses"], rel=1e-5)
    assert rank1["True"]["losses"] == pytest.approx(rank1["False"]["losses"], rel=1e-5)
