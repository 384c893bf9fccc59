"""The Autopilot's pure decisions with exact numbers: noise floor, keep rule, numerics guard, compile pay-back,
candidate order, the plan file and the configuration it renders."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_accel.core.autopilot import (
    DEFAULT_TOLERANCES,
    AutopilotPlan,
    ProbeResult,
    Tolerance,
    batch_digest,
    compare_probes,
    compile_pays_back,
    cosine,
    propose,
    relative_noise,
    render_python,
    render_yaml,
)


def test_relative_noise_is_the_spread_over_the_median() -> None:
    assert relative_noise([100.0, 110.0]) == pytest.approx(10 / 105)
    assert relative_noise([100.0, 90.0, 110.0]) == pytest.approx(20 / 100)
    assert relative_noise([100.0]) == 0.0
    assert relative_noise([]) == 0.0


def test_compile_pays_back_only_within_the_steps_left() -> None:
    ok, why = compile_pays_back(30.0, 0.10, 0.08, steps_left=2000)  # saves 40 s > 30 s
    assert ok and "saves 40.0 s" in why
    ok, why = compile_pays_back(30.0, 0.10, 0.08, steps_left=1000)  # saves 20 s < 30 s
    assert not ok and "less than the 30.0 s" in why
    assert not compile_pays_back(1.0, 0.10, 0.11, steps_left=10**6)[0]
    assert compile_pays_back(1.0, 0.10, 0.09, steps_left=None)[0]


def test_cosine_edge_cases() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert cosine(a, a.clone()) == 1.0
    assert cosine(a, -a) == pytest.approx(-1.0)
    assert cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert cosine(torch.zeros(3), a) == 0.0
    assert cosine(a, torch.ones(2)) == -1.0
    assert cosine(None, a) is None


def test_batch_digest_sees_every_byte() -> None:
    batch = {"x": torch.arange(6.0).reshape(2, 3), "y": (torch.tensor([1, 2]), "meta")}
    same = {"x": torch.arange(6.0).reshape(2, 3), "y": (torch.tensor([1, 2]), "other")}
    assert batch_digest(batch) == batch_digest(same)
    changed = {"x": torch.arange(6.0).reshape(2, 3), "y": (torch.tensor([1, 3]), "meta")}
    assert batch_digest(batch) != batch_digest(changed)
    assert batch_digest(torch.zeros(2, 3)) != batch_digest(torch.zeros(3, 2))


def _probe(losses, grad, update=None, digests=("a", "b")) -> ProbeResult:
    return ProbeResult(
        list(digests),
        list(losses),
        torch.tensor(grad, dtype=torch.float64),
        None if update is None else torch.tensor(update, dtype=torch.float64),
    )


def test_compare_probes_per_kind() -> None:
    ref = _probe([2.0, 2.5], [1.0, 0.0, 0.0], [0.1, 0.0, 0.0])
    assert compare_probes(ref, _probe([2.0, 2.5], [1.0, 0.0, 0.0], [0.1, 0.0, 0.0]), "data").ok
    other_batches = _probe([2.0, 2.5], [1.0, 0.0, 0.0], digests=("a", "c"))
    check = compare_probes(ref, other_batches, "data")
    assert not check.ok and "probe batch 1 differs" in check.reason
    # bf16-like: 0.5 % loss change, cosine 0.995 -> fine for low_precision, not for reorder
    bf16 = _probe([2.01, 2.5], [1.0, 0.1, 0.0], [0.1, 0.0, 0.0])
    assert compare_probes(ref, bf16, "low_precision").ok
    rejected = compare_probes(ref, bf16, "reorder")
    assert not rejected.ok and "loss differs by 5.00e-03" in rejected.reason and "gradient cosine" in rejected.reason
    assert rejected.loss_rel_diff == pytest.approx(0.005)
    flipped_update = compare_probes(ref, _probe([2.0, 2.5], [1.0, 0.0, 0.0], [-0.1, 0.0, 0.0]), "exact")
    assert not flipped_update.ok and "update cosine" in flipped_update.reason
    nan = compare_probes(ref, _probe([math.nan, 2.5], [1.0, 0.0, 0.0]), "low_precision")
    assert not nan.ok
    custom = Tolerance(0.1, 0.5, 0.5)
    assert compare_probes(ref, bf16, "reorder", custom).ok
    with pytest.raises(ValueError, match="kinds are"):
        compare_probes(ref, ref, "approximately")


def test_tolerance_validation() -> None:
    with pytest.raises(ValueError, match="max_loss_rel"):
        Tolerance(-1.0, 0.9, 0.9)
    with pytest.raises(ValueError, match="min_grad_cosine"):
        Tolerance(0.1, 2.0, 0.9)
    assert set(DEFAULT_TOLERANCES) == {"data", "exact", "reorder", "low_precision"}


def test_propose_orders_findings_then_the_bottleneck_stage() -> None:
    available = ["dataloader", "prefetch", "compile", "precision", "micro_batch", "optimizer_foreach"]
    assert propose(["data_wait"], "data", available, ()) == ["dataloader", "prefetch", "micro_batch"]
    assert propose(["data_wait"], "data", available, {"dataloader"}) == ["prefetch", "micro_batch"]
    # compute-bound, no finding: the compute fixes, in order
    assert propose([], "backward", available, ()) == ["precision", "compile", "micro_batch"]
    assert propose(["optimizer", "data_wait"], "optimizer", available, ()) == [
        "optimizer_foreach",
        "dataloader",
        "prefetch",
        "micro_batch",
    ]
    assert propose(["unknown_rule"], None, available, ()) == []
    # the fixes of the largest stage exhausted: the next stages' fixes, by share
    shares = {"data": 0.5, "optimizer": 0.3, "forward": 0.2}
    assert propose(["data_wait"], "data", available, {"dataloader", "prefetch", "micro_batch"}, shares) == [
        "optimizer_foreach",
        "precision",
        "compile",
    ]
    # a stage under 4.8 % of the step cannot yield a 5 % gain
    assert propose([], "forward", ["dataloader", "compile"], (), {"forward": 0.97, "data": 0.03}) == ["compile"]


def test_plan_round_trip_and_bad_files(tmp_path) -> None:
    plan = AutopilotPlan(
        kept=[{"name": "dataloader", "params": {"num_workers": 2}}],
        baseline_samples_per_sec=10.0,
        final_samples_per_sec=20.0,
        model="M",
    )
    path = plan.save(tmp_path / "sub" / "plan.json")
    loaded = AutopilotPlan.load(path)
    assert loaded.kept == plan.kept and loaded.final_samples_per_sec == 20.0 and loaded.model == "M"
    assert not list(path.parent.glob(".tmp-*"))  # written atomically
    with pytest.raises(ValueError, match="no such file"):
        AutopilotPlan.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        AutopilotPlan.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"findings": []}))
    with pytest.raises(ValueError, match="not an Autopilot plan"):
        AutopilotPlan.load(tmp_path / "other.json")
    (tmp_path / "old.json").write_text(json.dumps({"kept": [], "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        AutopilotPlan.load(tmp_path / "old.json")
    (tmp_path / "entry.json").write_text(json.dumps({"kept": [{"params": {}}], "version": 1}))
    with pytest.raises(ValueError, match=r"kept\[0\] needs a 'name'"):
        AutopilotPlan.load(tmp_path / "entry.json")


def test_render_yaml_merges_callbacks_and_nests_keys() -> None:
    text = render_yaml(
        [
            ("data.num_workers", 2),
            ("trainer.callbacks", [{"class_path": "lightning_accel.DevicePrefetcher"}]),
            ("trainer.accumulate_grad_batches", 2),
            (
                "trainer.callbacks",
                [{"class_path": "lightning_accel.TorchCompile", "init_args": {"mode": "max-autotune"}}],
            ),
            ("trainer.plugins", [{"class_path": "lightning_accel.AutoMixedPrecision", "init_args": {"dtype": "bf16"}}]),
        ]
    )
    assert text == (
        "data:\n"
        "  num_workers: 2\n"
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_accel.DevicePrefetcher\n"
        "    - class_path: lightning_accel.TorchCompile\n"
        "      init_args:\n"
        "        mode: max-autotune\n"
        "  accumulate_grad_batches: 2\n"
        "  plugins:\n"
        "    - class_path: lightning_accel.AutoMixedPrecision\n"
        "      init_args:\n"
        "        dtype: bf16\n"
    )
    assert render_yaml([]) == ""
    assert render_python(["a = 1", "b = 2", "a = 1"]) == "a = 1\nb = 2\n"


def test_rendered_yaml_parses_as_yaml() -> None:
    yaml = pytest.importorskip("yaml")
    text = render_yaml(
        [
            ("model.batch_size", 64),
            ("trainer.plugins", [{"class_path": "lightning_accel.AutoMixedPrecision", "init_args": {"dtype": "fp32"}}]),
            ("data.name", "a: b"),
        ]
    )
    assert yaml.safe_load(text) == {
        "model": {"batch_size": 64},
        "data": {"name": "a: b"},
        "trainer": {"plugins": [{"class_path": "lightning_accel.AutoMixedPrecision", "init_args": {"dtype": "fp32"}}]},
    }


def test_the_compute_attribution_replaces_the_priors_of_the_fixes_it_measured():
    from lightning_accel.core.autopilot import fix_gains, rank_by_expected_gain
    from lightning_accel.core.findings import Finding

    def compute(rule, saving):
        return Finding(rule, "forward", "e", "f", 0.5, kind="compute", saving=saving, module="m")

    found = [compute("python_loop", 0.2), compute("unfused_elementwise", 0.15), compute("eager_attention", 0.05)]
    found.append(Finding("optimizer", "optimizer", "e", "f", 0.3, saving=0.9))  # a stage finding: no measured gain
    gains = fix_gains(found)
    assert gains == pytest.approx({"compile": 0.35, "fused_attention": 0.05})
    shares = {"forward": 0.4, "backward": 0.5, "optimizer": 0.1}
    names = ["precision", "tf32", "fused_attention", "compile"]
    # priors on a GPU: precision 0.36, tf32 0.27, fused attention 0.225, compile 0.18
    assert rank_by_expected_gain(names, shares, "cuda") == ["precision", "tf32", "fused_attention", "compile"]
    assert rank_by_expected_gain(names, shares, "cuda", gains) == ["precision", "compile", "tf32", "fused_attention"]
    assert fix_gains([compute("python_loop", 0.7), compute("unfused_elementwise", 0.7)]) == {"compile": 0.95}
