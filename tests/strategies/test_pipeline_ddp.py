"""2 CPU processes (gloo): ``strategy="pp"`` trains the demo GPT, a Hugging Face Llama and GPT-2, and a litgpt GPT
without any pipeline code in the module, to the weights of a one-process run of the same global batch (GPipe and
1F1B, with and without accumulation); a checkpoint resumes identically and loads into the unsplit model; a loss the
strategy cannot reproduce, and a batch the micro-batches do not divide, are refused; a dead peer times out naming
the rank and stage. 4 processes: ``pp_ddp`` (2 stages x 2 replicas)."""

from __future__ import annotations

import importlib.util
import json
import math
from datetime import timedelta

import pytest

from tests.conftest import read_rank_json

COMMON = r"""
import json, os, sys
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_accel  # registers "pp"
from lightning_accel.strategies.pipeline import PipelineStrategy

torch.set_num_threads(1)
SEQ, BATCH, VOCAB = 16, 4, 64
IDS = torch.randint(0, VOCAB, (96, SEQ + 1), generator=torch.Generator().manual_seed(1))


def build(kind):
    torch.manual_seed(0)
    if kind == "demo":
        from lightning_accel.demo.model import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=4, n_head=2, d_model=32))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64))
    if kind == "gpt2":  # tied embeddings (GPT-2's default)
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    from litgpt import GPT, Config
    return GPT(Config(n_layer=4, n_head=4, n_query_groups=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB,
                      padded_vocab_size=VOCAB, bias=False, mlp_class_name="LLaMAMLP", intermediate_size=64,
                      norm_class_name="RMSNorm"))


def batch_of(kind, j, size):
    rows = IDS[j * size:(j + 1) * size]
    return (rows[:, :-1], rows[:, 1:]) if kind == "demo" else (rows[:, :-1],)


def loss_of(kind, model, batch):
    # each model as its users train it: (x, y) for the demo GPT, token ids alone for the LMs
    if kind == "demo":
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ids = batch[0]
    if kind in ("llama", "gpt2"):
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


class Task(pl.LightningModule):  # no pipeline code at all
    def __init__(self, kind, batch=BATCH):
        super().__init__()
        self.kind, self.batch = kind, batch
        self.model = build(kind)

    def training_step(self, batch, i):
        return loss_of(self.kind, self.model, batch)

    def train_dataloader(self):
        n = len(IDS) // self.batch * self.batch
        data = TensorDataset(IDS[:n, :-1], IDS[:n, 1:]) if self.kind == "demo" else TensorDataset(IDS[:n, :-1])
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(data, batch_size=self.batch, sampler=DistributedSampler(data, shuffle=False, **kwargs))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.losses.append(float(outputs["loss"]))


def reference(kind, steps, accumulate=1, size=BATCH, order=None):
    # the same model, data order and optimizer in one process, without Lightning
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        for a in range(accumulate):
            j = s * accumulate + a if order is None else order[s * accumulate + a]
            (loss_of(kind, model, batch_of(kind, j, size)) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return model


def max_dw(task, ref):
    # this rank's parameters (their original names) against the one-process model's
    want = dict(ref.named_parameters(remove_duplicate=False))
    return max((p.detach() - want[n[len("model."):]].detach()).abs().max().item()
               for n, p in task.named_parameters(remove_duplicate=False))


def trainer(strategy, steps, devices=2, accumulate=1, callbacks=(), **kw):
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, accumulate_grad_batches=accumulate, callbacks=list(callbacks),
                      **kw)
"""

SCRIPT = (
    COMMON
    + r"""
KINDS = sys.argv[1].split(",")
STEPS = 10
out = {}
# (kind, schedule, accumulate); "pp" with the strategy's defaults for the first one
RUNS = [("demo", None, 1), ("demo", "gpipe", 2), ("llama", "1f1b", 1), ("llama", "gpipe", 2), ("gpt2", "1f1b", 1),
        ("litgpt", "1f1b", 2), ("demo", "interleaved_1f1b", 1)]
for kind, schedule, accumulate in RUNS:
    if kind not in KINDS:
        continue
    stages = 4 if schedule == "interleaved_1f1b" else None  # 2 stages on each rank, looped
    strategy = "pp" if schedule is None else PipelineStrategy(schedule=schedule, microbatches=4, stages=stages)
    t = trainer(strategy, STEPS, accumulate=accumulate)
    task = Task(kind)
    t.fit(task)
    out[f"{kind}_{schedule}_{accumulate}"] = {"dw": max_dw(task, reference(kind, STEPS, accumulate)),
                                             "n": sum(p.numel() for p in task.parameters()),
                                             "plan": [list(r) for r in t.strategy.plan.blocks],
                                             "bubble": t.strategy.stats.bubble(),
                                             "expected": t.strategy.stats.expected_bubble}

# balance="time": rank 0 measures every block, both ranks get the same plan; any plan trains the same weights
t = trainer(PipelineStrategy(balance="time"), STEPS)
task = Task("demo")
t.fit(task)
out["timed"] = {"delta_w": max_dw(task, reference("demo", STEPS)), "plan": [list(r) for r in t.strategy.plan.blocks],
                "unit": t.strategy.plan.unit, "costs": list(t.strategy.plan.costs)}

# validation runs the pipeline's forward-only loss (val_loss), also as trainer.validate after fit
class WithValidation(Task):
    def validation_step(self, batch, i):  # as written for one device; the pipeline computes it instead
        self.log("val_loss", loss_of("demo", self.model, batch))

    def val_dataloader(self):
        return DataLoader(TensorDataset(IDS[:BATCH, :-1], IDS[:BATCH, 1:]), batch_size=BATCH)


t = trainer("pp", 3, limit_val_batches=1)
task = WithValidation("demo")
t.fit(task)
(metrics,) = t.validate(task, verbose=False)
ref3 = reference("demo", 3)
with torch.no_grad():
    out["val"] = {"got": metrics["val_loss"], "want": float(loss_of("demo", ref3, batch_of("demo", 0, BATCH)))}
try:
    trainer("pp", 1).fit(task)
    out["resplit"] = "no error"
except ValueError as err:
    out["resplit"] = str(err)

# checkpoint: save after 4 steps, resume for 3 more == 7 uninterrupted (the loader restarts: batches 0-2 again)
t = trainer("pp", 4)
task = Task("demo")
t.fit(task)
t.save_checkpoint("pp.ckpt")
resumed = Task("demo")
trainer("pp", 7).fit(resumed, ckpt_path="pp.ckpt")
out["resume_dw"] = max_dw(resumed, reference("demo", 7, order=[0, 1, 2, 3, 0, 1, 2]))
# consolidation: the file's state_dict loads, strict, into the unsplit LightningModule
plain = Task("demo")
plain.load_state_dict(torch.load("pp.ckpt", weights_only=False)["state_dict"])
ref4 = reference("demo", 4)
out["consolidated_dw"] = max((p - dict(ref4.named_parameters())[n[6:]]).abs().max().item()
                             for n, p in plain.named_parameters())


# a training_step whose loss is not the token cross-entropy (here: over the second half of each sequence only) is
# refused on the first batch, with both numbers
class SecondHalf(Task):
    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.model(x)[:, SEQ // 2:].flatten(0, 1), y[:, SEQ // 2:].flatten())


try:
    trainer("pp", 2).fit(SecondHalf("demo"))
    out["mismatch"] = "no error"
except ValueError as err:
    out["mismatch"] = str(err)


# ... and accepted once the hook says what the loss is
class SecondHalfHook(SecondHalf):
    def pipeline_loss(self, logits, targets):
        return F.cross_entropy(logits[:, SEQ // 2:].flatten(0, 1), targets[:, SEQ // 2:].flatten())


t = trainer("pp", 2)
t.fit(SecondHalfHook("demo"))
out["hook_ok"] = t.global_step

# a batch of 6 does not divide into 4 micro-batches
try:
    trainer(PipelineStrategy(microbatches=4), 2).fit(Task("demo", batch=6))
    out["divide"] = "no error"
except ValueError as err:
    out["divide"] = str(err)

# LBFGS re-evaluates the loss inside its step: refused before the first step
class WithLBFGS(Task):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


try:
    trainer("pp", 2).fit(WithLBFGS("demo"))
    out["lbfgs"] = "no error"
except ValueError as err:
    out["lbfgs"] = str(err)

# measuring: MFUMonitor counts each rank's own stages (per device); BottleneckDoctor reports the bubble per rank
from lightning_accel.callbacks import BottleneckDoctor, MFUMonitor
from lightning_accel.core.flops import FlopCounter

monitor = MFUMonitor(window=2, warmup_batches=1, peak_flops=1e12, print_summary=False)
doctor = BottleneckDoctor(window=2, warmup_batches=1, print_report=False)
t = trainer(PipelineStrategy(schedule="gpipe", microbatches=1), 6, callbacks=[monitor, doctor],
            default_root_dir=".")
t.fit(Task("demo"))
counter = FlopCounter()
counter.start()
loss_of("demo", build("demo"), batch_of("demo", 0, BATCH)).backward()
out["flops"] = {"mine": monitor.summary.get("flops_per_batch"), "total": counter.stop()}
out["doctor"] = [[f.rule, f.evidence, f.fix] for f in doctor.report.findings]
with open(f"pp_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""
)

KINDS = ["demo"] + [
    k
    for k, mod in (("llama", "transformers"), ("gpt2", "transformers"), ("litgpt", "litgpt"))
    if importlib.util.find_spec(mod)
]


@pytest.mark.distributed
def test_pp_trains_the_same_weights_as_one_process(ddp_script, tmp_path):
    ddp_script(SCRIPT, timeout=500, args=[",".join(KINDS)])
    ranks = read_rank_json(tmp_path, "pp")
    for name, result in ranks[0].items():
        if not (isinstance(result, dict) and "dw" in result):
            continue
        for rank in ranks:  # every rank's own parameters: the stages' weights after 10 steps
            assert rank[name]["dw"] <= 1e-4, (name, rank[name]["dw"])
        assert ranks[0][name]["n"] > 0 and ranks[1][name]["n"] > 0
        # 4 equal blocks: 2 on each stage; interleaved: 4 stages of 1, stages 0 and 2 on rank 0
        assert ranks[0][name]["plan"] == ([[0], [1], [2], [3]] if "interleaved" in name else [[0, 1], [2, 3]])
        # measured on every rank (the stage timer's hooks ran): a fraction, never "not measured" (None)
        assert all(rank[name]["bubble"] is not None and 0.0 < rank[name]["bubble"] < 1.0 for rank in ranks), name
    assert ranks[0]["demo_None_1"]["expected"] == pytest.approx(1 / 3)  # "pp" defaults: 2 micro-batches
    assert ranks[0]["demo_gpipe_2"]["expected"] == pytest.approx(1 / 5)
    assert ranks[0]["demo_interleaved_1f1b_1"]["expected"] == pytest.approx(1 / 9)  # (P-1)/(V·m+P-1), V=2, m=4
    for rank in ranks:
        assert rank["val"]["got"] == pytest.approx(rank["val"]["want"], rel=1e-5)
        assert "was split by another pp Trainer" in rank["resplit"]
        assert rank["resume_dw"] <= 1e-5
        assert rank["consolidated_dw"] <= 1e-5
        assert "differs from SecondHalf.training_step's" in rank["mismatch"] and "pipeline_loss" in rank["mismatch"]
        assert rank["hook_ok"] == 2
        assert "a batch of 6 does not divide into microbatches=4" in rank["divide"]
        assert rank["timed"]["delta_w"] <= 1e-4 and rank["timed"]["unit"] == "µs fwd+bwd"
        assert rank["timed"]["plan"] == ranks[0]["timed"]["plan"]
        assert rank["timed"]["costs"] == ranks[0]["timed"]["costs"]
        assert "LBFGS re-evaluates the loss" in rank["lbfgs"] and "first-order optimizer" in rank["lbfgs"]
        # each rank counts the FLOPs its own stage ran; together they are the one-process step's
        assert 0 < rank["flops"]["mine"] < rank["flops"]["total"]
        bubble = [f for f in rank["doctor"] if f[0] == "pipeline_bubble"]
        assert bubble and "rank 0:" in bubble[0][1] and "rank 1:" in bubble[0][1] and "= 50% for P=2" in bubble[0][1]
        assert "microbatches=2" in bubble[0][2] and "interleaved_1f1b" in bubble[0][2]
    assert ranks[0]["flops"]["mine"] + ranks[1]["flops"]["mine"] == pytest.approx(ranks[0]["flops"]["total"], rel=1e-6)


STALL = (
    COMMON
    + r"""
import time

import torch.distributed as dist


class Stall(pl.Callback):  # rank 1 stops answering at the third step (a deadlocked or hung peer)
    def __init__(self, timeout):
        self.timeout = timeout

    def on_train_batch_start(self, trainer, module, batch, i):
        if i == 2 and trainer.global_rank == 1:
            # alive, silent, until rank 0 has timed out (its connection must not close first); a rank 0 that
            # does not honour the timeout sees this peer leave instead, and the test says so
            deadline = time.monotonic() + 4 * self.timeout
            while not os.path.exists("stall_rank0.json") and time.monotonic() < deadline:
                time.sleep(0.1)
            os._exit(0)  # never comes back to the schedule


# The timeout derives from how long this machine takes now: a first fit (the split, the first-batch check and two
# steps, under whatever else runs on these cores) is timed on every rank, and the stalled fit gets five times the
# slowest (at least 15 s). A peer still in its set-up while the other waits at step 0 is inside that bound on a
# loaded machine, while a stall is still caught in seconds rather than after the default 30 minutes.
started = time.monotonic()
trainer(PipelineStrategy(timeout=600), 2).fit(Task("demo"))
first_fit = torch.tensor([time.monotonic() - started])
dist.all_reduce(first_fit, op=dist.ReduceOp.MAX)
timeout = max(15.0, 5 * float(first_fit))
t = trainer(PipelineStrategy(timeout=timeout), 6, callbacks=[Stall(timeout)])
try:
    t.fit(Task("demo"))
    error = "no error"
except RuntimeError as err:
    error = str(err)
with open(f"stall_rank{t.global_rank}.json", "w") as fh:
    json.dump({"error": error, "step": t.global_step, "timeout": timeout, "first_fit": float(first_fit)}, fh)
os._exit(0)
"""
)


@pytest.mark.distributed
def test_a_peer_that_stops_answering_times_out_naming_rank_and_stage(ddp_script, tmp_path):
    ddp_script(STALL, timeout=900)

    rank0 = json.loads((tmp_path / "stall_rank0.json").read_text())
    assert rank0["step"] == 2, rank0
    assert "pipeline rank 0 (stage 0 of 2)" in rank0["error"] and "stopped answering" in rank0["error"], rank0
    # the strategy's own timeout ended the wait (the process group was created by the first fit with 10 minutes)
    assert f"(timeout {timedelta(seconds=rank0['timeout'])})" in rank0["error"], rank0
    assert "Timed out" in rank0["error"], rank0


PP_DDP = (
    COMMON
    + r"""
STEPS = 10
monitor = Losses()
t = trainer("pp_ddp", STEPS, devices=4, callbacks=[monitor])
task = Task("demo")
t.fit(task)
s = t.strategy
ref = reference("demo", STEPS, size=2 * BATCH)
out = {"dw": max_dw(task, ref), "sizes": [s.pp_size, s.dp_size], "coords": [s.pp_rank, s.dp_rank],
       "losses": monitor.losses}
# the replica average through the DDP compression hooks (same processes, one more fit each): Top-K at density 1
# sends every entry (fp32 values + int32 indices: twice the bytes) and must give the plain run's weights; bf16 sends
# half the bytes and stays close
RUNS = (("topk", {"compression": "topk", "density": 1.0}), ("bf16", {"compression": "bf16"}),
        ("topk_sparse", {"compression": "topk", "density": 0.25}))
for name, kwargs in RUNS:
    t = trainer(PipelineStrategy(data_parallel_size="auto", **kwargs), STEPS, devices=4)
    task = Task("demo")
    t.fit(task)
    c = t.strategy.comm_stats
    state = t.strategy._dp_hook[0]
    residual = getattr(state, "error_dict", {}).get(0)
    out[name] = {"dw": max_dw(task, ref), "steps": c.steps, "compressed": c.compressed_steps,
                 "before": c.bytes_before, "sent": c.bytes_sent,
                 "n": sum(p.numel() for p in task.parameters()),
                 "residual": None if residual is None else float(residual.abs().sum()),
                 "residual_numel": None if residual is None else residual.numel()}
with open(f"ppddp_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""
)


@pytest.mark.distributed
def test_pp_ddp_two_stages_by_two_replicas_matches_one_process(ddp_script, tmp_path):
    ddp_script(PP_DDP, timeout=300)
    ranks = read_rank_json(tmp_path, "ppddp", world_size=4)
    assert [r["coords"] for r in ranks] == [[0, 0], [0, 1], [1, 0], [1, 1]]  # consecutive ranks: replicas
    assert all(r["sizes"] == [2, 2] for r in ranks)
    for r in ranks:  # each replica trained on its half of the batch of 8; averaged: the one-process weights
        assert r["dw"] <= 1e-4
    assert ranks[0]["losses"] == ranks[2]["losses"]  # a pipeline's stages report its loss
    assert ranks[0]["losses"] != ranks[1]["losses"]  # the replicas saw different data
    for r in ranks:
        topk, bf16 = r["topk"], r["bf16"]
        assert topk["dw"] <= 1e-4 and topk["steps"] == bf16["steps"] == 10
        assert topk["compressed"] == 8  # Top-K's default warm-up: 2 plain all-reduce steps
        assert topk["before"] == 10 * 4 * topk["n"] and topk["sent"] == 2 * 4 * topk["n"] + 8 * 8 * topk["n"]
        assert bf16["sent"] * 2 == bf16["before"] == 10 * 4 * bf16["n"] and bf16["compressed"] == 10
        assert 0 < bf16["dw"] <= 1e-2  # bf16's 8-bit mantissa: close to, not equal to, the fp32 weights
        # a quarter of the entries per step, the rest kept as this rank's residual and sent in later steps: the
        # bytes are exact, a residual is held for the stage's whole flat bucket, and the weights stay close
        sparse, n = r["topk_sparse"], r["topk_sparse"]["n"]
        assert sparse["compressed"] == 8 and sparse["sent"] == 2 * 4 * n + 8 * 8 * math.ceil(0.25 * n)
        assert sparse["residual_numel"] == n and sparse["residual"] > 0
        assert 0 < sparse["dw"] <= 5e-2, sparse["dw"]


BUBBLE = (
    COMMON
    + r"""
from lightning_accel.demo.model import GPT, GPTConfig

LONG = torch.randint(0, VOCAB, (16 * 12, 65), generator=torch.Generator().manual_seed(2))


class Wide(pl.LightningModule):  # blocks heavy enough that compute, not the sends, fills the step
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=64, n_layer=4, n_head=4, d_model=128))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def train_dataloader(self):
        data = TensorDataset(LONG[:, :-1], LONG[:, 1:])
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=False, **kwargs))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


out = {}
for m in (1, 2):
    t = trainer(PipelineStrategy(schedule="gpipe", microbatches=m), 10)
    t.fit(Wide())
    out[m] = {"bubble": t.strategy.stats.bubble(skip=3), "expected": t.strategy.stats.expected_bubble}
with open(f"bubble_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""
)


@pytest.mark.distributed
@pytest.mark.timing  # the idle share is a ratio of measured times: nothing may run beside it
def test_the_measured_bubble_follows_the_schedules_formula(ddp_script, tmp_path):
    # GPipe over 2 balanced stages: with m micro-batches each rank idles (P-1)/(m+P-1) of the step (1/2 at m = 1,
    # 1/3 at m = 2) waiting for the other stage; the point-to-point sends and the schedule's own work add a little
    # (benchmarks/bench_pipeline.py measures 0.48-0.54 and 0.33-0.45 on the 2-core CPU machine)
    ddp_script(BUBBLE, timeout=600)
    for rank in read_rank_json(tmp_path, "bubble"):
        for m, expected in (("1", 0.5), ("2", 1 / 3)):
            assert rank[m]["expected"] == pytest.approx(expected)
            assert expected - 0.12 <= rank[m]["bubble"] <= expected + 0.2, (m, rank[m])


FLOAT = r"""
import json, os, sys
import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel  # registers "pp" and "pp_ddp"
from lightning_accel.strategies.pipeline import PipelineLayout, PipelineStrategy

torch.set_num_threads(1)
STEPS = 6
g = torch.Generator().manual_seed(1)
FEATURES, CLASSES = torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g)
IMAGES, TARGETS = torch.randn(96, 1, 8, 8, generator=g), torch.randn(96, 2, generator=g)
RAW = 1000 + torch.randn(96, 8, generator=g)  # unnormalised features (raw sensor values around 1000)
NOISE = torch.randn(96, 1, generator=g)
IDS = torch.randint(0, 64, (96, 17), generator=g)


class MLP(nn.Module):  # float features: an nn.Linear embedding, an MLP trunk, a linear head
    def __init__(self, out=4):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4))
        self.classify = nn.Linear(32, out)

    def forward(self, x):
        h = self.embed(x)
        for block in self.trunk:
            h = block(h)
        return self.classify(h)


class CNN(nn.Module):  # images: a convolution stem, a trunk of convolution blocks, a pooled linear head
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, x):
        h = self.stem(x)
        for block in self.trunk:
            h = block(h)
        return self.head(h)


class Classifier(pl.LightningModule):  # its only pipeline code: pipeline_layout() (the default loss is the CE)
    def __init__(self, batch=8):
        super().__init__()
        self.batch = batch
        self.net = MLP()

    def pipeline_layout(self):
        return PipelineLayout(embed=self.net.embed, blocks=self.net.trunk, head=self.net.classify)

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def data(self):
        return TensorDataset(FEATURES, CLASSES)

    def train_dataloader(self):  # Lightning puts in a DistributedSampler(shuffle=True) under any distributed strategy
        return DataLoader(self.data(), batch_size=self.batch, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Regressor(Classifier):  # images in, float targets out: pipeline_loss says what the loss is
    def __init__(self, batch=8):
        super().__init__(batch)
        self.net = CNN()

    def pipeline_layout(self):
        return PipelineLayout(embed=self.net.stem, blocks=self.net.trunk, head=self.net.head)

    def pipeline_loss(self, out, y):
        return F.mse_loss(out, y)

    def training_step(self, batch, i):
        x, y = batch
        return self.pipeline_loss(self.net(x), y)

    def data(self):
        return TensorDataset(IMAGES, TARGETS)


class Raw(Classifier):
    # inputs around 1000 and outputs in the tens; the targets are the network's own fp32 prediction plus unit noise.
    # bf16 keeps 8 significant bits of each, so the loss in bf16 is far from the loss in fp32, while the pipeline
    # and its reference in the same autocast agree; the loss is computed in the outputs' dtype
    def __init__(self):
        super().__init__()
        self.net = MLP(out=1)
        with torch.no_grad():
            self.net.classify.weight.mul_(30)
            self.targets = self.net(RAW) + NOISE

    def pipeline_loss(self, out, y):
        return ((out - y.to(out.dtype)) ** 2).mean()

    def training_step(self, batch, i):
        x, y = batch
        return self.pipeline_loss(self.net(x), y)

    def data(self):
        return TensorDataset(RAW, self.targets)


class RenamedGPT(nn.Module):  # nanoGPT's structure under names no hint knows: found by its forward
    def __init__(self):
        super().__init__()
        from lightning_accel.demo.model import Block, GPTConfig

        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)
        self.tok, self.where = nn.Embedding(64, 32), nn.Embedding(16, 32)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(4))
        self.final, self.out = nn.LayerNorm(32), nn.Linear(32, 64, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.where(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.final(x))


class Renamed(Classifier):  # no pipeline code at all
    def __init__(self, batch=8):
        super().__init__(batch)
        self.net = RenamedGPT()

    pipeline_layout = None  # not described: the strategy finds the structure

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def data(self):
        return TensorDataset(IDS[:, :-1], IDS[:, 1:])


class FirstBatch(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, i):
        if i == 0:
            self.batch = batch


def fit(task, strategy, devices, precision="32-true", callbacks=()):
    t = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   precision=precision, callbacks=list(callbacks))
    t.fit(task)
    return t


def build(cls, **kwargs):
    pl.seed_everything(0, verbose=False)  # the same weights, and the samplers' seed, in every run
    return cls(**kwargs)


def max_dw(task, name):
    # this rank's parameters (their original names) against the one-process run's
    want = torch.load(f"ref_{name}.pt")
    return max((p.detach() - want[n]).abs().max().item() for n, p in task.named_parameters())


mode, out = sys.argv[1], {}
if mode == "ref":  # one process under "ddp": the same DistributedSampler(shuffle=True) order as the pipelines
    for name, cls, batch in (("mlp", Classifier, 8), ("cnn", Regressor, 16), ("renamed", Renamed, 8)):
        task = build(cls, batch=batch)
        fit(task, "ddp", 1)
        torch.save(task.state_dict(), f"ref_{name}.pt")
    sys.exit(0)
if mode == "pp":
    for name, cls, strategy in (("pp", Classifier, "pp"), ("timed", Classifier, PipelineStrategy(balance="time")),
                                ("renamed", Renamed, "pp")):
        task = build(cls)
        t = fit(task, strategy, 2)
        s = t.strategy
        out[name] = {"dw": max_dw(task, "mlp" if cls is Classifier else name), "layout": s._stage_split.layout.name, "n": sum(p.numel() for p in task.parameters()),
                     "plan": [list(r) for r in s.plan.blocks], "unit": s.plan.unit, "costs": list(s.plan.costs),
                     "check": s.loss_check, "steps": t.global_step}
    first = FirstBatch()
    t = fit(build(Raw), "pp", 2, precision="bf16-mixed", callbacks=[first])
    fresh = build(Raw)  # the same initial weights: the loss on the first batch in fp32, outside any autocast
    with torch.no_grad():
        x, y = first.batch
        fp32 = float(fresh.training_step((x, y), 0))
    out["bf16"] = {"check": t.strategy.loss_check, "fp32": fp32, "steps": t.global_step}
else:  # pp_ddp: 2 stages x 2 replicas, each replica half of the one-process run's batch of 16
    task = build(Regressor)
    t = fit(task, "pp_ddp", 4)
    out["pp_ddp"] = {"dw": max_dw(task, "cnn"), "sizes": [t.strategy.pp_size, t.strategy.dp_size],
                     "check": t.strategy.loss_check, "steps": t.global_step}
with open(f"{mode}_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.distributed
def test_a_float_input_pipeline_layout_trains_like_one_process_ddp(ddp_script, tmp_path):
    # pipeline_layout() over float features (nn.Linear embedding + MLP trunk) and images (a CNN trunk): the split
    # check, the stage-cost probe and the first-batch check run on the module's own first batch; 6 steps under "pp"
    # (2 processes) and "pp_ddp" (4: 2 stages x 2 replicas) give the weights of one process under "ddp"; so does a
    # nanoGPT-shaped GPT whose pieces have names no hint knows (tok, layers, out), found by its forward
    ddp_script(FLOAT, args=["ref"], timeout=300)
    ddp_script(FLOAT, args=["pp"], timeout=500)
    ddp_script(FLOAT, args=["pp_ddp"], timeout=500)
    for rank in read_rank_json(tmp_path, "pp"):
        for name in ("pp", "timed", "renamed"):
            run = rank[name]
            assert run["steps"] == 6 and run["n"] > 0 and run["dw"] <= 1e-5, (name, run)
            assert run["check"]["dtype"] == "torch.float32" and run["check"]["rtol"] == 1e-4
        assert rank["pp"]["plan"] == [[0, 1], [2, 3]] and rank["pp"]["unit"] == "parameters"
        assert rank["timed"]["unit"] == "µs fwd+bwd" and min(rank["timed"]["costs"]) > 0  # measured on the batch
        assert rank["renamed"]["layout"] == "tok → 4 blocks (layers) → final → out, found by its forward"
        assert rank["renamed"]["plan"] == [[0, 1], [2, 3]]
        # bf16-mixed: the reference ran in the pipeline's autocast and was compared at bf16's tolerance; the fp32
        # loss of the same batch and weights is further from the pipeline's than that tolerance, so a reference
        # outside the autocast would have refused the run
        bf16 = rank["bf16"]
        check = bf16["check"]
        assert bf16["steps"] == 6 and check["dtype"] == "torch.bfloat16" and check["rtol"] == 2e-2, bf16
        scale = max(1.0, abs(check["reference"]))
        assert abs(check["pipeline"] - check["reference"]) <= check["rtol"] * scale
        assert abs(bf16["fp32"] - check["pipeline"]) > 2 * check["rtol"] * scale, bf16
    ranks = read_rank_json(tmp_path, "pp_ddp", world_size=4)
    for rank in ranks:
        run = rank["pp_ddp"]
        assert run["sizes"] == [2, 2] and run["steps"] == 6 and run["dw"] <= 1e-5, run
        assert run["check"]["dtype"] == "torch.float32"


PP_DDP_RESUME = (
    COMMON
    + r"""
# the replica average compressed: Top-K's residuals and step counter, QSGD's generator go into the checkpoint and
# come back, so a run resumed at an epoch boundary is the uninterrupted one
def fit(kwargs, epochs, ckpt_path=None, save=None):
    pl.seed_everything(0, verbose=False)
    task = Task("demo")
    t = pl.Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(data_parallel_size="auto", **kwargs),
                   max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, use_distributed_sampler=False)
    t.fit(task, ckpt_path=ckpt_path)
    if save:
        t.save_checkpoint(save)
    s = t.strategy
    state = s._dp_hook[0]
    residual = getattr(state, "error_dict", {}).get(0)
    # the tied embedding: the first stage's copy and the last stage's, whichever this rank holds
    params = dict(task.named_parameters(remove_duplicate=False))
    (first, last), = s._stage_split.tied
    tied = next(params[n] for n in ("model." + first, "model." + last) if n in params)
    return t, {"iter": state.iter, "stats": s.comm_stats.as_dict(), "tied": tied.detach().double().tolist(),
               "residual": None if residual is None else float(residual.abs().sum())}, [
        p.detach().clone() for p in task.parameters()]


out = {}
RUNS = (("topk", {"compression": "topk", "density": 0.25}),
        ("qsgd", {"compression": "qsgd", "levels": 3}))
for name, kwargs in RUNS:
    ckpt = f"{name}.ckpt"
    _, out[f"{name}_first"], _ = fit(kwargs, 1, save=ckpt)
    _, out[f"{name}_resumed"], resumed = fit(kwargs, 2, ckpt_path=ckpt)
    t, out[f"{name}_straight"], straight = fit(kwargs, 2)
    out[f"{name}_diff"] = max((a - b).abs().max().item() for a, b in zip(resumed, straight))
    if t.global_rank == 0:
        saved = torch.load(ckpt, weights_only=True).get("lightning_accel_ddp_compression")
        out[f"{name}_saved"] = saved and {"world": saved["world_size"], "iters": [r["iter"] for r in saved["ranks"]],
                                          "pieces": [sorted(r["pieces"].get("error_dict", {})) for r in saved["ranks"]]}
with open(f"resume_rank{t.global_rank}.json", "w") as fh:
    json.dump(out, fh)
"""
)


@pytest.mark.distributed
def test_pp_ddp_resumes_its_compressor_state_like_an_uninterrupted_run(ddp_script, tmp_path):
    ddp_script(PP_DDP_RESUME, timeout=600)
    ranks = read_rank_json(tmp_path, "resume", world_size=4)
    steps = 96 // (2 * 4)  # per epoch: 96 sequences, 2 replicas of batches of 4
    for r in ranks:
        for name in ("topk", "qsgd"):
            first, resumed, straight = r[f"{name}_first"], r[f"{name}_resumed"], r[f"{name}_straight"]
            assert first["iter"] == steps and resumed["iter"] == straight["iter"] == 2 * steps, name
            assert resumed["stats"] == straight["stats"], name
            # the replica average continued with its state: the weights are the uninterrupted run's, bit for bit
            assert r[f"{name}_diff"] == 0.0, (name, r[f"{name}_diff"])
        assert r["topk_first"]["residual"] > 0 and r["topk_resumed"]["residual"] == r["topk_straight"]["residual"]
    for name in ("topk", "qsgd"):  # each stage compresses its own bucket; the copies of the tied weight stay one
        for d in (0, 1):  # replica d: the first stage on rank d, the last on rank 2 + d
            assert ranks[d][f"{name}_straight"]["tied"] == ranks[2 + d][f"{name}_straight"]["tied"], (name, d)
    saved = ranks[0]["topk_saved"]
    assert saved["world"] == 4 and saved["iters"] == [steps] * 4
    assert all(pieces for pieces in saved["pieces"])  # every rank's residual, per parameter of its stage
