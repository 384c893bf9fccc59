"""BottleneckDoctor's compute attribution on CPU: planted compute causes are named with their module and fix."""

from __future__ import annotations

import re
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_accel.callbacks import BottleneckDoctor
from lightning_accel.core.attribution import ENGINE, PSEUDO_MODULES, STEP, attribute
from lightning_accel.core.compute_causes import find_compute_causes
from lightning_accel.core.findings import RunContext


class Batches(Dataset):
    """The same pre-made batch again and again: no data wait, no collation."""

    def __init__(self, make, n=64):
        self.batch, self.n = make(), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.batch


class Task(pl.LightningModule):
    def __init__(self, model, make_batch, loss=None):
        super().__init__()
        self.model = model
        self.make_batch = make_batch
        if loss is not None:
            self.loss_fn = loss

    def training_step(self, batch, i):
        x, y = batch
        out = self.model(x)
        if hasattr(self, "loss_fn"):
            return self.loss_fn(out, y)
        return F.cross_entropy(out.flatten(0, -2), y.flatten())

    def train_dataloader(self):
        return DataLoader(Batches(self.make_batch), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit(task, *, max_steps=8, doctor=None, callbacks=(), **trainer_kwargs):
    doctor = doctor or BottleneckDoctor(
        window=3,
        warmup_batches=1,
        report_path=False,
        print_report=False,
        log_metrics=False,
        utilisation=False,
        smells=False,
        attribute_compute=True,
        attribution_steps=2,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor, *callbacks],
        **trainer_kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task)
    messages = [str(w.message) for w in caught if "BottleneckDoctor: compute" in str(w.message)]
    return doctor, messages


def compute_findings(report):
    return [f for f in report.findings if f.kind == "compute"]


# ---------------------------------------------------------------------------------------------- planted models
class EagerAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v written out: the [B, H, L, L] scores are stored and read several times."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        scores = (q @ k.transpose(-1, -2)) / (c // self.heads) ** 0.5
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


class FusedAttention(EagerAttention):
    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, attention, d=32):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(d), attention(d)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class Stack(nn.Module):
    def __init__(self, attention, *, d=32, layers=2, vocab=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(attention, d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


def tokens(b, t, d, vocab):
    return lambda: (torch.randn(b, t, d), torch.randint(0, vocab, (b, t)))


class HandNorm(nn.Module):
    """LayerNorm written out: ~10 elementwise passes a compiler fuses into one."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class LoopLoss(nn.Module):
    """A squared error summed sample by sample in Python: 4 small operations per sample."""

    def forward(self, pred, target):
        total = pred.new_zeros(())
        for i in range(pred.shape[0]):
            total = total + ((pred[i] - target[i]) ** 2).mean()
        return total / pred.shape[0]


# ---------------------------------------------------------------------------------------------- planted causes
def test_eager_attention_at_a_long_sequence_is_named_with_the_attention_module_and_sdpa():
    doctor, messages = fit(Task(Stack(EagerAttention), tokens(2, 256, 32, 64)))
    found = compute_findings(doctor.report)
    assert [f.rule for f in found][:1] == ["eager_attention"], [(f.rule, f.module) for f in found]
    f = found[0]
    assert f.module in ("model.blocks.0.attn", "model.blocks.1.attn")
    assert "model.blocks.*.attn (2 modules" in f.evidence and "[2, 2, 256, 256]" in f.evidence
    assert "scaled_dot_product_attention" in f.fix and "use_fused_attention" in f.fix
    assert f.value > 0.3 and 0 < f.saving < f.value  # half the score passes, of the compute share of the fit
    assert any("computes attention by hand" in m for m in messages)  # warned live, once the window closed


class MathSDPA(FusedAttention):
    """SDPA on its math kernel: the softmax over the scores runs inside the one SDPA operation."""

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return super().forward(x)


def test_the_same_model_with_sdpa_gets_no_attention_finding():
    doctor, _ = fit(Task(Stack(MathSDPA), tokens(2, 256, 32, 64)))
    assert "eager_attention" not in [f.rule for f in compute_findings(doctor.report)]
    # the operations inside SDPA (its softmax over [2, 2, 256, 256]) are SDPA's, not calls of the module's own
    attn = next(r for r in doctor.report.attribution["leaves"] if r["module"].endswith(".attn"))
    assert "aten::scaled_dot_product_attention" in [o["name"] for o in attn["ops"]]
    assert not [o for o in attn["ops"] if "softmax" in o["name"]]


def test_a_large_vocabulary_head_and_its_cross_entropy_are_named_with_a_chunked_loss():
    doctor, _ = fit(Task(Stack(FusedAttention, layers=1, vocab=16384), tokens(2, 128, 32, 16384)))
    found = compute_findings(doctor.report)
    f = next(f for f in found if f.rule == "large_vocab_loss")
    assert f.module == "model.lm_head" and found[0] is f
    assert "16,384 classes for 256 tokens" in f.evidence and "[256, 16384]" in f.evidence
    assert "chunked or fused linear + cross-entropy" in f.fix
    assert "lightning_accel.linear_cross_entropy(hidden, model.lm_head.weight, targets)" in f.fix  # ours, runnable


def test_an_unfused_elementwise_chain_is_named_with_torch_compile():
    model = nn.Sequential(nn.Linear(64, 64), HandNorm(64), nn.Linear(64, 8))
    task = Task(model, lambda: (torch.randn(4096, 64), torch.randint(0, 8, (4096,))))
    doctor, _ = fit(task)
    found = compute_findings(doctor.report)
    f = next(f for f in found if f.rule == "unfused_elementwise")
    assert f.module == "model.1" and found[0] is f
    assert "TorchCompile" in f.fix and "F.layer_norm" in f.fix
    assert "operations in a row (mean, sub, pow, mean" in f.evidence


def test_a_python_loop_loss_is_named_with_vectorise():
    task = Task(nn.Linear(16, 16), lambda: (torch.randn(64, 16), torch.randn(64, 16)), loss=LoopLoss())
    doctor, _ = fit(task)
    found = compute_findings(doctor.report)
    f = found[0]
    assert f.rule == "python_loop" and f.module == "loss_fn", [(g.rule, g.module) for g in found]
    assert "vectorise the loop in loss_fn" in f.fix
    calls = int(re.search(r"\((\d+) operations a step, (\d+) distinct", f.evidence).group(1))
    assert calls >= 64 * 4  # 64 samples x (sub, pow, mean, add), and the views that pick a sample
    # the loop's operations are its finding's alone: no chain finding counts them again
    assert "unfused_elementwise" not in [g.rule for g in found]


class MLP(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def mlp_task():
    return Task(MLP(), lambda: (torch.randn(256, 256), torch.randint(0, 256, (256,))))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fp32_matmuls_on_a_tensor_core_gpu_are_named_with_mixed_precision(precision, monkeypatch):
    # The GPU is mocked: the run facts say an A100 in fp32 (or bf16); the window is this CPU's. CPU autocast runs
    # the matmuls in bf16 as CUDA's would, so the recorded dtype is the one the finding reads.
    import lightning_accel.callbacks.doctor.bottleneck_doctor as bd

    half = precision != "32-true"
    gpu = RunContext(
        device_type="cuda",
        device_name="NVIDIA A100-SXM4-80GB",
        device_capability=(8, 0),
        compute_dtype="bf16" if half else "fp32",
        world_size=1,
    )
    monkeypatch.setattr(bd, "static_context", lambda trainer, device: gpu)
    doctor, _ = fit(mlp_task(), precision=precision)
    found = compute_findings(doctor.report)
    rules = [f.rule for f in doctor.report.findings]
    if half:
        assert "fp32_matmul" not in rules and "fp32_compute" not in rules
        return
    f = next(f for f in found if f.rule == "fp32_matmul")
    assert f.module in ("model.up", "model.down")
    assert "AutoMixedPrecision" in f.fix and "bf16-mixed" in f.fix
    # the module-level finding replaces the stage-level one, which would count the same seconds
    assert "fp32_compute" not in rules


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.body = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.body(F.relu(self.stem(x))))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("channels_last", [False, True])
def test_nchw_convolutions_in_mixed_precision_on_a_tensor_core_gpu_are_named_with_channels_last(
    channels_last, monkeypatch
):
    # The GPU is mocked as in the fp32 test: CPU autocast runs the convolutions in bf16 as CUDA's would.
    import lightning_accel.callbacks.doctor.bottleneck_doctor as bd

    gpu = RunContext(device_type="cuda", device_capability=(8, 0), compute_dtype="bf16", world_size=1)
    monkeypatch.setattr(bd, "static_context", lambda trainer, device: gpu)
    model = ConvNet()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    doctor, _ = fit(
        Task(model, lambda: (torch.randn(8, 16, 32, 32), torch.randint(0, 10, (8,)))), precision="bf16-mixed"
    )
    rules = [f.rule for f in compute_findings(doctor.report)]
    if channels_last:
        assert "nchw_convolution" not in rules
        return
    f = next(f for f in compute_findings(doctor.report) if f.rule == "nchw_convolution")
    assert f.module in ("model.stem", "model.body") and "channels_last" in f.fix
    assert doctor.report.context.nchw_convolutions == ("model.stem", "model.body")


class Balanced(nn.Module):
    """Already fused: SDPA attention at a short sequence, F.layer_norm, F.gelu, a small vocabulary."""

    def __init__(self, d=128):
        super().__init__()
        self.attn, self.ln = FusedAttention(d, heads=4), nn.LayerNorm(d)
        self.mlp, self.head = MLP(d), nn.Linear(d, 64)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return self.head(x + self.mlp(x))


def test_a_balanced_model_gets_no_compute_finding_and_its_shares_add_up():
    doctor, messages = fit(Task(Balanced(), tokens(8, 64, 128, 64)))
    report = doctor.report
    assert compute_findings(report) == [] and messages == []
    attr = report.attribution
    # the rows from the first branching level (model's children) and one below, then the rows outside modules
    top = [r for r in attr["modules"] if r["depth"] == 2]
    assert {r["module"] for r in top} == {"model.attn", "model.ln", "model.mlp", "model.head"}
    assert {r["module"] for r in attr["modules"] if r["depth"] == 3} >= {"model.attn.qkv", "model.mlp.up"}
    pseudo = [r for r in attr["modules"] if r["module"] in (*PSEUDO_MODULES, "model (own)")]
    total = attr["forward_ms"] + attr["backward_ms"]
    # bookkeeping: the top rows and the rows outside modules are the whole forward + backward
    assert sum(r["forward_ms"] + r["backward_ms"] for r in top + pseudo) == pytest.approx(total, rel=1e-9)
    assert sum(r["share"] for r in top + pseudo) == pytest.approx(1.0, rel=1e-9)
    # against the host clock around the same steps: within 5 % (the stated tolerance)
    for phase in ("forward", "backward"):
        assert attr[f"{phase}_ms"] == pytest.approx(attr["measured_ms"][phase], rel=0.05)
    # most of the time is in the modules, not in the step's own Python or the engine
    assert sum(r["share"] for r in top) > 0.6
    assert all(r["backward_ms"] > 0 for r in top)
    # each module's backward is its own: every forward operation with a gradient has its backward listed under it
    # (linked by the profiler's sequence number), not under the step or the engine; this holds however the machine's
    # load spreads the times, unlike a ratio of one module's backward to its forward
    rows = {r["module"]: r for r in attr["modules"]}
    for module, op in (
        ("model.attn", "aten::linear"),
        ("model.attn", "aten::scaled_dot_product_attention"),
        ("model.mlp", "aten::linear"),
    ):
        ops = [o for o in rows[module]["ops"] if o["name"] == op]
        assert ops and all(o["backward_ms"] > 0 for o in ops), (module, rows[module]["ops"])
    mlp = rows["model.mlp"]
    assert {o["shapes"] for o in mlp["ops"] if o["name"] == "aten::linear"} == {
        "[8, 64, 128], [512, 128], [512]",  # up
        "[8, 64, 512], [128, 512], [128]",  # down
    }
    assert attr["window"]["recorded_steps"] == 2 and attr["overhead"]["window_s"] > 0


# ---------------------------------------------------------------------------------------------- the window itself
class HookCounter(pl.Callback):
    """Per batch, in the middle of the step: module hooks present and whether a profiler records."""

    def __init__(self):
        self.seen = []

    def on_before_backward(self, trainer, pl_module, loss):
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pl_module.modules())
        self.seen.append((hooks, torch.autograd.profiler._is_profiler_enabled))


def test_outside_the_window_nothing_is_added_to_a_step():
    counter = HookCounter()
    doctor, _ = fit(mlp_task(), max_steps=9, callbacks=[counter])
    window = doctor.report.attribution["window"]
    first, n = window["first_batch"], window["batches"]
    assert (first, n) == (1, 3)  # right after the warm-up batch: 1 profiler warm-up + 2 recorded steps
    for i, (hooks, profiling) in enumerate(counter.seen):
        inside = first <= i < first + n
        recorded = first + 1 <= i < first + n  # the window's first step is the profiler's warm-up
        assert (hooks > 0, profiling) == (inside, recorded), (i, counter.seen)
    assert doctor.report.batches == 9 - 1 - 3  # the warm-up and the window are in no stage window


class SlowData(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.randn(256, 256), torch.randint(0, 256, (256,))


def test_automatic_mode_waits_for_a_compute_bound_window_and_false_never_profiles():
    # data-bound (20 ms a batch against a ~2 ms step): no window
    slow = mlp_task()
    slow.train_dataloader = lambda: DataLoader(SlowData(), batch_size=None)
    auto = BottleneckDoctor(window=3, warmup_batches=1, report_path=False, print_report=False, log_metrics=False)
    doctor, _ = fit(slow, doctor=auto, max_steps=10)
    assert doctor.report.bottleneck == "data" and doctor.report.attribution == {}
    auto = BottleneckDoctor(window=3, warmup_batches=1, report_path=False, print_report=False, log_metrics=False)
    doctor, _ = fit(mlp_task(), doctor=auto, max_steps=10)
    assert doctor.report.attribution["window"]["first_batch"] == 4  # after the first window of 3 batches
    assert "forward + backward take" in doctor.report.attribution["window"]["reason"]
    off = BottleneckDoctor(
        window=3, warmup_batches=1, report_path=False, print_report=False, log_metrics=False, attribute_compute=False
    )
    doctor, _ = fit(mlp_task(), doctor=off, max_steps=10)
    assert doctor.report.attribution == {} and doctor.report.batches == 9


class Requester(pl.Callback):
    def __init__(self, doctor, at):
        self.doctor, self.at, self.answers = doctor, at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            self.answers.append(self.doctor.request_attribution("asked by a test"))


def test_request_attribution_opens_the_window_at_a_chosen_batch():
    doctor = BottleneckDoctor(
        window=3,
        warmup_batches=1,
        report_path=False,
        print_report=False,
        log_metrics=False,
        attribute_compute=False,
        attribution_steps=2,
    )
    requester = Requester(doctor, at=4)
    fit(mlp_task(), doctor=doctor, max_steps=10, callbacks=[requester])
    window = doctor.report.attribution["window"]
    assert requester.answers == [True] and window["reason"] == "asked by a test" and window["first_batch"] == 6


def test_a_fit_that_ends_inside_the_window_reports_the_steps_it_recorded():
    task = mlp_task()
    doctor, _ = fit(task, max_steps=3)  # warm-up batch, profiler warm-up, one recorded step
    attr = doctor.report.attribution
    assert attr["window"]["recorded_steps"] == 1 and attr["forward_ms"] > 0
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in task.modules()) == 0
    assert not torch.autograd.profiler._is_profiler_enabled


def test_a_compiled_model_is_not_attributed_and_the_report_says_why():
    task = mlp_task()
    task.model = torch.compile(task.model, backend="eager")
    doctor, _ = fit(task, max_steps=5)
    assert doctor.report.attribution == {}
    assert any("compiled" in n for n in doctor.report.notes)


def test_core_attribution_matches_the_report_and_the_root_rows_are_named():
    doctor, _ = fit(Task(Stack(FusedAttention, layers=1), tokens(2, 64, 32, 64)))
    table = doctor._measure.attribution.table
    again = attribute(table).to_dict()
    assert [r["module"] for r in again["modules"]] == [r["module"] for r in doctor.report.attribution["modules"]]
    names = {r["module"] for r in again["modules"]}
    assert STEP in names and ENGINE in names  # the loss in training_step; the engine's own time
    step = next(r for r in again["modules"] if r["module"] == STEP)
    assert any(o["name"] == "aten::cross_entropy_loss" for o in step["ops"])
    assert find_compute_causes(table, compute_share=0.0) == []  # a run that is not compute-bound: nothing to save


def test_a_profile_window_due_during_the_attribution_waits_for_it(tmp_path):
    from lightning_accel import ProfileWindow

    # the doctor's window holds batches 1-3 (global steps 1-3); a trace due at step 2 opens after it, not inside
    traces = ProfileWindow(dirpath=tmp_path, at_step=2, wait=0, warmup=0, active=1)
    doctor, _ = fit(mlp_task(), max_steps=7, callbacks=[traces])
    assert doctor.report.attribution["window"]["recorded_steps"] == 2
    assert [w["start_step"] for w in traces.windows] == [4] and traces.windows[0]["steps_recorded"] == 1


DDP_SCRIPT = """
import json
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

torch.set_num_threads(1)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.head = torch.nn.Linear(64, 8)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.enc(x)), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,))), batch_size=64)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


doctor = BottleneckDoctor(window=3, warmup_batches=1, report_path=False, print_report=False, log_metrics=False,
                          attribute_compute=True, attribution_steps=2)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[doctor])
trainer.fit(Model())
with open(f"attr_rank{trainer.global_rank}.json", "w") as fh:
    json.dump(doctor.report.to_dict(), fh)
"""


@pytest.mark.distributed
def test_two_ranks_record_the_same_window_and_rank_zero_holds_every_ranks_times(ddp_script, tmp_path):
    from tests.conftest import read_rank_json

    ddp_script(DDP_SCRIPT, timeout=300)
    r0, r1 = read_rank_json(tmp_path, "attr")
    for report in (r0, r1):
        attr = report["attribution"]
        assert attr["window"] == {
            "reason": "attribute_compute=True",
            "first_batch": 1,
            "batches": 3,
            "recorded_steps": 2,
            "ranks": 2,
        }
        assert report["batches"] == 10 - 1 - 3  # the same batches left out on both ranks
    attr = r0["attribution"]
    assert [r["rank"] for r in attr["ranks"]] == [0, 1] and all(r["forward_ms"] > 0 for r in attr["ranks"])
    enc = next(r for r in attr["modules"] if r["module"] == "enc")
    assert len(enc["rank_ms"]) == 2 and all(ms > 0 for ms in enc["rank_ms"])
    assert enc["rank_ms"][0] == pytest.approx(enc["forward_ms"] + enc["backward_ms"])


def test_ranks_that_hold_different_modules_send_their_totals_only():
    from types import SimpleNamespace

    from lightning_accel.callbacks.doctor.attribution import DoctorAttribution
    from lightning_accel.core.attribution import OpRecord, OpTable

    # a pipeline stage: this rank holds one block of a model another rank holds more of
    attr = DoctorAttribution(True, 2)
    attr.start_fit(nn.Sequential(nn.Linear(2, 2)))
    table = OpTable(
        [OpRecord(0, "forward", "0", "aten::linear", 0.002), OpRecord(0, "backward", "0", "aten::linear", 0.003)],
        steps=1,
    )
    attr.window, attr.state = SimpleNamespace(close=lambda: table), "active"
    sent = []

    def gather(row):
        sent.append(row)
        if len(sent) == 1:
            return [row, [row[0] + 2]]  # the other rank names more modules
        return [row, [0.004, 0.006]]

    attr.finish(gather, None, batches_seen=3)
    assert sent[1] == pytest.approx([0.002, 0.003]) and attr.state == "done"
    assert attr.rank_tables == [
        {"(rank total)": {"forward": pytest.approx(0.002), "backward": pytest.approx(0.003)}},
        {"(rank total)": {"forward": 0.004, "backward": 0.006}},
    ]
    result = attribute(attr.table, rank_tables=attr.rank_tables).to_dict()
    assert [r["forward_ms"] for r in result["ranks"]] == pytest.approx([2.0, 4.0])
    assert all("rank_ms" not in r for r in result["modules"])  # no module row pretends to be both ranks'


def strip_event_dtypes(monkeypatch, *, read_back):
    """Events as an older torch's ``events()`` gives them (no ``input_dtypes``); ``read_back``: the window's
    fallback then reads them from the profiler's own events, as it does there."""
    import lightning_accel._compat as compat

    original = compat.profiler_event_dtypes

    def events_without_dtypes(profiler, events):
        for event in events:
            event.input_dtypes = None
        if read_back:
            original(profiler, events)

    monkeypatch.setattr(compat, "profiler_event_dtypes", events_without_dtypes)


def test_a_torch_whose_profiler_events_carry_no_dtypes_still_gets_the_dtype_rules(monkeypatch):
    # torch 2.11 and before: FunctionEvent has no input_dtypes; the profiler's KinetoEvents have them
    import lightning_accel.callbacks.doctor.bottleneck_doctor as bd

    gpu = RunContext(device_type="cuda", device_capability=(9, 0), compute_dtype="fp32", world_size=1)
    monkeypatch.setattr(bd, "static_context", lambda trainer, device: gpu)
    strip_event_dtypes(monkeypatch, read_back=True)
    doctor, _ = fit(mlp_task())
    assert "fp32_matmul" in [f.rule for f in compute_findings(doctor.report)]
    assert not any("rules were skipped" in n for n in doctor.report.notes)


def test_profiler_event_dtypes_reads_each_operations_dtypes_back_from_the_profilers_own_events():
    from lightning_accel._compat import profiler_event_dtypes

    a, b = torch.randn(8, 8), torch.randn(8, 8, dtype=torch.float64)
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.mm(a, a)
        torch.add(b, b)
    events = prof.events()
    for event in events:
        event.input_dtypes = None
    profiler_event_dtypes(prof, events)
    by_name = {e.name: e.input_dtypes for e in events}
    assert by_name["aten::mm"][:2] == ["float", "float"]
    assert by_name["aten::add"][:2] == ["double", "double"]


def test_without_the_profilers_dtypes_a_gpu_report_says_the_dtype_rules_were_skipped(monkeypatch):
    import lightning_accel.callbacks.doctor.bottleneck_doctor as bd

    gpu = RunContext(device_type="cuda", device_capability=(8, 0), compute_dtype="fp32", world_size=1)
    monkeypatch.setattr(bd, "static_context", lambda trainer, device: gpu)
    strip_event_dtypes(monkeypatch, read_back=False)
    doctor, _ = fit(mlp_task())
    assert any("fp32_matmul and nchw_convolution compute rules were skipped" in n for n in doctor.report.notes)
    assert "fp32_matmul" not in [f.rule for f in compute_findings(doctor.report)]


def test_on_cuda_the_window_times_its_stages_with_events_on_the_stream_not_the_host_clock(monkeypatch):
    # An asynchronous launch returns before its kernels run: the host clock around it measures the launching.
    from lightning_accel.callbacks.doctor.attribution import AttributionWindow

    device_ms = iter([0.0, 7.0, 20.0])  # forward 7 ms, backward 13 ms on the stream

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.ms = next(device_ms)

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.ms - self.ms

    class StoppedProfiler:
        def stop(self):
            pass

        def events(self):
            return []

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    host = iter(range(100))
    window = AttributionWindow(nn.Linear(2, 2), steps=1, device_type="cuda", clock=lambda: float(next(host)))
    window.step = window.warmup  # the recorded step
    window._profiler = StoppedProfiler()
    window.stage("forward")
    window.stage("backward")
    window.stage(None)
    table = window.close()
    assert table.measured_seconds == pytest.approx({"forward": 0.007, "backward": 0.013})


PROFILED_WINDOW = """
import os
import torch
from torch import nn
from lightning_accel.callbacks.doctor.attribution import AttributionWindow

model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
window = AttributionWindow(model, steps=2)
window.open()
for step in range(3):
    window.stage("forward")
    loss = model(torch.randn(8, 16)).sum()
    window.stage("backward")
    loss.backward()
    print(f"user print {step}")
    os.write(2, f"user fd2 {step}\\n".encode())
    window.step_end()
table = window.close()
print(f"records {len(table.records)}")
print(f"kept {len(window.profiler_log)}: " + " | ".join(window.profiler_log))
"""


@pytest.mark.parametrize("kineto_level", [None, "0"], ids=["default", "KINETO_LOG_LEVEL=0"])
def test_the_profilers_own_lines_stay_out_of_the_terminal_and_the_users_prints_do_not(tmp_path, kineto_level):
    # Kineto writes its lines from C++ to fd 2: the child's real descriptors are what a terminal would show.
    from tests.conftest import run_script

    env = {"PYTHONUNBUFFERED": ""}  # block-buffered stdout: the window must flush it before taking fd 1
    if kineto_level is not None:
        env["KINETO_LOG_LEVEL"] = kineto_level
    proc = run_script(PROFILED_WINDOW, tmp_path, env=env)
    terminal = proc.stdout + proc.stderr
    kept = next(line for line in proc.stdout.splitlines() if line.startswith("kept "))
    shown = terminal.replace(kept, "")
    kineto_marks = ("profiler_start", "profiler_stop", "USDT:", "STAGE:", "SyncActivityProfilerHandler", "Log file")
    for mark in (*kineto_marks, "gpuGetDeviceCount"):
        assert mark not in shown, shown
    # Which lines Kineto prints depends on the torch release (2.6: STAGE and Log file, or a GPU-count error; 2.13:
    # profiler_start/stop); every release we support prints some, and the window kept them.
    assert int(kept.split(":")[0].split()[1]) > 0, kept
    assert any(mark in kept for mark in (*kineto_marks, "gpuGetDeviceCount")), kept
    assert [line for line in proc.stdout.splitlines() if line.startswith("user print")] == [
        f"user print {i}" for i in range(3)
    ]
    assert [line for line in proc.stderr.splitlines() if line.startswith("user fd2")] == [
        f"user fd2 {i}" for i in range(3)
    ]
    assert re.search(r"^records [1-9]", proc.stdout, re.M)


def test_output_dropped_forwards_what_is_not_the_profilers_and_restores_the_descriptors(capfd):
    import os

    from lightning_accel.callbacks.doctor.attribution import profiler_output_dropped

    before = [os.fstat(fd).st_ino for fd in (1, 2)]
    log: list[str] = []
    with profiler_output_dropped(log):
        os.write(2, b"USDT:2026-01-02 03:04:05 11:11 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning of someone else\n")
        print("printed in the block")
    print("printed after")
    assert [os.fstat(fd).st_ino for fd in (1, 2)] == before
    out, err = capfd.readouterr()
    assert out == "printed in the block\nprinted after\n"
    assert err == "a warning of someone else\n"
    assert log == ["USDT:2026-01-02 03:04:05 11:11 SyncActivityProfilerHandler.cpp:52] profiler_start"]
