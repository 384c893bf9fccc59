"""``lightning-accel scaling``: the report from two measurements, bad input, and a real 1 -> 2 process run."""

from __future__ import annotations

import json

import pytest

from lightning_accel.cli import main
from lightning_accel.commands.scaling import scaling_report
from lightning_accel.core.scaling import INTERCONNECTS, Interconnect, ScalingWorkload, fit_interconnect, project_scaling

SHAPES = [[1024, 1024], [1024], [4096, 1024], [1024, 4096]]  # 9.4 M parameters


def _runs(thr_1: float, thr_n: float, step_1: float, step_n: float, comm: float | None) -> tuple[dict, dict]:
    one = {
        "devices": 1,
        "strategy": "ddp",
        "samples_per_sec": thr_1,
        "step_s": step_1,
        "param_shapes": SHAPES,
        "comm_share": None,
        "allreduce": None,
    }
    probe = {"sizes": [1e4, 1e6, 1e7], "seconds": [2e-4 + s / 1e9 for s in (1e4, 1e6, 1e7)]}  # 1 GB/s, 100 µs
    many = {**one, "devices": 2, "samples_per_sec": thr_n, "step_s": step_n, "comm_share": comm, "allreduce": probe}
    return one, many


def test_report_efficiency_validation_and_projection():
    one, many = _runs(100.0, 150.0, 0.16, 0.2133, 0.2)
    report = scaling_report(
        one,
        many,
        project=[8, 64],
        interconnect=INTERCONNECTS["infiniband_ndr"],
        tp_size=8,
        n_layer=4,
        d_model=1024,
        tokens_per_step=2048,
    )
    assert report["efficiency"] == pytest.approx(0.75)  # 150 / (2 x 100)
    assert report["overhead_share"] == pytest.approx(1 - 0.16 / 0.2133)
    assert report["params"] == 1024 * 1024 + 1024 + 2 * 4096 * 1024
    # the model check uses the link fitted from the probe, for the strategy that ran
    link = fit_interconnect(many["allreduce"]["sizes"], many["allreduce"]["seconds"], 2)
    assert report["measured_link"]["bandwidth_gbs"] == pytest.approx(1.0)
    (expected,) = project_scaling(
        ScalingWorkload(compute_s=0.16, params=report["params"], n_layers=4, hidden_size=1024, tokens_per_step=2048),
        link,
        n=[2],
        strategies=["ddp"],
    )
    assert report["predicted_efficiency"] == pytest.approx(expected.efficiency)
    assert report["measured_exposed_s"] == pytest.approx(0.2 * 0.2133)
    strategies = {p["strategy"] for p in report["projection"]}
    assert strategies == {"ddp", "ddp_bf16_compress", "ddp_powersgd", "zero1", "zero2", "zero3", "tp", "pp"}
    assert {p["n"] for p in report["projection"]} == {8, 64}
    # 20 % of the step is exposed all-reduce, of 25 % lost: communication it is, and the fixes say how
    assert report["fixes"][0].startswith(
        "measured efficiency 75% at 2 processes: the 2-process step is 25% longer, "
        "mostly exposed all-reduce (20% of the step)"
    )
    assert "ddp_bf16_compress" in report["fixes"][0]


def test_a_pp_run_is_checked_against_the_pipeline_model_at_n():
    one, many = _runs(100.0, 80.0, 0.16, 0.2, None)
    many["strategy"] = "pp"
    report = scaling_report(
        one,
        many,
        project=[8],
        interconnect=INTERCONNECTS["infiniband_ndr"],
        tp_size=8,
        n_layer=4,
        d_model=1024,
        tokens_per_step=2048,
    )
    link = fit_interconnect(many["allreduce"]["sizes"], many["allreduce"]["seconds"], 2)
    (expected,) = project_scaling(
        ScalingWorkload(compute_s=0.16, params=report["params"], n_layers=4, hidden_size=1024, tokens_per_step=2048),
        link,
        n=[2],
        strategies=["pp"],
        tp_size=1,
        pp_size=2,
        microbatches=2,
    )
    assert expected.pp_size == 2 and expected.tp_size == 1
    assert report["predicted_efficiency"] == pytest.approx(expected.efficiency)


def test_low_efficiency_without_communication_blames_compute_or_a_straggler():
    one, many = _runs(100.0, 150.0, 0.16, 0.2133, 0.05)
    report = scaling_report(
        one, many, project=[8], interconnect="nvlink", tp_size=8, n_layer=4, d_model=1024, tokens_per_step=2048
    )
    assert "exposed all-reduce is only 5% of it" in report["fixes"][0] and "straggler" in report["fixes"][0]
    one, many = _runs(100.0, 150.0, 0.16, 0.2133, None)
    report = scaling_report(
        one, many, project=[8], interconnect="nvlink", tp_size=8, n_layer=4, d_model=1024, tokens_per_step=2048
    )
    assert "communication was not timed under ddp" in report["fixes"][0]


def test_fixes_name_a_better_strategy_and_accumulation_when_ddp_projects_low():
    one, many = _runs(100.0, 190.0, 0.01, 0.0105, None)  # a short step: communication dominates at scale
    slow = Interconnect("slow", 1e9, 1e-5)
    report = scaling_report(
        one, many, project=[512], interconnect=slow, tp_size=8, n_layer=4, d_model=1024, tokens_per_step=2048
    )
    assert report["efficiency"] == pytest.approx(0.95) and "predicted_efficiency" in report
    assert "measured_exposed_s" not in report  # the doctor did not time communication
    text = "\n".join(report["fixes"])
    assert "at 512 devices ddp projects" in text and "ddp_powersgd" in text
    assert "accumulate_grad_batches=4" in text and "choose a stage for memory, not speed" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--project", "0,8"], "device counts must be integers >= 1"),
        (["--project", "eight"], "give device counts separated by commas"),
        (["--interconnect", "myrinet"], "unknown interconnect 'myrinet': use one of nvlink, infiniband_ndr"),
        (["--devices", "1"], "compare 1 with N >= 2 processes"),
        (["--strategy", "ddp_fp8"], "--strategy 'ddp_fp8' is not a registered strategy"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["scaling", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.distributed
def test_scaling_one_to_two_processes(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    assert (
        main(
            [
                "scaling",
                "--steps",
                "14",
                "--batch-size",
                "8",
                "--n-layer",
                "2",
                "--d-model",
                "64",
                "--window",
                "4",
                "--project",
                "8,64,512",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    assert (tmp_path / "s.png").stat().st_size > 0
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "measured: demo GPT, 1 vs 2 processes (ddp)" in text and "projected efficiency on infiniband_ndr" in text
    assert report["devices"] == 2 and report["throughput_1"] > 0 and report["throughput_n"] > 0
    assert report["efficiency"] == pytest.approx(report["throughput_n"] / (2 * report["throughput_1"]))
    assert report["comm_share"] is not None and 0 < report["comm_share"] < 1  # the doctor timed DDP's all-reduce
    assert report["measured_link"]["bandwidth_gbs"] > 0 and 0 < report["predicted_efficiency"] <= 1
    assert {p["n"] for p in report["projection"]} == {8, 64, 512}
