import json

import pytest

from lightning_accel.core.report import DoctorReport, compare, plot_timeline
from lightning_accel.core.rules import STAGES, Finding, RunContext, SkippedRule


def make(bottleneck="data", data=0.46, sps=100.0, mfu=0.1, findings=True):
    shares = dict.fromkeys(STAGES, 0.0)
    shares.update(data=data, forward=(1 - data) * 0.4, backward=(1 - data) * 0.6)
    step = 0.05
    return DoctorReport(
        bottleneck=bottleneck,
        shares=shares,
        stage_seconds={k: v * step for k, v in shares.items()},
        step_seconds=step,
        batches=40,
        windows=2,
        world_size=1,
        samples_per_sec=sps,
        mfu=mfu,
        utilisation={"cpu_process_pct": 98.0, "cpu_workers_pct": 0.0},
        findings=[Finding("data_wait", "data", "waiting 46 %", "DataLoader(num_workers=4)", data)] if findings else [],
        skipped=[SkippedRule("gpu_utilisation", "no GPU in use")],
        context=RunContext(device_type="cpu", num_workers=0, device_capability=(8, 0)),
        precision={"loss_scale": 65536.0, "skipped_steps": 1, "total_steps": 40},
        timeline=[
            {"batch": 20, "shares": shares, "step_seconds": step},
            {"batch": 40, "shares": shares, "step_seconds": step},
        ],
        notes=["a note"],
        thresholds={"data_share": 0.1},
    )


def test_json_round_trip(tmp_path):
    report = make()
    path = report.save(tmp_path / "sub" / "r.json")
    loaded = DoctorReport.load(path)
    assert loaded == report
    assert json.loads(path.read_text())["version"] == 1
    assert not list(path.parent.glob(".*tmp"))  # no temporary left behind


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        DoctorReport.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        DoctorReport.load(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="other.json: not a BottleneckDoctor report"):
        DoctorReport.load(other)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**make().to_dict(), "bottleneck": "decode"}))
    with pytest.raises(ValueError, match="wrong.json: bottleneck 'decode'"):
        DoctorReport.load(wrong)


def test_compare_says_the_bottleneck_moved():
    before = make()
    after = make(bottleneck="backward", data=0.04, sps=180.0, mfu=0.2, findings=False)
    after.step_seconds = 0.03
    text = "\n".join(compare(after, before))
    assert "data             46.0 % →    4.0 %" in text
    assert "bottleneck moved: data 46.0 % → 4.0 %; the run is now compute-bound (backward 57.6 %)" in text
    assert "throughput: 100.0 → 180.0 samples/s (1.80x)" in text
    assert "MFU: 10.0 % → 20.0 %" in text
    assert "1.67x faster per batch" in text
    assert "resolved findings: data_wait (data 46.0 % → 4.0 %)" in text
    same = "\n".join(compare(make(), make()))
    assert "bottleneck unchanged" in same


def test_compare_with_a_too_short_report():
    empty = DoctorReport(notes=["too little data to diagnose"])
    text = "\n".join(compare(empty, make()))
    assert "measured too little" in text and "too little data" in text
    assert "throughput: not measured in both reports" in text


def test_table_renders_stages_findings_and_notes():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(make().table())
    out = console.export_text()
    assert "bottleneck: data" in out and "46.0 %" in out and "fix: DataLoader(num_workers=4)" in out
    assert "skipped rules: gpu_utilisation (no GPU in use)" in out and "note: a note" in out
    assert "loss_scale=65536.0" in out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_timeline(make(), tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_timeline(DoctorReport(), tmp_path / "x.png")


def test_plot_without_matplotlib_raises_with_the_install_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"lightning-accel\[plots\]"):
        plot_timeline(make(), tmp_path / "r.png")


def test_v2_fields_round_trip_show_in_the_table_and_compare(tmp_path):
    from rich.console import Console

    fit = {
        "seconds": {"startup": 1.0, "train": 4.0, "validation": 5.0, "checkpoint": 0.0, "other": 0.0},
        "wall": 10.0,
        "counts": {"validation": 9, "sanity_check": 0, "checkpoint": 0},
        "sanity_seconds": 0.0,
        "train_batches": 90,
    }
    heavy = Finding(
        "validation_heavy", "validation", "validation takes 5.00 s", "Trainer(val_check_interval=95)", 0.55, kind="fit"
    )
    smell = Finding("optimizer_not_foreach", "optimizer", "Adam loops", "fused=True", 3.0, gain=3.0, kind="smell")
    before = make()
    before.fit, before.fit_findings, before.smells = fit, [heavy], [smell]
    before.rank_stage_seconds = [dict.fromkeys(STAGES, 0.001), dict.fromkeys(STAGES, 0.002)]
    before.variability = [{"step_p5": 0.01, "step_p50": 0.011, "step_p95": 0.03, "spikes": 3.0}]
    before.smells_skipped = [SkippedRule("tf32_off", "no GPU in use")]
    loaded = DoctorReport.load(before.save(tmp_path / "v2.json"))
    assert loaded == before and loaded.smells[0].gain == 3.0 and loaded.fit_findings[0].kind == "fit"
    console = Console(width=160, record=True)
    console.print(loaded.table())
    text = console.export_text()
    for needle in (
        "whole fit: 10.00 s",
        "validation",
        "50.0 %",
        "per rank (ms / batch)",
        "p95 30.00 ms",
        "code smells (before the first step)",
        "previewed 3.00x",
        "fit 1. [validation]",
    ):
        assert needle in text, needle
    after = make(data=0.04, findings=False)
    after.fit = {**fit, "seconds": {**fit["seconds"], "validation": 0.2, "train": 4.0}, "wall": 5.2}
    lines = compare(after, before)
    [fit_line] = [line for line in lines if line.startswith("whole fit 10.00 s → 5.20 s: ")]
    assert "validation 50.0 % → 3.8 %" in fit_line
    assert "resolved fit findings: validation_heavy" in lines and "resolved code smells: optimizer_not_foreach" in lines
