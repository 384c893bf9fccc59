"""AutoMixedPrecision + NonFiniteGuard + TorchCompile + ActivationCheckpointing together under 2-process DDP."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import read_rank_json

SCRIPT = """
import json
import lightning.pytorch as pl
import torch
from torch import nn
from lightning_accel import ActivationCheckpointing, AutoMixedPrecision, NonFiniteGuard, TorchCompile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        self.ln_dtype = self.ln(x).dtype
        return x + torch.tanh(self.fc(self.ln(x)))


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(Block(), Block(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = self.model(x)
        self.out_dtype = out.dtype
        loss = (out.float() - x[:, :1]).pow(2).mean()
        if self.global_step == 2 and self.global_rank == 1:
            loss = loss * float("nan")  # one rank only: the verdict must be shared
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g)),
                                           batch_size=8)


class Spy(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, i):
        if trainer.global_step == 2:
            self.before = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
        if trainer.global_step == 3:
            self.after = {k: v.clone() for k, v in pl_module.state_dict().items()}


if __name__ == "__main__":
    plugin = AutoMixedPrecision(dtype="fp16", init_scale=2.0**8, fp32_modules=[nn.LayerNorm])
    guard, compiler, ckpt, spy = (NonFiniteGuard(max_consecutive=3), TorchCompile(backend="aot_eager"),
                                  ActivationCheckpointing(modules=[Block]), Spy())
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], max_steps=5,
                         callbacks=[guard, compiler, ckpt, spy], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    task = Task()
    trainer.fit(task)
    trainer.save_checkpoint("together.ckpt")
    keys = list(torch.load("together.ckpt", weights_only=False)["state_dict"]) if trainer.is_global_zero else []
    weights = torch.cat([p.detach().flatten() for p in task.parameters()])
    result = {
        "skipped": plugin.skipped_steps, "total": plugin.total_steps, "scale": plugin.loss_scale,
        "bad": guard.bad_steps, "guard_skipped": guard.skipped_steps,
        "untouched": all(torch.equal(spy.before[k], spy.after[k]) for k in spy.before),
        "compiled": compiler.compiled_names, "fallback": compiler.fallback_reason, "wrapped": ckpt.wrapped_names,
        "ln_dtype": str(task.model[0].ln_dtype), "out_dtype": str(task.out_dtype),
        "weights": weights.tolist(), "finite": bool(torch.isfinite(weights).all()), "keys": keys,
    }
    with open(f"together_rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)
"""


@pytest.mark.distributed
def test_all_four_together_under_two_process_ddp(ddp_script: Any, tmp_path: Any) -> None:
    ddp_script(SCRIPT, timeout=240)
    ranks = read_rank_json(tmp_path, "together")
    for r in ranks:
        assert r["fallback"] is None and r["compiled"] == ["model"]
        assert r["wrapped"] == ["model.0", "model.1"]
        assert r["total"] == 5 and r["skipped"] == 1 and r["scale"] == 2.0**7  # the nan step, skipped on both
        assert r["bad"] == 1 and r["guard_skipped"] == 0  # the scaler skipped it; the guard counted it
        assert r["untouched"]  # weights bit-identical across the bad step
        assert r["ln_dtype"] == "torch.float32" and r["out_dtype"] == "torch.float16"  # island / autocast
        assert r["finite"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas identical
    assert ranks[0]["keys"] == [
        "model.0.ln.weight",
        "model.0.ln.bias",
        "model.0.fc.weight",
        "model.0.fc.bias",
        "model.1.ln.weight",
        "model.1.ln.bias",
        "model.1.fc.weight",
        "model.1.fc.bias",
        "model.2.weight",
        "model.2.bias",
    ]
