"""The pure compute attribution and its findings on hand-made operation tables: exact numbers, no profiler."""

import json

import pytest

from lightning_accel.core.attribution import (
    ACCUMULATE,
    ENGINE,
    PYTHON_OP,
    STEP,
    OpRecord,
    OpTable,
    attribute,
    format_shapes,
    module_pattern,
)
from lightning_accel.core.compute_causes import find_compute_causes
from lightning_accel.core.findings import Finding, RunContext
from lightning_accel.core.html_report import render_html
from lightning_accel.core.report import DoctorReport

MS = 1e-3


def op(module, name, ms, *, step=0, phase="forward", order=-1, shapes=(), dtype=None):
    return OpRecord(step, phase, module, name, ms * MS, tuple(tuple(s) for s in shapes), dtype, order)


def fwd_bwd(module, name, ms_f, ms_b, order, *, steps=1, shapes=(), dtype=None):
    """A forward call and its backward, in every step."""
    out = []
    for s in range(steps):
        out.append(op(module, name, ms_f, step=s, order=order, shapes=shapes, dtype=dtype))
        out.append(op(module, name, ms_b, step=s, phase="backward", order=order, shapes=shapes, dtype=dtype))
    return out


def tiny_table():
    """Two steps of: model.enc.a (2+3 ms), model.enc.b (1+1), model.head (4+4), model's own add (0.5+0.5),
    the loss in training_step (1+0), the engine (0.5) and grad accumulation (0.25) a step."""
    records = []
    records += fwd_bwd("model.enc.a", "aten::linear", 2, 3, 0, steps=2, shapes=[(8, 16), (32, 16), (32,)])
    records += fwd_bwd("model.enc.b", "aten::gelu", 1, 1, 1, steps=2, shapes=[(8, 32)])
    records += fwd_bwd("model", "aten::add", 0.5, 0.5, 2, steps=2, shapes=[(8, 32), (8, 32)])
    records += fwd_bwd("model.head", "aten::linear", 4, 4, 3, steps=2, shapes=[(8, 32), (10, 32), (10,)])
    for s in range(2):
        records.append(op(STEP, "aten::cross_entropy_loss", 1, step=s, order=4, shapes=[(8, 10), (8,)]))
        records.append(op(ENGINE, "(engine)", 0.5, step=s, phase="backward"))
        records.append(op(ACCUMULATE, "torch::autograd::AccumulateGrad", 0.25, step=s, phase="backward"))
    return OpTable(records, steps=2, stage_seconds={"forward": 17 * MS, "backward": 18.5 * MS})


def test_the_tree_starts_at_its_first_branch_and_rows_add_up():
    attr = attribute(tiny_table())
    assert attr.forward_s == pytest.approx(8.5 * MS) and attr.backward_s == pytest.approx(9.25 * MS)
    rows = {m.module: m for m in attr.modules}
    # "model" is the only child of the LightningModule: the rows start at its children
    assert [m.module for m in attr.modules] == [
        "model.head",
        "model.enc",
        "model.enc.a",
        "model.enc.b",
        "model (own)",
        STEP,
        ENGINE,
        ACCUMULATE,
    ]
    assert rows["model.enc"].forward_s == pytest.approx(3 * MS) and rows["model.enc"].backward_s == pytest.approx(
        4 * MS
    )
    assert rows["model.enc.a"].depth == 3 and rows["model.head"].depth == 2 and rows[STEP].depth == 0
    additive = [m for m in attr.modules if m.depth != 3]
    assert sum(m.seconds for m in additive) == pytest.approx(attr.seconds)
    assert sum(attr.share(m.seconds) for m in additive) == pytest.approx(1.0)
    # the costliest operations, per step, forward and backward of one operation together
    (linear,) = rows["model.enc.a"].ops
    assert (linear.name, linear.forward_s, linear.backward_s, linear.calls) == ("aten::linear", 2 * MS, 3 * MS, 1.0)
    assert [m.module for m in attr.leaves] == ["model.head", "model.enc.a", "model.enc.b", "model"]
    assert attr.stage_seconds == pytest.approx({"forward": 8.5 * MS, "backward": 9.25 * MS})


def test_the_report_form_is_json_with_the_keys_a_page_reads():
    attr = attribute(tiny_table())
    attr.window = {"first_batch": 4, "batches": 3}
    data = json.loads(json.dumps(attr.to_dict(), allow_nan=False))
    head = data["modules"][0]
    assert head["module"] == "model.head" and head["share"] == pytest.approx(8 / 17.75)
    assert head["forward_ms"] == pytest.approx(4) and head["backward_ms"] == pytest.approx(4)
    assert head["ops"][0] == {
        "name": "aten::linear",
        "share": pytest.approx(8 / 17.75),
        "ms": 8.0,
        "forward_ms": pytest.approx(4),
        "backward_ms": pytest.approx(4),
        "calls": 1.0,
        "shapes": "[8, 32], [10, 32], [10]",
    }
    assert data["window"] == {"first_batch": 4, "batches": 3} and data["steps"] == 2 and data["device"] == "cpu"
    # the HTML page renders it as its attribution section
    finding = Finding("unfused_elementwise", "forward", "e", "fix", 0.3, kind="compute", saving=0.1, module="model.enc")
    report = DoctorReport(
        bottleneck="backward", shares={"forward": 0.4, "backward": 0.6}, attribution=data, findings=[finding]
    )
    page = render_html(report)
    assert "Compute attribution" in page and "model.enc.a" in page and "aten::linear" in page
    assert "<td>forward: model.enc</td>" in page  # a compute finding names its module in the findings table


def test_ranks_carry_each_modules_seconds():
    table = tiny_table()
    mine = table.by_module()
    slower = {m: {p: 2 * v for p, v in phases.items()} for m, phases in mine.items()}
    attr = attribute(table, rank_tables=[mine, slower])
    rows = {m.module: m for m in attr.modules}
    assert rows["model.head"].rank_seconds == pytest.approx((8 * MS, 16 * MS))
    assert rows["model (own)"].rank_seconds == pytest.approx((1 * MS, 2 * MS))
    assert [r["rank"] for r in attr.ranks] == [0.0, 1.0]
    assert attr.ranks[1]["backward_s"] == pytest.approx(2 * attr.ranks[0]["backward_s"])
    assert attr.to_dict()["modules"][0]["rank_ms"] == pytest.approx([8.0, 16.0])


def test_bad_tables_are_refused_with_the_value():
    with pytest.raises(ValueError, match="device_type='tpu'"):
        attribute(OpTable(device_type="tpu"))
    with pytest.raises(ValueError, match=r"phase\(s\) \['optimizer'\]"):
        attribute(OpTable([op("m", "aten::add", 1, phase="optimizer")], steps=1))
    with pytest.raises(ValueError, match="compute_share=1.5"):
        find_compute_causes(tiny_table(), compute_share=1.5)


def test_module_pattern_and_shapes():
    assert module_pattern("model.transformer.h.3.attn") == "model.transformer.h.*.attn"
    assert module_pattern("0.layers.12") == "*.layers.*"
    assert module_pattern("model.fc1") == "model.fc1"
    assert format_shapes(((8, 64), (), (64,))) == "[8, 64], [64]"


# ---------------------------------------------------------------------------------------------- findings
def matmul_table(dtype):
    records = []
    records += fwd_bwd("model.up", "aten::linear", 6, 12, 0, shapes=[(256, 256), (1024, 256)], dtype=dtype)
    records += fwd_bwd("model.act", "aten::gelu", 1, 1, 1, shapes=[(256, 1024)], dtype=dtype)
    records += fwd_bwd("model.down", "aten::linear", 5, 10, 2, shapes=[(256, 1024), (256, 1024)], dtype=dtype)
    return OpTable(records, steps=1)


A100 = RunContext(device_type="cuda", device_capability=(8, 0), compute_dtype="fp32")


def test_fp32_matmuls_on_tensor_cores_name_the_costliest_module_and_save_a_third():
    (f,) = find_compute_causes(matmul_table("float"), context=A100, compute_share=0.8)
    assert (f.rule, f.kind, f.module) == ("fp32_matmul", "compute", "model.up")
    # claimed: the matmuls' 33 of 35 ms; 1.5x takes a third off; times the compute share
    assert f.value == pytest.approx(33 / 35)
    assert f.saving == pytest.approx(33 / 35 * (1 - 1 / 1.5) * 0.8)
    assert "bf16-mixed" in f.fix and "model.up, model.down" in f.evidence


@pytest.mark.parametrize(
    "dtype, context",
    [
        ("c10::BFloat16", A100),
        ("float", RunContext(device_type="cpu")),
        ("float", RunContext(device_type="cuda", device_capability=(6, 1))),  # no tensor cores
        ("float", None),
    ],
)
def test_no_fp32_finding_in_mixed_precision_off_tensor_cores_or_without_facts(dtype, context):
    assert find_compute_causes(matmul_table(dtype), context=context) == []


def test_a_finding_below_the_gate_is_not_reported():
    table = matmul_table("float")
    assert find_compute_causes(table, context=A100, compute_share=0.1, min_saving=0.03) != []
    assert find_compute_causes(table, context=A100, compute_share=0.05, min_saving=0.03) == []


def attention_records(module, order, steps=1, seq=256):
    s = [(2, 4, seq, seq)]
    out = []
    out += fwd_bwd(module, "aten::matmul", 1, 2, order, steps=steps, shapes=[(2, 4, seq, 16), (2, 4, 16, seq)])
    out += fwd_bwd(module, "aten::div", 1, 1, order + 1, steps=steps, shapes=s)
    out += fwd_bwd(module, "aten::softmax", 2, 2, order + 2, steps=steps, shapes=s)
    out += fwd_bwd(module, "aten::matmul", 1, 2, order + 3, steps=steps, shapes=[(2, 4, seq, seq), (2, 4, seq, 16)])
    return out


def test_eager_attention_claims_the_score_passes_and_no_other_rule_counts_them_again():
    records = attention_records("model.h.0.attn", 0) + attention_records("model.h.1.attn", 10)
    records += fwd_bwd("model.h.0.mlp", "aten::linear", 2, 4, 4, shapes=[(512, 64), (256, 64)], dtype="float")
    table = OpTable(records, steps=1)
    found = {f.rule: f for f in find_compute_causes(table, context=A100)}
    attn = found["eager_attention"]
    assert attn.module == "model.h.0.attn" and "model.h.*.attn (2 modules" in attn.evidence
    assert attn.value == pytest.approx(24 / 30) and attn.saving == pytest.approx(24 / 30 * 0.5)
    # fp32 matmuls: only the MLP's, the attention's are the attention finding's
    assert found["fp32_matmul"].value == pytest.approx(6 / 30) and found["fp32_matmul"].module == "model.h.0.mlp"
    assert sum(f.value for f in found.values()) <= 1.0 + 1e-9


def test_short_or_fused_attention_is_not_eager_attention():
    short = OpTable(attention_records("model.attn", 0, seq=64), steps=1)  # 64 x 64 scores
    assert find_compute_causes(short) == []
    fused = attention_records("model.attn", 0) + fwd_bwd(
        "model.attn", "aten::scaled_dot_product_attention", 1, 1, 9, shapes=[(2, 4, 256, 16)]
    )
    assert "eager_attention" not in [f.rule for f in find_compute_causes(OpTable(fused, steps=1))]


def test_a_large_vocabulary_loss_names_the_head_that_made_the_logits():
    records = fwd_bwd("model.lm_head", "aten::linear", 5, 10, 0, shapes=[(256, 64), (32000, 64)])
    records += fwd_bwd(STEP, "aten::view", 0.01, 0.01, 1, shapes=[(2, 128, 32000)])
    records += fwd_bwd(STEP, "aten::_to_copy", 2, 2, 2, shapes=[(256, 32000)])
    records += fwd_bwd(STEP, "aten::cross_entropy_loss", 4, 6, 3, shapes=[(256, 32000), (256,)])
    (f,) = find_compute_causes(OpTable(records, steps=1))
    assert (f.rule, f.module) == ("large_vocab_loss", "model.lm_head")
    # claimed: the passes over the [256, 32000] logits (the view, the fp32 copy, the loss), not the projection
    assert f.value == pytest.approx(14.02 / 29.02) and f.saving == pytest.approx(14.02 / 29.02 * 0.5)
    assert "32,000 classes for 256 tokens" in f.evidence and "31 MiB in fp32" in f.evidence
    small = fwd_bwd(STEP, "aten::cross_entropy_loss", 4, 6, 0, shapes=[(256, 1000), (256,)])
    assert find_compute_causes(OpTable(small, steps=1)) == []


def test_elementwise_chains_run_through_views_and_end_at_a_matmul():
    big = [(4096, 64)]
    records = fwd_bwd("model.norm", "aten::mean", 1, 1, 0, shapes=big)
    records += fwd_bwd("model.norm", "aten::sub", 1, 1, 1, shapes=big)
    records += fwd_bwd("model.norm", "aten::view", 0.01, 0, 2, shapes=big)  # a view: neither counts nor breaks
    records += fwd_bwd("model.norm", "aten::pow", 1, 1, 3, shapes=big)
    records += fwd_bwd("model.norm", "aten::add", 0.01, 0, 4, shapes=[(), ()])  # scalar bookkeeping: the same
    records += fwd_bwd("model.norm", "aten::mean", 1, 1, 5, shapes=big)
    records += fwd_bwd("model.fc", "aten::linear", 1, 1, 6, shapes=[(4096, 64), (64, 64)])
    records += fwd_bwd("model.out", "aten::relu", 1, 1, 7, shapes=big)  # a chain of three: too short
    records += fwd_bwd("model.out", "aten::mul", 1, 1, 8, shapes=big)
    records += fwd_bwd("model.out", "aten::add", 1, 1, 9, shapes=big)
    (f,) = find_compute_causes(OpTable(records, steps=1))
    assert (f.rule, f.module) == ("unfused_elementwise", "model.norm")
    total = 8 + 0.01 + 0.01 + 2 + 6  # the chain, the view, the scalar add, the linear, the short chain
    assert f.value == pytest.approx(8 / total) and f.saving == pytest.approx(8 / total * (1 - 1 / 4))
    assert "4 operations in a row (mean, sub, pow, mean)" in f.evidence and "TorchCompile" in f.fix


def test_a_chain_across_modules_is_named_by_their_common_parent():
    big = [(4096, 64)]
    records = fwd_bwd("model.block.ln", "aten::native_layer_norm", 1, 1, 0, shapes=big)
    records += fwd_bwd("model.block.act", "aten::gelu", 1, 1, 1, shapes=big)
    records += fwd_bwd("model.block.drop", "aten::dropout", 1, 1, 2, shapes=big)
    records += fwd_bwd("model.block", "aten::add", 1, 1, 3, shapes=big + big)
    (f,) = find_compute_causes(OpTable(records, steps=1))
    assert f.module == "model.block"


def test_a_python_loop_of_small_operations():
    records = []
    for i in range(64):
        records += fwd_bwd("loss_fn", "aten::sub", 0.01, 0.01, 3 * i, shapes=[(16,), (16,)])
        records += fwd_bwd("loss_fn", "aten::pow", 0.01, 0.01, 3 * i + 1, shapes=[(16,)])
        records += fwd_bwd("loss_fn", "aten::add", 0.01, 0.01, 3 * i + 2, shapes=[(), ()])
    records.append(op("loss_fn", PYTHON_OP, 2.0))
    records += fwd_bwd("model", "aten::linear", 0.5, 0.5, 500, shapes=[(64, 16), (16, 16)])
    (f,) = find_compute_causes(OpTable(records, steps=1))
    assert (f.rule, f.module) == ("python_loop", "loss_fn")
    claimed = 64 * 3 * 0.02 + 2.0
    assert f.value == pytest.approx(claimed / (claimed + 1.0))
    assert f.saving == pytest.approx(claimed / (claimed + 1.0) * (1 - 3 / 192))
    # big operations repeated (one weight-shared layer applied 40 times) are not a loop of small ones
    layers = [r for i in range(40) for r in fwd_bwd("model", "aten::linear", 1, 1, i, shapes=[(512, 512), (512, 512)])]
    assert find_compute_causes(OpTable(layers, steps=1)) == []


def test_findings_keep_their_module_through_json():
    f = Finding("eager_attention", "forward", "e", "fix", 0.5, kind="compute", saving=0.2, module="model.h.3.attn")
    assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    report = DoctorReport(bottleneck="forward", shares={"forward": 1.0}, findings=[f], attribution={"steps": 3})
    assert DoctorReport.from_dict(json.loads(report.to_json())) == report


def conv_table(dtype, module="model.stem"):
    records = []
    records += fwd_bwd(module, "aten::conv2d", 8, 16, 0, shapes=[(32, 64, 56, 56), (64, 64, 3, 3)], dtype=dtype)
    records += fwd_bwd("model.act", "aten::relu", 2, 2, 1, shapes=[(32, 64, 56, 56)], dtype=dtype)
    return OpTable(records, steps=1)


A100_BF16 = RunContext(
    device_type="cuda", device_capability=(8, 0), compute_dtype="bf16", nchw_convolutions=("model.stem",)
)


def test_half_precision_convolutions_in_nchw_name_the_module_and_channels_last():
    (f,) = find_compute_causes(conv_table("c10::BFloat16"), context=A100_BF16, compute_share=0.9)
    assert (f.rule, f.kind, f.module) == ("nchw_convolution", "compute", "model.stem")
    # the convolution's 24 of 28 ms; 1.2x takes a sixth off; times the compute share
    assert f.value == pytest.approx(24 / 28)
    assert f.saving == pytest.approx(24 / 28 * (1 - 1 / 1.2) * 0.9)
    assert "channels_last" in f.fix and "model.stem" in f.fix


@pytest.mark.parametrize(
    "dtype, context",
    [
        ("c10::BFloat16", RunContext(device_type="cuda", device_capability=(8, 0), nchw_convolutions=())),
        ("c10::BFloat16", RunContext(device_type="cpu", nchw_convolutions=("model.stem",))),
        ("c10::BFloat16", RunContext(device_type="cuda", device_capability=(6, 1), nchw_convolutions=("model.stem",))),
        ("c10::BFloat16", RunContext(device_type="cuda", device_capability=(8, 0))),
    ],
)
def test_no_channels_last_finding_when_converted_off_tensor_cores_or_unknown(dtype, context):
    assert find_compute_causes(conv_table(dtype), context=context) == []


def test_fp32_convolutions_are_a_precision_finding_not_a_memory_format_one():
    (f,) = find_compute_causes(conv_table("float"), context=A100_BF16)
    assert f.rule == "fp32_matmul"


def test_nchw_convolutions_lists_the_weights_not_in_channels_last():
    from torch import nn

    from lightning_accel.core.compute_causes import nchw_convolutions

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(1, 4, 3), nn.Linear(4, 4))
    # a 1x1 kernel, or one input channel, is laid out the same in both formats: nothing to convert
    assert nchw_convolutions(model) == ("0",)
    model.to(memory_format=__import__("torch").channels_last)
    assert nchw_convolutions(model) == ()
    ctx = RunContext(nchw_convolutions=("a.b",))
    assert RunContext.from_dict(json.loads(json.dumps(ctx.to_dict()))) == ctx
