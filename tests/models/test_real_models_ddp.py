"""2-process Lightning DDP on CPU (gloo) with the real models: a compression strategy and DeepSpeed ZeRO-2.

One script per strategy trains every available family in turn (one process launch, several fits), so the cost of
starting two interpreters and a process group is paid once.
"""

from __future__ import annotations

import math

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.conftest import read_rank_json
from tests.models.zoo import FAMILIES, skip_reason

SCRIPT = r"""
import json, sys, warnings
import torch
import lightning.pytorch as pl
import lightning_accel  # registers the strategy strings
from tests.models.zoo import FAMILIES, Task

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
strategy, names = sys.argv[1], sys.argv[2].split(",")
class Engine(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.name = type(trainer.strategy.model).__name__  # the wrapper while training (unwrapped at teardown)


out = {}
for name in names:
    pl.seed_everything(0, verbose=False)
    task = Task(name, batch_size=2, samples=16)
    engine = Engine()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[engine])
    trainer.fit(task)
    params = torch.cat([p.detach().float().flatten() for p in task.model.parameters()])
    stats = getattr(trainer.strategy, "comm_stats", None)
    out[name] = {"losses": task.losses, "checksum": float(params.double().sum()), "norm": float(params.norm()),
                 "engine": engine.name,
                 "ratio": stats.compression_rate if stats is not None else None}
with open(f"models_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""

AVAILABLE = [name for name, fam in FAMILIES.items() if skip_reason(fam) is None]


def run(ddp_script, tmp_path, strategy: str, engine: str) -> list[tuple[dict, dict]]:
    """Train every family under ``strategy``; per family, both ranks' results after the common checks."""
    if not AVAILABLE:
        pytest.skip("no model family available (transformers / litgpt missing)")
    ddp_script(
        SCRIPT, args=[strategy, ",".join(AVAILABLE)], timeout=480, env={"MASTER_PORT": str(find_free_network_port())}
    )
    rank0, rank1 = read_rank_json(tmp_path, "models")
    pairs = []
    for name in AVAILABLE:
        a, b = rank0[name], rank1[name]
        assert a["engine"] == engine and len(a["losses"]) == len(b["losses"]) == 3, name
        assert all(math.isfinite(x) for x in a["losses"] + b["losses"]), name
        assert a["losses"] != b["losses"], name  # each rank trained on its own shard (DistributedSampler)
        pairs.append((a, b))
    return pairs


@pytest.mark.distributed
def test_ddp_bf16_compress_trains_every_family_in_sync(ddp_script, tmp_path):
    for a, b in run(ddp_script, tmp_path, "ddp_bf16_compress", "DistributedDataParallel"):
        assert a["ratio"] == pytest.approx(2.0, rel=0.01)  # fp32 gradients all-reduced in bf16
        # every rank applied the same averaged gradients: identical weights after 3 steps
        assert a["checksum"] == b["checksum"] and a["norm"] == b["norm"]


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_zero2_trains_every_family_in_sync(ddp_script, tmp_path):
    for a, b in run(ddp_script, tmp_path, "deepspeed_zero2", "DeepSpeedEngine"):
        # sharded optimizer states and gradients, parameters all-gathered after each step: the same on both ranks
        assert a["checksum"] == pytest.approx(b["checksum"], rel=1e-6)
