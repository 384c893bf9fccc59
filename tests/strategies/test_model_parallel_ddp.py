"""2 CPU processes (gloo): ``tp`` and ``fsdp2`` train a tiny Hugging Face Llama and a litgpt GPT with the automatic
plan (no ``configure_model``), matching a single-process run; MFUMonitor counts FLOPs per device; a distributed
checkpoint resumes to the same losses."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import read_rank_json

SCRIPT = r"""
import json, sys
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_accel  # registers the strategy strings
from lightning_accel.callbacks.mfu_monitor import MFUMonitor
from lightning_accel.core.flops import FlopCounter

torch.set_num_threads(1)
KINDS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["hf"]  # "hf" (transformers), "litgpt"
STEPS, BATCH, SEQ = 4, 4, 16
IDS = torch.randint(0, 128, (64, SEQ), generator=torch.Generator().manual_seed(1))


def build(kind):
    torch.manual_seed(0)
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64))
    from litgpt import GPT, Config
    return GPT(Config(n_layer=2, n_head=4, n_query_groups=2, n_embd=64, block_size=SEQ, vocab_size=128,
                      padded_vocab_size=128, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=128,
                      norm_class_name="RMSNorm"))


def loss_of(kind, model, ids):
    if kind == "hf":
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


class Task(pl.LightningModule):  # no configure_model: the strategy plans
    def __init__(self, kind, batch):
        super().__init__()
        self.kind, self.batch = kind, batch
        self.model = build(kind)

    def training_step(self, batch, i):
        loss = loss_of(self.kind, self.model, batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def on_fit_start(self):
        self.losses = []

    def train_dataloader(self):
        # in order (Lightning's own sampler shuffles), split over the data-parallel ranks of the mesh
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(TensorDataset(IDS), shuffle=False, **kwargs)
        return DataLoader(TensorDataset(IDS), batch_size=self.batch, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def reference(kind, batch, steps, order=None):
    # the same model, data order and optimizer in one process, without Lightning
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, flops = [], None
    counter = FlopCounter()
    for i in range(steps):
        if i == 0:
            counter.start()
        j = i if order is None else order[i]
        loss = loss_of(kind, model, IDS[j * batch:(j + 1) * batch])
        loss.backward()
        if i == 0:
            flops = counter.stop()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, flops


def trainer(strategy, steps, callbacks=()):
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=list(callbacks))


out = {}
# tensor parallelism: both ranks see the same batch of 4; per-device FLOPs = total / 2
for kind in KINDS:
    monitor = MFUMonitor(window=2, warmup_batches=1, peak_flops=1e12, print_summary=False)
    t = trainer("tp", STEPS, [monitor])
    task = Task(kind, BATCH)
    t.fit(task)
    ref, total = reference(kind, BATCH, STEPS)
    out[f"tp_{kind}"] = {"losses": task.losses, "ref": ref, "flops": monitor.summary.get("flops_per_batch"),
                         "total_flops": total, "plan": t.strategy.plan.describe(),
                         "replicas": monitor._windows.batch_replicas,
                         "sharded": sorted(n for n, p in task.named_parameters() if type(p).__name__ == "DTensor"
                                           or type(getattr(p, "data", None)).__name__ == "DTensor")}
    if kind == "hf":
        # checkpoint round-trip: save after STEPS, resume in a new Trainer for 2 more steps
        t.save_checkpoint("tp_ckpt")
        resumed = Task(kind, BATCH)
        trainer("tp", STEPS + 2).fit(resumed, ckpt_path="tp_ckpt")
        # the loader is not resumable mid-epoch: Lightning restarts it, so the resumed steps see batches 0 and 1
        out["resume"] = {"losses": resumed.losses,
                         "ref": reference(kind, BATCH, STEPS + 2, order=[0, 1, 2, 3, 0, 1])[0][STEPS:]}

# FSDP2: each rank trains on its half of a batch of 8 (DistributedSampler), the reference on all 8
for kind in KINDS:
    t = trainer("fsdp2", STEPS)
    task = Task(kind, BATCH)
    t.fit(task)
    out[f"fsdp2_{kind}"] = {"losses": task.losses, "ref": reference(kind, 2 * BATCH, STEPS)[0],
                            "plan": t.strategy.plan.describe()}
# a configure_model that only builds the model (litgpt-style lazy init) gets the automatic plan too
class LazyTask(Task):
    def __init__(self, kind, batch):
        pl.LightningModule.__init__(self)
        self.kind, self.batch = kind, batch

    def configure_model(self):
        if not hasattr(self, "model"):
            self.model = build(self.kind)


t = trainer("fsdp2", STEPS)
task = LazyTask(KINDS[0], BATCH)
t.fit(task)
out["lazy"] = {"losses": task.losses, "ref": out[f"fsdp2_{KINDS[0]}"]["ref"], "plan": t.strategy.plan is not None}
with open(f"mp_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""

# the model libraries are optional: transformers (pip install transformers), litgpt (pip install --no-deps litgpt:
# its pins conflict with transformers 5)
KINDS = [kind for kind, module in (("hf", "transformers"), ("litgpt", "litgpt")) if importlib.util.find_spec(module)]


@pytest.mark.distributed
def test_tp_and_fsdp2_train_without_configure_model_like_one_process(ddp_script, tmp_path):
    if not KINDS:
        pytest.skip("needs transformers or litgpt: pip install transformers; pip install --no-deps litgpt")
    ddp_script(SCRIPT, timeout=400, args=[",".join(KINDS)])
    rank0, rank1 = read_rank_json(tmp_path, "mp")
    for kind in KINDS:
        r0, r1 = rank0[f"tp_{kind}"], rank1[f"tp_{kind}"]
        # TP ranks compute the same loss, and it is the single-process loss (up to summation order)
        assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
        assert r0["losses"] == pytest.approx(r0["ref"], rel=2e-4, abs=1e-5)
        assert r0["replicas"] == 2  # TP ranks share a batch: MFUMonitor counts it once
        assert "tensor parallel (size 2)" in r0["plan"]
    if "hf" in KINDS:
        hf = rank0["tp_hf"]
        # MFUMonitor: every matmul of the HF plan is sharded (lm_head too), so FLOPs per device = total / TP size
        assert hf["flops"] == pytest.approx(hf["total_flops"] / 2, rel=1e-6)
        assert "q_proj" in hf["plan"] and "colwise" in hf["plan"]
        assert any("q_proj" in n for n in hf["sharded"])
        # checkpoint round-trip: the resumed steps continue the single-process run (momentum restored too)
        assert rank0["resume"]["losses"] == pytest.approx(rank0["resume"]["ref"], rel=2e-4, abs=1e-5)
        assert "FSDP2 fully_shard: model.model.layers.* (x2), model" in rank0["fsdp2_hf"]["plan"]
    if "litgpt" in KINDS:
        lg = rank0["tp_litgpt"]
        # litgpt's lm_head stays replicated: per device = total / 2 + half the head (2·b·t·d·V fwd, ×3 with bwd)
        head = 3 * 2 * 4 * 16 * 64 * 128
        assert lg["flops"] == pytest.approx((lg["total_flops"] - head) / 2 + head, rel=1e-6)
        assert "fused_qkv_colwise" in lg["plan"] and any("attn.qkv" in n for n in lg["sharded"])
        assert "FSDP2 fully_shard: model.transformer.h.* (x2), model" in rank0["fsdp2_litgpt"]["plan"]
    # the lazily built model was planned and trains like the eager one
    assert rank0["lazy"]["plan"] is True
    lazy = [(a + b) / 2 for a, b in zip(rank0["lazy"]["losses"], rank1["lazy"]["losses"])]
    assert lazy == pytest.approx(rank0["lazy"]["ref"], rel=2e-4, abs=1e-5)
    # FSDP2: the mean of the two ranks' losses is the single-process loss on the whole batch
    for kind in KINDS:
        r0, r1 = rank0[f"fsdp2_{kind}"], rank1[f"fsdp2_{kind}"]
        mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
        assert mean == pytest.approx(r0["ref"], rel=2e-4, abs=1e-5)
        assert r0["losses"] != r1["losses"]  # the ranks did train on different halves


# 4 processes: TP 2 inside each of 2 FSDP2 replicas (the 2-D mesh the automatic plan composes)
SCRIPT_2D = (
    SCRIPT.split("out = {}")[0].replace("devices=2, strategy=strategy", "devices=4, strategy=strategy")
    + r"""
from lightning_accel.strategies.model_parallel import AutoParallelStrategy

t = trainer(AutoParallelStrategy(mode="fsdp2_tp", tensor_parallel_size=2), STEPS)
task = Task("hf", BATCH)
t.fit(task)
out = {"losses": task.losses, "ref": reference("hf", 2 * BATCH, STEPS)[0], "plan": t.strategy.plan.describe(),
       "mesh": list(t.strategy.device_mesh.shape)}
with open(f"mp2d_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""
)


@pytest.mark.distributed
def test_fsdp2_tp_on_a_two_by_two_mesh_matches_one_process(ddp_script, tmp_path):
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    ddp_script(SCRIPT_2D, timeout=400, args=["hf"])
    ranks = read_rank_json(tmp_path, "mp2d", world_size=4)
    assert ranks[0]["mesh"] == [2, 2]
    # ranks 0-1 and 2-3 are TP groups: same batch, same loss; the two data-parallel halves differ
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"], rel=1e-6)
    assert ranks[2]["losses"] == pytest.approx(ranks[3]["losses"], rel=1e-6)
    assert ranks[0]["losses"] != ranks[2]["losses"]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
    assert mean == pytest.approx(ranks[0]["ref"], rel=2e-4, abs=1e-5)
    assert "tensor parallel (size 2)" in ranks[0]["plan"] and "FSDP2 fully_shard" in ranks[0]["plan"]
