"""DeepSpeed ZeRO presets on CPU (2 processes, gloo, DeepSpeed's CPU accelerator), config merging, deepspeed_auto."""

from __future__ import annotations

import os

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

import lightning_accel  # noqa: F401  (registers the strategy strings)
from lightning_accel.core.memory import estimate_zero_memory
from lightning_accel.strategies.deepspeed_presets import PRESETS, choose_zero_preset, preset_config
from tests.conftest import read_rank_json

# Per preset that DeepSpeed runs on CPU: run A trains 2N steps and checkpoints at step N (an epoch boundary, so
# the resumed run sees the same batches); run B resumes from that checkpoint. Steps N+1..2N must give the same
# losses: weights, optimizer states (sharded, Adam moments) and the step counter all came back.
SCRIPT = r"""
import json, os, sys, glob
import torch
import lightning.pytorch as pl
from torch import nn
from lightning.pytorch.callbacks import ModelCheckpoint
import lightning_accel

N = 3
PRESETS = sys.argv[1].split(",")

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

class Losses(pl.Callback):
    def __init__(self): self.losses = {}
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])

def loader():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * N * 8, 16, generator=g)  # 2 ranks x N batches of 8: one epoch = N steps
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].sin()), batch_size=8)

def fit(preset, steps, ckpt_dir=None, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    losses = Losses()
    callbacks = [losses]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=N, save_top_k=-1,
                                         filename="{step}"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=preset, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=bool(ckpt_dir), default_root_dir=os.getcwd())
    trainer.fit(Net(), loader(), ckpt_path=ckpt_path)
    return trainer, losses.losses

out = {}
for preset in PRESETS:
    ckdir = os.path.join(os.getcwd(), preset)
    trainer, straight = fit(preset, 2 * N, ckpt_dir=ckdir)
    stage = trainer.strategy.config["zero_optimization"]["stage"]
    ckpt = os.path.join(ckdir, f"step={N}.ckpt")
    _, resumed = fit(preset, 2 * N, ckpt_path=ckpt)
    out[preset] = {"straight": straight, "resumed": resumed, "stage": stage,
                   "zero": trainer.strategy.config["zero_optimization"],
                   "force_ds_cpu_optimizer": trainer.strategy.config.get("zero_force_ds_cpu_optimizer"),
                   "engine": type(trainer.strategy.model).__name__,
                   "ds_accelerator": os.environ.get("DS_ACCELERATOR"), "rank": trainer.global_rank}
# deepspeed_auto end to end: Net has 676 fp32 parameters; on CPU (4-byte params and grads, K = 12) zero1 needs
# 4 + 4 + 12/2 = 14 B/param (9464 B), zero2 4 + 16/2 = 12 B/param (8112 B): an 8500 B budget must pick zero2
from lightning_accel.strategies.deepspeed_presets import DeepSpeedAutoStrategy
trainer, losses = fit(DeepSpeedAutoStrategy(device_memory_bytes=8500 / 0.8), N)
out["auto"] = {"preset": trainer.strategy.preset, "stage": trainer.strategy.config["zero_optimization"]["stage"],
               "fits": [(c["preset"], c["fits"]) for c in trainer.strategy.decision["candidates"]],
               "steps": len(losses)}
with open(f"ds_rank{trainer.global_rank}.json", "w") as f:
    json.dump(out, f)
"""

# every preset DeepSpeed runs on CPU (NVMe offload needs libaio's async_io op: see the refusal test below)
CPU_PRESETS = [
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero2_offload",
    "deepspeed_zero3",
    "deepspeed_zero3_offload",
]


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.slow
def test_cpu_presets_train_and_resume_with_matching_loss(ddp_script, tmp_path):
    # a fresh port rather than one left behind by another process (see tests/strategies/conftest.py)
    ddp_script(SCRIPT, args=[",".join(CPU_PRESETS)], timeout=600, env={"MASTER_PORT": str(find_free_network_port())})
    for out in read_rank_json(tmp_path, "ds"):
        for preset in CPU_PRESETS:
            run = out[preset]
            assert run["stage"] == int(preset.split("zero")[1][0]) and run["engine"] == "DeepSpeedEngine"
            if preset.endswith("offload"):  # offloaded, stepping the module's torch AdamW on the CPU
                assert run["zero"]["offload_optimizer"]["device"] == "cpu" and run["force_ds_cpu_optimizer"] is False
            assert run["ds_accelerator"] == "cpu"  # set by the strategy (the test did not)
            straight, resumed = run["straight"], run["resumed"]
            assert sorted(resumed) == [str(s) for s in range(4, 7)], resumed  # resumed after step 3
            for step, loss in resumed.items():
                assert loss == pytest.approx(straight[step], rel=1e-5, abs=1e-7), (preset, step, straight, resumed)
            # training did something: the loss fell over the run
            assert straight["6"] < straight["1"]
        assert out["auto"] == {"preset": "zero2", "stage": 2, "fits": [["zero1", False], ["zero2", True]], "steps": 3}


def test_preset_configs_follow_deepspeed_docs_and_merge_overrides():
    cfg = preset_config("zero2")
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 500_000_000
    assert "offload_optimizer" not in zero
    assert preset_config("zero2_offload")["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    z3 = preset_config("zero3_offload")["zero_optimization"]
    assert z3["offload_param"]["device"] == z3["offload_optimizer"]["device"] == "cpu"
    merged = preset_config(
        "zero3",
        {
            "zero_optimization": {"reduce_bucket_size": 1e7, "offload_optimizer": {"device": "cpu"}},
            "gradient_clipping": 1.0,
        },
    )
    assert merged["zero_optimization"]["reduce_bucket_size"] == 1e7
    assert merged["zero_optimization"]["overlap_comm"] is True  # untouched preset keys stay
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert merged["gradient_clipping"] == 1.0
    assert PRESETS["zero3"][3]["reduce_bucket_size"] == 500_000_000  # the preset table was not mutated
    nvme = preset_config("zero3_offload_nvme", nvme_path="/mnt/nvme")["zero_optimization"]
    assert nvme["offload_param"]["nvme_path"] == nvme["offload_optimizer"]["nvme_path"] == "/mnt/nvme"


@pytest.mark.deepspeed
def test_unknown_override_keys_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"zero_optimization\.'reduce_bucket'.*reduce_bucket_size"):
        preset_config("zero2", {"zero_optimization": {"reduce_bucket": 1}})
    with pytest.raises(ValueError, match=r"'zero_optimisation'.*zero_optimization"):
        preset_config("zero2", {"zero_optimisation": {}})
    with pytest.raises(ValueError, match="unknown DeepSpeed preset 'zero4'"):
        preset_config("zero4")


@pytest.mark.deepspeed
def test_strategy_bad_input(tmp_path, monkeypatch):
    from lightning_accel.strategies.deepspeed_presets import deepspeed_zero2, deepspeed_zero3_offload_nvme

    with pytest.raises(ValueError, match="overrides"):
        deepspeed_zero2(stage=3)
    with pytest.raises(ValueError, match="needs nvme_path"):
        deepspeed_zero3_offload_nvme()
    with pytest.raises(ValueError, match="does not exist"):
        deepspeed_zero3_offload_nvme(nvme_path=str(tmp_path / "missing"))
    from lightning_accel.strategies import deepspeed_presets

    real_access = os.access
    monkeypatch.setattr(
        deepspeed_presets.os,
        "access",
        lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode),
    )
    with pytest.raises(ValueError, match="not writable"):
        deepspeed_zero3_offload_nvme(nvme_path=str(tmp_path))


@pytest.mark.deepspeed
def test_nvme_preset_without_async_io_refuses_before_training(tmp_path, monkeypatch):
    import lightning.pytorch as pl
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)  # no libaio

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, i):
            raise AssertionError("training must not start")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.setenv("LIGHTNING_ACCEL_NVME_PATH", str(tmp_path))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="deepspeed_zero3_offload_nvme",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="async_io.*libaio.*deepspeed_zero3_offload"):
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2))


def test_every_registry_string_constructs_a_trainer(tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from lightning_accel._imports import is_available
    from lightning_accel.strategies.registration import STRATEGIES

    monkeypatch.setenv("LIGHTNING_ACCEL_NVME_PATH", str(tmp_path))
    for name, (module, _, _) in STRATEGIES.items():
        if module.endswith("deepspeed_presets") and not is_available("deepspeed"):
            with pytest.raises(ImportError, match="pip install"):
                pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
            continue
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert type(trainer.strategy).__module__ == module, name


def test_deepspeed_missing_raises_import_error_with_pip_line(monkeypatch):
    import sys

    from lightning_accel.strategies import deepspeed_presets

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    with pytest.raises(ImportError, match=r"deepspeed_zero2.*pip install 'lightning-accel\[deepspeed\]'"):
        deepspeed_presets.deepspeed_zero2()


GB = 1e9


def test_auto_picks_the_lowest_stage_that_fits_mocked_capacities():
    # 1 B parameters, 8 devices, mixed-precision Adam (K=12): per-device needs, from the ZeRO formulas:
    #   zero1 4 + 1.5 = 5.5 GB, zero2 2 + 1.75 = 3.75 GB, zero2_offload 2 GB, zero3 2 GB, zero3_offload 0 GB
    psi, nd = 1_000_000_000, 8
    assert estimate_zero_memory(psi, nd, 1).device_total == pytest.approx(5.5 * GB)
    cases = [
        (80 * GB, "zero1"),
        (5.5 / 0.8 * GB, "zero1"),
        (5.4 / 0.8 * GB, "zero2"),
        (3.7 / 0.8 * GB, "zero2_offload"),
        (1.9 / 0.8 * GB, "zero3_offload"),
    ]
    for capacity, expected in cases:
        chosen, report = choose_zero_preset(psi, nd, capacity, margin=0.2)
        assert chosen == expected, (capacity, chosen)
        assert [fits for _, _, fits in report] == [False] * (len(report) - 1) + [True]
    # host RAM too small for the offloaded shard (1.75 GB per rank) -> offload presets don't fit either
    chosen, _ = choose_zero_preset(psi, nd, 3.7 / 0.8 * GB, margin=0.2, host_capacity_bytes=2 * GB)
    assert chosen == "zero3"
    # on CPU, offload presets are not candidates and device + host bytes count together
    chosen, report = choose_zero_preset(psi, nd, 3.7 / 0.8 * GB, margin=0.2, on_cpu=True)
    assert chosen == "zero3" and [p for p, _, _ in report] == ["zero1", "zero2", "zero3"]


def test_auto_errors_clearly_when_nothing_fits():
    with pytest.raises(ValueError, match=r"no ZeRO preset fits 1,000,000,000,000 parameters.*nvme_path"):
        choose_zero_preset(10**12, 8, 1 * GB, margin=0.2, host_capacity_bytes=1 * GB)
    chosen, _ = choose_zero_preset(10**12, 8, 1 * GB, margin=0.2, host_capacity_bytes=1 * GB, nvme=True)
    assert chosen == "zero3_offload_nvme"
    with pytest.raises(ValueError, match="margin"):
        choose_zero_preset(10, 1, 1 * GB, margin=1.5)


@pytest.mark.deepspeed
def test_auto_strategy_decides_from_the_model_and_precision(monkeypatch):
    import lightning.pytorch as pl
    import torch

    from lightning_accel.strategies.deepspeed_presets import DeepSpeedAutoStrategy

    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 1000))
    model[1].weight = model[0].weight  # tied: counted once
    psi = 1000 * 1000 + 2 * 1000
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, logger=False, strategy=DeepSpeedAutoStrategy(device_memory_bytes=1e9)
    )
    strategy = trainer.strategy
    assert strategy._on_cpu
    # fp32 (32-true): 4-byte params and grads, K = 12 -> zero1 needs 4 psi + 4 psi + 12 psi / 2 = 14 psi
    decision = strategy.decide(model)
    assert decision["num_params"] == psi and decision["preset"] == "zero1"
    assert decision["candidates"][0]["device_total"] == pytest.approx(14 * psi)
    strategy._auto["device_memory_bytes"] = 14 * psi / 0.8 * 0.99  # just too small for zero1
    assert strategy.decide(model)["preset"] == "zero2"  # 4 psi + 16 psi / 2 = 12 psi
    strategy._auto["device_memory_bytes"] = 10.5 * psi / 0.8
    assert strategy.decide(model)["preset"] == "zero3"  # 20 psi / 2 = 10 psi
    strategy._auto["device_memory_bytes"] = 9 * psi / 0.8
    with pytest.raises(ValueError, match="no ZeRO preset fits"):
        strategy.decide(model)
    # mixed precision: 2-byte params and grads, K = 12 -> zero1 needs 2 psi + 2 psi + 12 psi / 2 = 10 psi
    half = pl.Trainer(
        accelerator="cpu",
        devices=2,
        logger=False,
        precision="bf16-mixed",
        strategy=DeepSpeedAutoStrategy(device_memory_bytes=10 * psi / 0.8),
    )
    decision = half.strategy.decide(model)
    assert decision["preset"] == "zero1" and decision["candidates"][0]["device_total"] == pytest.approx(10 * psi)
