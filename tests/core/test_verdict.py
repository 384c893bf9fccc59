"""build_report: windows of two ranks + fit phases + smells → one report, without a Trainer."""

import pytest

from lightning_accel.core.breakdown import ROW_FIELDS, Breakdown
from lightning_accel.core.phases import FitBreakdown
from lightning_accel.core.rules import Diagnosis, Finding, RunContext, Thresholds
from lightning_accel.core.variability import summarise_window
from lightning_accel.core.verdict import build_report


def row(wall, **seconds):
    values = {"wall": wall, "data": 0.0, "transfer": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0,
              "communication": 0.0, "samples": 80, "batches": 10, **seconds}
    return [values[f] for f in ROW_FIELDS]


def test_two_ranks_with_a_slow_data_rank():
    bd = Breakdown()
    for _ in range(3):  # rank 1 waits 16 ms per batch for data; rank 0 waits for it in the all-reduce
        bd.add([row(0.23, data=0.005, forward=0.02, backward=0.205, communication=0.165),
                row(0.23, data=0.165, forward=0.02, backward=0.045, communication=0.005)])
    steps = [0.023] * 9 + [0.09]
    var = [[summarise_window(steps, [0.001] * 10, first_batch=10 * w) for w in range(3)] for _ in range(2)]
    fit = FitBreakdown(seconds={"startup": 1.0, "train": 0.69, "validation": 3.0, "checkpoint": 0.0, "other": 0.0},
                       wall=4.69, counts={"validation": 3}, train_batches=30)
    smells = Diagnosis(findings=[Finding("tf32_off", "forward", "fp32", "set_float32_matmul_precision", 1.0,
                                         kind="smell")])
    report = build_report(bd, context=RunContext(world_size=2, communication_measured=True),
                          thresholds=Thresholds(), world_size=2, fit=fit, smells=smells, variability_rows=var,
                          window=10)
    rules = [f.rule for f in report.findings]
    assert "straggler" in rules and "communication" not in rules and report.bottleneck == "data"
    assert len(report.rank_stage_seconds) == 2
    assert report.rank_stage_seconds[1]["data"] == pytest.approx(0.0165)
    assert [f.rule for f in report.fit_findings] == ["validation_heavy"]
    assert report.smells[0].rule == "tf32_off"
    assert len(report.variability) == 2 and report.variability[0]["spikes"] == 3


def test_nothing_measured_gives_the_note():
    report = build_report(Breakdown(), context=RunContext(), thresholds=Thresholds(), empty_note="too little")
    assert report.bottleneck is None and report.notes == ["too little"] and report.fit == {}
