import math

import pytest

from lightning_accel.core.rules import STAGES, RunContext, Thresholds, bottleneck_of, diagnose

BALANCED = {
    "data": 0.03,
    "transfer": 0.01,
    "forward": 0.35,
    "backward": 0.5,
    "optimizer": 0.08,
    "communication": 0.0,
    "other": 0.03,
}


def shares(**overrides):
    out = dict.fromkeys(STAGES, 0.0)
    out.update(overrides)
    return out


def gpu(**kw):
    base = dict(
        device_type="cuda",
        device_name="NVIDIA A100-SXM4-80GB",
        device_capability=(8, 0),
        compute_dtype="bf16",
        world_size=1,
    )
    base.update(kw)
    return RunContext(**base)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, math.nan, True, "0.1"])
def test_invalid_share_thresholds_raise(bad):
    with pytest.raises(ValueError, match="data_share"):
        Thresholds(data_share=bad)


def test_invalid_small_batch_and_unknown_names_raise():
    with pytest.raises(ValueError, match="small_batch"):
        Thresholds(small_batch=0)
    with pytest.raises(ValueError, match="unknown threshold.*data_shre"):
        Thresholds.from_kwargs(data_shre=0.2)


def test_balanced_cpu_run_has_no_finding_and_says_what_was_skipped():
    d = diagnose(BALANCED, RunContext(device_type="cpu", world_size=1, num_workers=0, pin_memory=False))
    assert d.findings == []
    skipped = {s.rule: s.reason for s in d.skipped}
    assert skipped["gpu_utilisation"] == "no GPU in use"
    assert "single process" in skipped["communication"]
    assert set(skipped) == {"gpu_utilisation", "fp32_compute", "communication", "memory", "launch_bound", "math_sdpa"}


def test_data_wait_fires_above_threshold_with_the_fix():
    ctx = RunContext(device_type="cpu", num_workers=0, cpu_count=8)
    (f,) = diagnose(shares(data=0.46, forward=0.3, backward=0.24), ctx).findings
    assert (f.rule, f.stage) == ("data_wait", "data")
    assert "46.0 %" in f.evidence and "num_workers=0" in f.evidence
    assert "DataLoader(num_workers=4, persistent_workers=True, prefetch_factor=4)" in f.fix
    for name in ("DataLoaderTuner", "pack_memmap", "pack_webdataset", "DALIImageDataModule"):
        assert name in f.fix
    # exactly at the threshold: no finding; a custom threshold moves it
    assert diagnose(shares(data=0.10, forward=0.9), ctx).findings == []
    assert diagnose(shares(data=0.10, forward=0.9), ctx, Thresholds(data_share=0.05)).findings


def test_data_wait_with_workers_suggests_more_and_persistence():
    ctx = RunContext(num_workers=2, prefetch_factor=2, persistent_workers=False, cpu_count=16)
    (f,) = diagnose(shares(data=0.3, forward=0.7), ctx).findings
    assert "num_workers=4" in f.fix and "prefetch_factor=4" in f.fix and "persistent_workers=True" in f.fix


def test_data_wait_on_a_dali_pipeline_names_dali_settings_not_dataloader_ones():
    dali = dict(loader="DALIImageDataModule", decode_device="cpu", loader_threads=2, prefetch_queue_depth=2)
    (f,) = diagnose(shares(data=0.3, forward=0.7), gpu(cpu_count=16, **dali)).findings
    assert "DALIImageDataModule(decode_device='cpu', num_threads=2, prefetch_queue_depth=2)" in f.evidence
    assert "decode_device='mixed'" in f.fix and "num_threads=4" in f.fix and "prefetch_queue_depth=3" in f.fix
    assert "DataLoader" not in f.fix and "num_workers" not in f.fix
    # on a CPU-only machine with every core in use: no GPU to move to, no idle core; the pixels are the work
    (f,) = diagnose(
        shares(data=0.3, forward=0.7), RunContext(device_type="cpu", cpu_count=2, **{**dali, "prefetch_queue_depth": 4})
    ).findings
    assert "mixed" not in f.fix and "num_threads" not in f.fix and "prefetch_queue_depth" not in f.fix
    assert "pre-resize" in f.fix
    # already on nvJPEG: the Huffman stage runs on the CPU threads
    (f,) = diagnose(
        shares(data=0.3, forward=0.7), gpu(cpu_count=16, **{**dali, "decode_device": "mixed", "loader_threads": 8})
    ).findings
    assert "decode_device='mixed'" not in f.fix and "num_threads=16" in f.fix
    # a GPU idling for want of data: the utilisation finding gives the same DALI fix
    ctx = gpu(cpu_count=16, gpu_utilisation=0.5, **dali)
    util = [f for f in diagnose(shares(data=0.08, forward=0.92), ctx).findings if f.rule == "gpu_utilisation"]
    assert len(util) == 1 and "decode_device='mixed'" in util[0].fix and "DataLoader" not in util[0].fix


def test_transfer_names_pin_memory_and_device_prefetcher():
    (f,) = diagnose(shares(transfer=0.3, forward=0.7), RunContext(pin_memory=False)).findings
    assert f.stage == "transfer" and "pin_memory=False" in f.evidence
    assert "pin_memory=True + DevicePrefetcher" in f.fix
    (f,) = diagnose(shares(transfer=0.3, forward=0.7), RunContext(pin_memory=True)).findings
    assert "already on" in f.evidence and "DevicePrefetcher" in f.fix


def test_optimizer_rule_names_fused_and_zero():
    ctx = gpu(world_size=8, optimizer="AdamW", optimizer_fused=False)
    (f,) = diagnose(shares(optimizer=0.4, forward=0.3, backward=0.3), ctx).findings
    assert f.stage == "optimizer" and "AdamW(fused=False)" in f.evidence
    assert "fused=True" in f.fix and "deepspeed_zero1" in f.fix
    (f,) = diagnose(shares(optimizer=0.4, forward=0.6), RunContext(device_type="cpu")).findings
    assert "foreach=True" in f.fix


def test_communication_rule():
    ctx = gpu(world_size=8, communication_measured=True, compute_dtype="bf16")
    (f,) = diagnose(shares(communication=0.3, forward=0.3, backward=0.4), ctx).findings
    assert f.stage == "communication" and "8 ranks" in f.evidence
    assert "ddp_bf16_compress" in f.fix and "ddp_powersgd" in f.fix and "accumulate_grad_batches" in f.fix
    old_gpu = gpu(world_size=2, communication_measured=True, device_capability=(7, 0))
    assert "ddp_fp16_compress" in diagnose(shares(communication=0.3, forward=0.7), old_gpu).findings[0].fix
    unmeasured = diagnose(shares(communication=0.0, forward=1.0), gpu(world_size=2, communication_measured=False))
    assert any(s.rule == "communication" and "not timed" in s.reason for s in unmeasured.skipped)


def test_gpu_rules_fire_on_a_gpu_context():
    ctx = gpu(
        compute_dtype="fp32",
        gpu_utilisation=0.55,
        mfu=0.05,
        sdpa_backend="math",
        memory_peak_fraction=0.95,
        batch_size=4,
    )
    d = diagnose(shares(forward=0.4, backward=0.4, data=0.05, other=0.15), ctx)
    by_rule = {f.rule: f for f in d.findings}
    assert set(by_rule) == {"gpu_utilisation", "fp32_compute", "memory", "launch_bound", "math_sdpa"}
    assert "AutoMixedPrecision" in by_rule["fp32_compute"].fix and "bf16-mixed" in by_rule["fp32_compute"].fix
    assert by_rule["gpu_utilisation"].stage == "other" and "TorchCompile" in by_rule["gpu_utilisation"].fix
    assert "ActivationCheckpointing" in by_rule["memory"].fix and "deepspeed_zero3_offload" in by_rule["memory"].fix
    assert "TorchCompile" in by_rule["launch_bound"].fix and "6.2 %" in by_rule["launch_bound"].evidence
    assert "use_fused_attention" in by_rule["math_sdpa"].fix and "sdpa_backends" in by_rule["math_sdpa"].fix
    assert d.skipped == [s for s in d.skipped if s.rule == "communication"]


def test_gpu_rules_quiet_when_healthy():
    ctx = gpu(
        compute_dtype="bf16",
        gpu_utilisation=0.97,
        mfu=0.45,
        sdpa_backend="flash",
        memory_peak_fraction=0.6,
        batch_size=64,
    )
    assert diagnose(BALANCED, ctx).findings == []


def test_gpu_rule_skips_name_the_missing_input():
    d = diagnose(BALANCED, gpu())
    reasons = {s.rule: s.reason for s in d.skipped}
    assert "NVML" in reasons["gpu_utilisation"]
    assert "MFUMonitor" in reasons["launch_bound"]
    assert "no scaled_dot_product_attention" in reasons["math_sdpa"]
    assert "memory peak unknown" in reasons["memory"]


def test_findings_are_ordered_by_what_their_fix_saves_and_bad_shares_raise():
    # a 50 % unfused update: a foreach/fused one takes half of it off (25 % of the step); a 30 % data wait can go
    # entirely: the loader's fix saves more and comes first, although the optimizer's stage is larger
    d = diagnose(shares(data=0.3, optimizer=0.5, forward=0.2), RunContext())
    assert [(f.rule, f.saving) for f in d.findings] == [("data_wait", 0.3), ("optimizer", 0.25)]
    d = diagnose(shares(data=0.2, optimizer=0.5, forward=0.3), RunContext())
    assert [f.stage for f in d.findings] == ["optimizer", "data"]
    with pytest.raises(ValueError, match="unknown stage"):
        diagnose({"decode": 0.5})
    with pytest.raises(ValueError, match="share of 'data'"):
        diagnose({"data": -0.1})
    with pytest.raises(ValueError, match="accounted time"):
        diagnose(shares(data=0.5), accounted=[("validation", 0.1, "the validation finding")])


def test_each_rule_says_what_its_fix_saves():
    ctx = gpu(
        compute_dtype="fp32",
        gpu_utilisation=0.55,
        mfu=0.05,
        sdpa_backend="math",
        memory_peak_fraction=0.95,
        batch_size=4,
        world_size=2,
        communication_measured=True,
    )
    d = diagnose(shares(forward=0.3, backward=0.3, transfer=0.12, communication=0.23, other=0.05), ctx)
    saving = {f.rule: f.saving for f in d.findings}
    assert saving["fp32_compute"] == pytest.approx(0.6 / 3)  # 1.5x on forward + backward
    assert saving["launch_bound"] == pytest.approx(0.6 * (1 - (0.05 / 0.6) / 0.30))  # compute above 30 % of peak
    assert saving["transfer"] == pytest.approx(0.12) and saving["communication"] == pytest.approx(0.23)
    assert saving["memory"] is None and saving["math_sdpa"] is None  # a larger batch's gain, attention's share
    # the GPU idles for the all-reduce, which has its own finding: one finding, not two on the same seconds
    assert "gpu_utilisation" not in saving
    [comm] = [f for f in d.findings if f.rule == "communication"]
    assert "Meanwhile: GPU utilisation 55.0 % (threshold 90.0 %)" in comm.evidence
    # largest saving first; those that cannot say follow, in rule order
    assert [f.rule for f in d.findings] == [
        "launch_bound",
        "communication",
        "fp32_compute",
        "transfer",
        "memory",
        "math_sdpa",
    ]


def test_time_another_finding_accounts_for_is_not_judged_again():
    ctx = RunContext(num_workers=0)
    [f] = diagnose(shares(data=0.5, forward=0.5), ctx).findings
    assert f.saving == 0.5
    [f] = diagnose(shares(data=0.5, forward=0.5), ctx, accounted=[("data", 0.3, "the validation finding")]).findings
    assert f.saving == pytest.approx(0.2) and "takes 20.0 % of the step" in f.evidence
    assert f.evidence.endswith("Not counted here: 30.0 % of the step, which the validation finding accounts for.")
    # below the threshold once the other finding's share is out: no finding
    assert diagnose(shares(data=0.5, forward=0.5), ctx, accounted=[("data", 0.45, "x")]).findings == []


def test_bottleneck_of():
    assert bottleneck_of(BALANCED) == "backward"
    assert bottleneck_of({}) is None
    assert bottleneck_of(shares()) is None


def test_context_round_trip():
    ctx = gpu(num_workers=3, sdpa_backend="flash")
    assert RunContext.from_dict(ctx.to_dict()) == ctx


def test_holding_back_is_the_finding_stage_else_the_largest():
    from lightning_accel.core.rules import Finding, holding_back

    shares = {"data": 0.34, "forward": 0.22, "backward": 0.41, "optimizer": 0.03}
    finding = Finding(rule="data_wait", stage="data", evidence="...", fix="...", value=0.34)
    assert holding_back(shares, [finding]) == "data"  # the data wait is what should not be there
    validation = Finding("validation_heavy", "validation", "...", "...", 0.4, kind="fit", saving=0.4)
    assert holding_back(shares, [validation, finding]) == "data"  # a fit phase is not a stage of the step
    assert holding_back(shares, []) == "backward"  # no finding: compute-bound
    assert holding_back({}, []) is None
