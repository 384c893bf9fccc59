"""2-process Lightning DDP on CPU (gloo): every rank runs the same trials in lockstep, the decisions come from the
measurements aggregated over ranks, and both ranks apply the identical configuration."""

import pytest

from tests.conftest import read_rank_json

SCRIPT = """
import json, os, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from lightning_accel.callbacks.autopilot import Autopilot

torch.set_num_threads(1)


class Data(Dataset):
    # slow reads on both ranks, slower on rank 1 (the ranks measure different rates; the decision must not differ)
    def __len__(self):
        return 512

    def __getitem__(self, i):
        time.sleep(0.003 if int(os.environ.get("LOCAL_RANK", "0")) == 0 else 0.004)
        return torch.randn(16, generator=torch.Generator().manual_seed(i))


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(16, 16)

    def training_step(self, x, i):
        time.sleep(0.012)  # device-like compute that one loader worker can overlap (1 core per rank here)
        return (self.net(x) - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


autopilot = Autopilot(warmup_steps=2, measure_steps=6, budget_seconds=120, freeze=["compile"], save_plan="plan.json",
                      print_summary=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[autopilot])
model = Model()
trainer.fit(model, DataLoader(Data(), batch_size=4, shuffle=True))
out = {"kept": [[c.name, c.params] for c in autopilot.kept],
       "records": [[r.name, r.kept, r.samples_per_sec] for r in autopilot.records],
       "workers": trainer.train_dataloader.num_workers,
       "weight": model.net.weight.detach().flatten().tolist()}
with open(f"autopilot_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
def test_ddp_ranks_take_identical_decisions(ddp_script, tmp_path):
    ddp_script(SCRIPT, timeout=300)
    rank0, rank1 = read_rank_json(tmp_path, "autopilot")
    assert rank0["kept"] == rank1["kept"] and rank0["kept"][0][0] == "dataloader"
    assert rank0["records"] == rank1["records"]  # the same trials, with the same aggregated rates
    assert rank0["workers"] == rank1["workers"] >= 1
    assert rank0["weight"] == rank1["weight"]  # DDP trained in step after the search
    assert (tmp_path / "plan.json").exists()


COMPRESSION = """
import json, os
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from lightning_accel.callbacks.autopilot.fixes import compression  # the module whose names Compression calls
from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.core.scaling import Interconnect

torch.set_num_threads(1)
switches, links = [], []
real_init, real_link = compression.SwitchableCompression.__init__, compression.measure_link


def init(self):
    real_init(self)
    switches.append(self)


def measure_link(run):
    links.append(real_link(run))  # the real measurement runs (both ranks, lockstep) ...
    # ... a 10 MB/s link may stand in for it, so the projection's choice is known (Top-K at 2 ranks)
    return Interconnect("slow", 1e7, 1e-4) if LINK == "slow" else links[-1]


compression.SwitchableCompression.__init__ = init
compression.measure_link = measure_link
LINK = os.environ.get("COMPRESSION_LINK")
if LINK == "qsgd":  # the projection does not rank QSGD first at 1 % Top-K density: the test chooses it
    compression.choose_compression = lambda **kwargs: ("qsgd", "chosen by the test")
if LINK == "reverted":  # bf16 kept by its trial, then measured slower by the final A/B, on both ranks alike
    from lightning_accel.core.autopilot import claim, pairing

    compression.choose_compression = lambda **kwargs: ("bf16", "chosen by the test")
    pairing.decide_paired = lambda ratios, gate, floor=0.0: (True, "kept by the test")
    claim.claimed_speedup = lambda ratios: (0.8, 0.7, 0.9)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])

    def training_step(self, batch, i):
        (x,) = batch
        return (self.net(x) - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


autopilot = Autopilot(warmup_steps=2, measure_steps=6, budget_seconds=120, only=["compression"], print_summary=False,
                      save_plan=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[autopilot])
model = Model()
g = torch.Generator().manual_seed(0)
trainer.fit(model, DataLoader(TensorDataset(torch.randn(256, 512, generator=g)), batch_size=8))
rows = [r for r in autopilot.records if r.name == "compression"]
switch = switches[0]
out = {"rows": [[r.change, r.kept, r.reason, r.numerics] for r in rows], "yaml": autopilot.yaml,
       "final": [[r.kept, r.reason] for r in autopilot.records if r.name == "final A/B"],
       "kept": [fix.name for fix in autopilot.kept],
       "mode": switch.mode, "residuals": {m: len(r) for m, r in switch.residuals().items()},
       "link": [links[0].bandwidth, links[0].latency],
       "weight": model.net[0].weight.detach().flatten()[:64].tolist()}
with open(f"compression_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("link", ["measured", "slow", "qsgd", "reverted"])
def test_ddp_compression_is_trialled_with_its_numerics_through_the_all_reduce(ddp_script, tmp_path, link):
    from lightning_accel.callbacks.autopilot.fixes import COMPRESSION_STRATEGIES

    ddp_script(COMPRESSION, timeout=300, env={"COMPRESSION_LINK": link})
    rank0, rank1 = read_rank_json(tmp_path, "compression")
    print(link, {k: v for k, v in rank0.items() if k != "weight"})  # what the Autopilot did (-s shows it)
    for key in ("rows", "mode", "residuals", "yaml"):
        assert rank0[key] == rank1[key], key  # the ranks measured one link and chose alike
    modes = [
        next(m for m, name in COMPRESSION_STRATEGIES.items() if f"strategy='{name}'" in change)
        for change, _, _, _ in rank0["rows"]
    ]
    if link == "slow":  # 10 MB/s: Top-K's all-gather of 1 % beats bf16's all-reduce at 2 ranks
        assert modes[0] == "topk" and "slow" in rank0["rows"][0][0], rank0["rows"]
    if link == "qsgd":
        assert modes[0] == "qsgd", rank0["rows"]
    if link == "reverted":
        assert modes == ["bf16"] and rank0["rows"][0][1], rank0["rows"]
        assert [kept for kept, _ in rank0["final"]] == [False] and "reverted" in rank0["final"][0][1], rank0["final"]
    for mode, (_, kept, _, numerics) in zip(modes, rank0["rows"]):
        assert numerics["kind"] == "low_precision", rank0
        if mode == "bf16":  # bf16 all-reduce: close to, but not exactly, the fp32 gradients
            assert numerics["ok"] and (0.99 < numerics["grad_cosine"] < 1.0 or numerics["loss_rel_diff"] > 0)
        else:  # the sparse / quantised gradient differs from the dense one: the hook ran
            assert numerics["grad_cosine"] < 0.999, rank0
    # a projected Top-K / QSGD that is not kept falls back to bf16, trialled next; bf16 has no fall-back
    assert modes in (["bf16"], ["topk"], ["qsgd"], ["topk", "bf16"], ["qsgd", "bf16"]), modes
    assert len(modes) == 1 or not rank0["rows"][0][1]
    kept = [mode for mode, row in zip(modes, rank0["rows"]) if row[1]]
    # the claim's final A/B (kept set against untouched, fresh pairs) reverts a kept set that it measures slower
    # beyond the noise: a marginal gain on the loopback link can end there, and then nothing is kept
    if any(not final_kept and "reverted" in reason for final_kept, reason in rank0["final"]):
        assert kept, rank0["final"]  # only a kept set is reverted
        kept = []
    assert rank0["kept"] == (["compression"] if kept else []), (rank0["kept"], rank0["final"])
    for mode in COMPRESSION_STRATEGIES:
        assert (COMPRESSION_STRATEGIES[mode] in rank0["yaml"]) == (mode in kept), (mode, rank0["yaml"])
    # kept: the switch stays on the kept hook; not kept: back to the plain all-reduce, no residual left
    assert rank0["mode"] == (kept[0] if kept else "allreduce")
    assert "topk" in kept or not rank0["residuals"].get("topk")
    assert rank0["weight"] == rank1["weight"]


PRECISION = """
import json
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from lightning_accel.callbacks.autopilot import backend as _autopilot_backend
from lightning_accel.callbacks.autopilot import Autopilot
from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

torch.set_num_threads(1)
real = _autopilot_backend.LightningSearchBackend.measure


def measure(self, warmup_steps, steps):  # scripted: mixed precision measures 2x (the decision is exact)
    window = real(self, warmup_steps, steps)
    scale = window.samples / (100.0 * (2.0 if isinstance(self.run.trainer.precision_plugin,
                                                          AutoMixedPrecision) else 1.0)) / window.seconds
    window.seconds *= scale  # the stage split keeps its proportions
    window.stage_seconds = {k: v * scale for k, v in window.stage_seconds.items()}
    return window


_autopilot_backend.LightningSearchBackend.measure = measure


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # compute-heavy (forward + backward hold the step), so the diagnosis offers mixed precision
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))

    def training_step(self, batch, i):
        (x,) = batch
        out = self.net(x)
        self.dtypes.append(str(out.dtype))
        return (out.float() - x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


autopilot = Autopilot(warmup_steps=1, measure_steps=3, budget_seconds=120, only=["precision"], print_summary=False,
                      save_plan=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[autopilot])
model = Model()
model.dtypes = []
g = torch.Generator().manual_seed(0)
trainer.fit(model, DataLoader(TensorDataset(torch.randn(512, 256, generator=g)), batch_size=32))
rows = [r for r in autopilot.records if r.name == "precision"]
assert rows, (autopilot.plan.stopped, autopilot.notes, [(r.name, r.reason) for r in autopilot.records])
row = rows[0]
plugin = trainer.precision_plugin
out = {"kept": row.kept, "reason": row.reason, "plugin": type(plugin).__name__,
       "precision": getattr(plugin, "precision", None), "yaml": autopilot.yaml, "last_dtype": model.dtypes[-1],
       "weight": model.net[0].weight.detach().flatten()[:64].tolist()}
with open(f"precision_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
def test_ddp_installs_mixed_precision_from_the_default_on_every_rank(ddp_script, tmp_path):
    ddp_script(PRECISION, timeout=300)
    rank0, rank1 = read_rank_json(tmp_path, "precision")
    assert rank0["kept"] and rank1["kept"], rank0
    assert rank0["plugin"] == rank1["plugin"] == "AutoMixedPrecision"
    assert rank0["precision"] == rank1["precision"] == "bf16-mixed"
    assert rank0["last_dtype"] == rank1["last_dtype"] == "torch.bfloat16"  # the training ran under bf16 autocast
    assert "lightning_accel.AutoMixedPrecision" in rank0["yaml"]
    assert rank0["weight"] == rank1["weight"]  # DDP trained in step after the search


ASYNC_CHECKPOINT = """
import json, time
from pathlib import Path
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset
import lightning_accel.callbacks.autopilot.checkpoint_trial as trial
from lightning_accel.callbacks.autopilot import Autopilot

torch.set_num_threads(1)
trial.SLOW_DISK_BYTES_PER_S = 1e2  # the planted slow disk below is slower than the no-measurement bound assumes


class SlowDisk(TorchCheckpointIO):
    def save_checkpoint(self, *args, **kwargs):
        time.sleep(0.15)  # rank 0 writes; the other rank waits for it in save_checkpoint's barrier when synchronous
        super().save_checkpoint(*args, **kwargs)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, i):
        time.sleep(0.01)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
autopilot = Autopilot(only=["async_checkpoint"], measure_steps=10, budget_seconds=120, save_plan=False,
                      print_summary=False)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=200, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, plugins=[SlowDisk()],
                     callbacks=[autopilot, ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10, save_top_k=-1)])
model = Model()
trainer.fit(model, DataLoader(data, batch_size=4))
out = {"records": [[r.name, r.kept, r.reason.split(";")[0]] for r in autopilot.records],
       "io": type(trainer.strategy.checkpoint_io).__name__,
       "saved": sorted(p.name for p in Path("ckpt").iterdir()),
       "weight": model.net.weight.detach().flatten().tolist()}
with open(f"asyncckpt_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
def test_ddp_ranks_agree_on_the_background_checkpoint_writer(ddp_script, tmp_path):
    ddp_script(ASYNC_CHECKPOINT, timeout=300)
    rank0, rank1 = read_rank_json(tmp_path, "asyncckpt")
    assert rank0["records"] == rank1["records"]  # the slowest rank's period decided for both
    row = next(r for r in rank0["records"] if r[0] == "async_checkpoint")
    assert row[1], row
    assert rank0["io"] == rank1["io"] == "OrderedAsyncCheckpointIO"
    assert len(rank0["saved"]) == 20 and not [n for n in rank0["saved"] if "autopilot" in n]
    assert rank0["weight"] == rank1["weight"]
