"""Code smells: each rule with a positive and a negative case, on real modules, optimizers and loaders."""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel.core.smells import SMELLS, find_smells, loader_settings


def rules(diagnosis):
    return {f.rule for f in diagnosis.findings}


def skipped(diagnosis):
    return {s.rule: s.reason for s in diagnosis.skipped}


def mlp(*dims):
    layers = [torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    return torch.nn.Sequential(*layers)


def test_tf32_off_on_an_ampere_gpu_in_fp32():
    model = mlp(64, 64)
    gpu = dict(device_type="cuda", device_capability=(8, 0), compute_dtype="fp32")
    found = find_smells(model, rules=["tf32_off"], float32_matmul_precision="highest", **gpu)
    assert rules(found) == {"tf32_off"} and "set_float32_matmul_precision('high')" in found.findings[0].fix
    assert rules(find_smells(model, rules=["tf32_off"], float32_matmul_precision="high", **gpu)) == set()
    assert (
        rules(
            find_smells(
                model, rules=["tf32_off"], float32_matmul_precision="highest", **{**gpu, "device_capability": (7, 0)}
            )
        )
        == set()
    )
    assert "no GPU" in skipped(find_smells(model, rules=["tf32_off"], device_type="cpu"))["tf32_off"]


def test_single_tensor_optimizer_carries_the_measured_gain():
    model = mlp(*[16] * 41)  # 80 small tensors: the per-tensor loop dominates
    found = find_smells(
        model, [torch.optim.Adam(model.parameters(), lr=1e-3)], device_type="cpu", rules=["optimizer_not_foreach"]
    )
    [finding] = found.findings
    assert finding.rule == "optimizer_not_foreach" and finding.stage == "optimizer" and finding.kind == "smell"
    assert finding.gain is not None and finding.gain >= 1.1
    assert "fused=True" in finding.fix and f"{finding.gain:.2f}x faster" in finding.evidence
    # the real parameters and state are untouched by the preview
    assert all(p.grad is None for p in model.parameters())
    fused = find_smells(
        model,
        [torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)],
        device_type="cpu",
        rules=["optimizer_not_foreach"],
    )
    assert fused.findings == [] and fused.skipped == []
    # on a GPU the for-loop is a smell without a preview; foreach=None is already foreach there
    gpu = find_smells(
        model,
        [torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)],
        device_type="cuda",
        preview=False,
        rules=["optimizer_not_foreach"],
    )
    assert rules(gpu) == {"optimizer_not_foreach"} and gpu.findings[0].gain is None
    default = find_smells(
        model,
        [torch.optim.Adam(model.parameters(), lr=1e-3)],
        device_type="cuda",
        preview=False,
        rules=["optimizer_not_foreach"],
    )
    assert default.findings == []


def test_find_unused_parameters_when_every_parameter_gets_a_gradient():
    model = mlp(8, 8)
    hit = find_smells(
        model, find_unused_parameters=True, every_param_got_grad=True, rules=["ddp_find_unused_parameters"]
    )
    assert rules(hit) == {"ddp_find_unused_parameters"} and "find_unused_parameters=False" in hit.findings[0].fix
    assert (
        find_smells(
            model, find_unused_parameters=True, every_param_got_grad=False, rules=["ddp_find_unused_parameters"]
        ).findings
        == []
    )
    assert (
        "one backward"
        in skipped(find_smells(model, find_unused_parameters=True, rules=["ddp_find_unused_parameters"]))[
            "ddp_find_unused_parameters"
        ]
    )
    assert (
        "not a DDP" in skipped(find_smells(model, rules=["ddp_find_unused_parameters"]))["ddp_find_unused_parameters"]
    )


def test_batchnorm_with_small_micro_batches_under_accumulation():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    loader = {"batch_size": 4}
    hit = find_smells(model, loader=loader, accumulate_grad_batches=8, rules=["batchnorm_accumulation"])
    [finding] = hit.findings
    assert "micro-batch of 4 samples" in finding.evidence and "effective batch 32" in finding.evidence
    assert "GroupNorm" in finding.fix
    assert find_smells(model, loader=loader, accumulate_grad_batches=1, rules=["batchnorm_accumulation"]).findings == []
    assert (
        find_smells(
            model, loader={"batch_size": 64}, accumulate_grad_batches=8, rules=["batchnorm_accumulation"]
        ).findings
        == []
    )
    assert (
        find_smells(mlp(4, 4), loader=loader, accumulate_grad_batches=8, rules=["batchnorm_accumulation"]).findings
        == []
    )


def test_16_bit_matmul_dims_not_multiples_of_8():
    gpu = dict(device_type="cuda", compute_dtype="bf16", rules=["dims_not_multiple_of_8"])
    model = torch.nn.Sequential(torch.nn.Embedding(1001, 64), torch.nn.Linear(64, 1001))
    [finding] = find_smells(model, **gpu).findings
    assert "0 Embedding" not in finding.evidence and "1001x64" in finding.evidence and "50304" in finding.fix
    assert (
        find_smells(torch.nn.Sequential(torch.nn.Embedding(1024, 64), torch.nn.Linear(64, 1024)), **gpu).findings == []
    )
    assert find_smells(model, device_type="cuda", compute_dtype="fp32", rules=["dims_not_multiple_of_8"]).findings == []
    assert (
        "no GPU"
        in skipped(find_smells(model, device_type="cpu", rules=["dims_not_multiple_of_8"]))["dims_not_multiple_of_8"]
    )


class SlowData(Dataset):
    def __init__(self, sleep):
        self.sleep = sleep

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(self.sleep)
        return torch.zeros(4)


def test_num_workers_zero_where_loading_takes_time():
    slow = DataLoader(SlowData(0.002), batch_size=4)
    [finding] = find_smells(None, loader=slow, cpu_count=4, rules=["num_workers_zero"]).findings
    assert "loading one batch of 4 took" in finding.evidence and "num_workers=2" in finding.fix
    assert finding.value >= 0.008
    fast = DataLoader(SlowData(0.0), batch_size=4)
    assert find_smells(None, loader=fast, cpu_count=4, rules=["num_workers_zero"]).findings == []
    tensors = DataLoader(TensorDataset(torch.zeros(64, 4)), batch_size=4)
    assert find_smells(None, loader=tensors, cpu_count=4, rules=["num_workers_zero"]).findings == []
    assert find_smells(None, loader=slow, cpu_count=1, rules=["num_workers_zero"]).findings == []
    assert "DataLoader" in skipped(find_smells(None, rules=["num_workers_zero"]))["num_workers_zero"]
    # the sampler is not touched: the run's order does not change
    assert loader_settings(slow, time_batch=True)["load_seconds"] > 0


class SlowFirstCall(Dataset):
    """Its first read is slow (a warm-up, a hiccup); every later one costs nothing."""

    def __init__(self):
        self.calls = 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.01)
        return torch.zeros(4)


def test_a_slow_first_batch_is_timed_again_and_the_faster_reading_counts():
    loader = DataLoader(SlowFirstCall(), batch_size=4)
    assert loader_settings(loader, time_batch=True)["load_seconds"] < 0.005
    assert (
        find_smells(
            None, loader=DataLoader(SlowFirstCall(), batch_size=4), cpu_count=4, rules=["num_workers_zero"]
        ).findings
        == []
    )


def test_pin_memory_and_persistent_workers():
    unpinned = {"num_workers": 2, "pin_memory": False, "persistent_workers": False}
    gpu = find_smells(None, loader=unpinned, device_type="cuda", rules=["pin_memory_off", "persistent_workers_off"])
    assert rules(gpu) == {"pin_memory_off", "persistent_workers_off"}
    good = {"num_workers": 2, "pin_memory": True, "persistent_workers": True}
    assert (
        find_smells(None, loader=good, device_type="cuda", rules=["pin_memory_off", "persistent_workers_off"]).findings
        == []
    )
    cpu = find_smells(None, loader=unpinned, device_type="cpu", rules=["pin_memory_off"])
    assert "no GPU" in skipped(cpu)["pin_memory_off"]
    assert (
        find_smells(
            None, loader={"num_workers": 0, "persistent_workers": False}, rules=["persistent_workers_off"]
        ).findings
        == []
    )


def test_hugging_face_model_on_eager_attention():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    [finding] = find_smells(model, rules=["hf_eager_attention"]).findings
    assert "GPT2LMHeadModel" in finding.evidence and "attn_implementation='sdpa'" in finding.fix
    model.set_attn_implementation("sdpa")
    assert find_smells(model, rules=["hf_eager_attention"]).findings == []


class Uninspectable(torch.nn.Module):
    def named_modules(self, *args, **kwargs):
        raise RuntimeError("a wrapper that hides its modules")


def test_a_model_the_smells_cannot_inspect_is_skipped_with_the_reason():
    out = find_smells(Uninspectable(), loader={"batch_size": 2}, accumulate_grad_batches=4)
    reasons = skipped(out)
    assert "a wrapper that hides its modules" in reasons["batchnorm_accumulation"]
    assert "a wrapper that hides its modules" in reasons["hf_eager_attention"]
    assert "dims_not_multiple_of_8" in reasons and rules(out) <= set(SMELLS)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown smell"):
        find_smells(None, rules=["tf32"])
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        find_smells(None, accumulate_grad_batches=0)


@pytest.mark.gpu
def test_smells_on_a_real_gpu():
    model = mlp(*[64] * 41).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    found = find_smells(
        model,
        [opt],
        device_type="cuda",
        device_capability=torch.cuda.get_device_capability(),
        compute_dtype="fp32",
        float32_matmul_precision="highest",
        rules=["optimizer_not_foreach", "tf32_off", "pin_memory_off"],
        loader=DataLoader(TensorDataset(torch.zeros(8, 4)), batch_size=4),
    )
    by_rule = {f.rule: f for f in found.findings}
    assert set(by_rule) == {"optimizer_not_foreach", "tf32_off", "pin_memory_off"}
    gain = by_rule["optimizer_not_foreach"].gain
    assert gain is not None and gain >= 1.1  # 80 small tensors: one fused kernel beats 80 x several launches
    assert all(p.grad is None for p in model.parameters())


def test_the_share_gate_lists_small_smells_in_the_report_only() -> None:
    from lightning_accel.core.findings import Finding
    from lightning_accel.core.smells import gate_smells, smell_share

    optimizer = Finding(
        "optimizer_not_foreach", "optimizer", "a for-loop step.", "foreach=True", 1.0, gain=3.4, kind="smell"
    )
    workers = Finding("num_workers_zero", "data", "num_workers=0.", "num_workers=2", 1.0, kind="smell")
    batchnorm = Finding("batchnorm_accumulation", "forward", "BN on micro-batches.", "GroupNorm", 1.0, kind="smell")
    demo = {"optimizer": 0.034, "data": 0.009, "forward": 0.5}  # the demo's shares
    assert smell_share(optimizer, demo) == pytest.approx(0.034 * (1 - 1 / 3.4))  # ~2.4 %: the preview's gain
    assert smell_share(workers, demo) == pytest.approx(0.009 * 0.9)
    assert smell_share(batchnorm, demo) is None  # about the statistics, not speed
    live, report_only = gate_smells([optimizer, workers, batchnorm], demo)
    assert [f.rule for f in live] == ["batchnorm_accumulation"]
    assert [f.rule for f in report_only] == ["optimizer_not_foreach", "num_workers_zero"]
    assert "expected to save ~2.4% of the step" in report_only[0].evidence
    live, report_only = gate_smells([optimizer, workers], {"optimizer": 0.3, "data": 0.6})
    assert [f.rule for f in live] == ["optimizer_not_foreach", "num_workers_zero"] and report_only == []
