"""build_report: windows of two ranks + fit phases + smells → one report, without a Trainer."""

import pytest

from lightning_accel.core.breakdown import ROW_FIELDS, Breakdown
from lightning_accel.core.phases import FitBreakdown
from lightning_accel.core.rules import Diagnosis, Finding, RunContext, Thresholds
from lightning_accel.core.variability import summarise_window
from lightning_accel.core.verdict import build_report


def row(wall, **seconds):
    values = {
        "wall": wall,
        "data": 0.0,
        "transfer": 0.0,
        "forward": 0.0,
        "backward": 0.0,
        "optimizer": 0.0,
        "communication": 0.0,
        "samples": 80,
        "batches": 10,
        **seconds,
    }
    return [values[f] for f in ROW_FIELDS]


def test_two_ranks_with_a_slow_data_rank():
    bd = Breakdown()
    for _ in range(3):  # rank 1 waits 16 ms per batch for data; rank 0 waits for it in the all-reduce
        bd.add(
            [
                row(0.23, data=0.005, forward=0.02, backward=0.205, communication=0.165),
                row(0.23, data=0.165, forward=0.02, backward=0.045, communication=0.005),
            ]
        )
    steps = [0.023] * 9 + [0.09]
    var = [[summarise_window(steps, [0.001] * 10, first_batch=10 * w) for w in range(3)] for _ in range(2)]
    fit = FitBreakdown(
        seconds={"startup": 1.0, "train": 0.69, "validation": 3.0, "checkpoint": 0.0, "other": 0.0},
        wall=4.69,
        counts={"validation": 3},
        train_batches=30,
    )
    smells = Diagnosis(
        findings=[Finding("tf32_off", "forward", "fp32", "set_float32_matmul_precision", 1.0, kind="smell")]
    )
    report = build_report(
        bd,
        context=RunContext(world_size=2, communication_measured=True),
        thresholds=Thresholds(),
        world_size=2,
        fit=fit,
        smells=smells,
        variability_rows=var,
        window=10,
    )
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


def windows(n, steady, spike, where, batches=10):
    """``n`` windows of ``batches`` batches, every one ``steady`` (stage → seconds) but the batch at index ``where``
    of each window, which is ``spike``: the breakdown and the variability rows of one rank."""
    bd, var = Breakdown(), []
    for w in range(n):
        per_batch = [spike if i == where else steady for i in range(batches)]
        stages = {s: sum(b.get(s, 0.0) for b in per_batch) for s in ("data", "forward", "backward", "other")}
        steps = [sum(b.values()) for b in per_batch]
        bd.add(
            [row(sum(steps), batches=batches, samples=8 * batches, **{s: v for s, v in stages.items() if s != "other"})]
        )
        var.append(summarise_window(steps, [b.get("data", 0.0) for b in per_batch], first_batch=batches * w))
    return bd, [var]


def fit_of(train, startup=0.5, validation=0.0, checkpoint=0.0, other=0.0, counts=None, batches=100):
    seconds = {"startup": startup, "train": train, "validation": validation, "checkpoint": checkpoint, "other": other}
    return FitBreakdown(seconds=seconds, wall=sum(seconds.values()), counts=counts or {}, train_batches=batches)


def test_the_validation_tail_joins_its_finding_and_the_order_follows_what_each_fix_saves():
    # every batch waits 4 ms for data; the batch after each validation run (every 10) waits 40 ms more: the validation
    # DataLoader's workers starting. Fit after start-up 2 s: training 1.4 s, validation 0.3 s, checkpoints 0.3 s
    bd, var = windows(
        10,
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        {"data": 0.044, "forward": 0.003, "backward": 0.003},
        where=9,
    )
    fit = fit_of(1.4, validation=0.3, checkpoint=0.3, counts={"validation": 10, "checkpoint": 3})
    ctx = RunContext(world_size=1, num_workers=0, val_check_interval=10)
    report = build_report(bd, context=ctx, thresholds=Thresholds(), fit=fit, variability_rows=var)
    assert report.shares["data"] == pytest.approx(0.8 / 1.4)  # the measurement itself is left as it is
    # validation: its 0.3 s plus the 0.4 s of slow batches after it (35 % of the fit, alone 15 %: under 20 %);
    # the data wait: 4 ms of every 14 ms batch, 1.4 s of the 2 s fit (0.2); checkpoints 0.3 s (0.15)
    assert [(f.rule, round(f.saving, 6)) for f in report.findings] == [
        ("validation_heavy", 0.35),
        ("data_wait", 0.2),
        ("checkpoint_heavy", 0.15),
    ]
    validation, data, _ = report.findings
    assert (
        "0.40 s of it are the 10 training batch(es) that ran slow right after a validation run" in validation.evidence
    )
    assert "Not counted here: 28.6 % of the step, which the validation finding accounts for." in data.evidence
    assert report.bottleneck == "data" and [f.rule for f in report.fit_findings] == [
        "validation_heavy",
        "checkpoint_heavy",
    ]


def test_checkpoint_spikes_stay_one_finding_whether_or_not_the_phase_crosses_its_threshold():
    # the batch after each save (every 5 steps) takes 30 ms longer, outside any measured stage
    bd, var = windows(
        10,
        {"data": 0.001, "forward": 0.0045, "backward": 0.0045},
        {"data": 0.001, "forward": 0.0045, "backward": 0.0045, "other": 0.03},
        where=4,
        batches=5,
    )
    ctx = RunContext(world_size=1, checkpoint_every_n_train_steps=5, async_checkpoint=True)
    # with the 0.3 s of spikes the 0.02 s of saves are 0.32 s of a 3.02 s fit: over the 10 % threshold
    report = build_report(
        bd,
        context=ctx,
        thresholds=Thresholds(),
        fit=fit_of(0.8, checkpoint=0.02, other=2.2, counts={"checkpoint": 10}, batches=50),
        variability_rows=var,
    )
    assert [(f.rule, round(f.saving, 6)) for f in report.findings] == [("checkpoint_heavy", round(0.32 / 3.02, 6))]
    assert "0.30 s of it are the 10 training batch(es) that ran slow right after a save" in report.findings[0].evidence
    # of a 4.02 s fit they stay under it: the spikes are one step_variability finding that names the saves
    report = build_report(
        bd,
        context=ctx,
        thresholds=Thresholds(),
        fit=fit_of(0.8, checkpoint=0.02, other=3.2, counts={"checkpoint": 10}, batches=50),
        variability_rows=var,
    )
    [finding] = report.findings
    assert finding.rule == "step_variability" and "ModelCheckpoint(every_n_train_steps=5)" in finding.fix
    assert finding.saving == pytest.approx(0.3 / 0.8 * 0.8 / 4.02)  # the spikes' share of the step, of the fit


def test_bursty_data_stalls_join_the_data_wait_they_are_part_of():
    bd, var = Breakdown(), [[]]
    for w, where in enumerate((1, 7, 4, 2, 9)):  # one batch in each window waits 30 ms more, at no fixed interval
        data = [0.033 if i == where else 0.003 for i in range(10)]
        steps = [d + 0.007 for d in data]
        bd.add([row(sum(steps), data=sum(data), forward=0.035, backward=0.035)])
        var[0].append(summarise_window(steps, data, first_batch=10 * w))
    report = build_report(
        bd,
        context=RunContext(world_size=1, num_workers=2, prefetch_factor=2),
        thresholds=Thresholds(),
        fit=fit_of(0.65, batches=50),
        variability_rows=var,
    )
    [finding] = report.findings  # 60 ms of data wait in each 130 ms window, spikes included, once
    assert finding.rule == "data_wait" and finding.saving == pytest.approx(0.06 / 0.13)
    assert "Its batch times vary too" in finding.evidence and "bursty data stalls" in finding.evidence
    assert "For the slow batches: prefetch deeper" in finding.fix


def test_a_finding_measured_outside_the_breakdown_takes_its_place_by_saving():
    from lightning_accel.core.verdict import place_finding

    bd, var = windows(
        4,
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        where=0,
    )
    report = build_report(
        bd,
        context=RunContext(world_size=1, num_workers=0),
        thresholds=Thresholds(),
        fit=fit_of(0.4, validation=0.4, counts={"validation": 2}, batches=40),
        variability_rows=var,
    )
    assert [f.rule for f in report.findings] == ["validation_heavy", "data_wait"]  # 0.5 and 0.4 x 0.5 = 0.2
    bubble = Finding("pipeline_bubble", "forward", "idle", "more micro-batches", 0.6, saving=0.6)
    place_finding(report, bubble)  # 60 % of the step is 30 % of the fit
    assert [(f.rule, round(f.saving, 6)) for f in report.findings] == [
        ("validation_heavy", 0.5),
        ("pipeline_bubble", 0.3),
        ("data_wait", 0.2),
    ]


def test_the_table_lists_each_finding_once_with_its_saving_and_compare_keeps_the_fit_apart():
    from rich.console import Console

    from lightning_accel.core.report import DoctorReport, compare

    bd, var = windows(
        4,
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        where=0,
    )
    report = build_report(
        bd,
        context=RunContext(world_size=1, num_workers=0),
        thresholds=Thresholds(),
        fit=fit_of(0.4, validation=0.4, counts={"validation": 2}, batches=40),
        variability_rows=var,
    )
    loaded = DoctorReport.from_dict(report.to_dict())
    assert loaded.findings == report.findings and loaded.findings[0].saving == pytest.approx(0.5)
    console = Console(width=240, record=True)
    console.print(loaded.table())
    text = console.export_text()
    assert "1. [validation] (saves up to 50.0 % of the fit) validation takes" in text
    assert "2. [data] (saves up to 20.0 % of the fit) waiting for the next batch" in text
    assert "fit 1." not in text  # not listed a second time
    lines = compare(DoctorReport(bottleneck="forward", shares={"forward": 1.0}), loaded)
    assert "resolved findings: data_wait (data 40.0 % → n/a)" in lines
    assert "resolved fit findings: validation_heavy" in lines


def test_a_validation_tail_under_the_threshold_stays_one_variability_finding_that_names_validation():
    # the batch after each validation run waits 12 ms more: with its 0.1 s of runs, 0.22 s of a 2.02 s fit (under
    # 20 %), so the spikes stay a step_variability finding, which names validation, not bursty data stalls
    bd, var = windows(
        10,
        {"data": 0.004, "forward": 0.003, "backward": 0.003},
        {"data": 0.016, "forward": 0.003, "backward": 0.003},
        where=9,
    )
    fit = fit_of(1.12, validation=0.1, other=0.8, counts={"validation": 10})
    report = build_report(
        bd,
        context=RunContext(world_size=1, num_workers=0, val_check_interval=10),
        thresholds=Thresholds(),
        fit=fit,
        variability_rows=var,
    )
    assert [f.rule for f in report.findings] == ["data_wait", "step_variability"]
    data, varied = report.findings
    assert varied.stage == "data" and "Trainer(val_check_interval=10)" in varied.fix
    assert "bursty" not in varied.evidence
    assert varied.saving == pytest.approx(0.12 / 2.02)
    assert data.saving == pytest.approx((0.52 - 0.12) / 2.02)
    assert "which the step_variability finding accounts for" in data.evidence
