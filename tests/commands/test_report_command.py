import pytest

from lightning_accel.cli import main
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import STAGES, Finding


def saved(path, *, bottleneck, data, step, sps, mfu, findings=()):
    shares = dict.fromkeys(STAGES, 0.0)
    shares.update(data=data, forward=(1 - data) / 2, backward=(1 - data) / 2)
    report = DoctorReport(
        bottleneck=bottleneck,
        shares=shares,
        step_seconds=step,
        stage_seconds={k: v * step for k, v in shares.items()},
        batches=40,
        windows=2,
        samples_per_sec=sps,
        mfu=mfu,
        findings=list(findings),
    )
    return report.save(path)


def test_report_with_baseline_shows_what_changed(tmp_path, capsys):
    slow = Finding(
        "data_wait",
        "data",
        "waiting for the next batch takes 46.0 % of the step time.",
        "DataLoader(num_workers=4)",
        0.46,
    )
    old = saved(tmp_path / "old.json", bottleneck="data", data=0.46, step=0.1, sps=320.0, mfu=0.1, findings=[slow])
    new = saved(tmp_path / "new.json", bottleneck="forward", data=0.04, step=0.058, sps=551.7, mfu=0.17)
    assert main(["report", str(new), "--baseline", str(old)]) == 0
    out = capsys.readouterr().out
    assert f"{old} → {new}" in out
    assert "data             46.0 % →    4.0 %" in out
    assert "throughput: 320.0 → 551.7 samples/s (1.72x)" in out
    assert "MFU: 10.0 % → 17.0 %" in out
    assert "bottleneck moved: data 46.0 % → 4.0 %; the run is now compute-bound (forward 48.0 %)" in out
    assert "resolved findings: data_wait (data 46.0 % → 4.0 %)" in out


def test_report_without_baseline_prints_the_table(tmp_path, capsys):
    path = saved(tmp_path / "r.json", bottleneck="data", data=0.5, step=0.1, sps=100.0, mfu=None)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "BottleneckDoctor report" in out and "bottleneck: data" in out and "50.0 %" in out


def test_report_errors_name_the_file(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    good = saved(tmp_path / "good.json", bottleneck="data", data=0.5, step=0.1, sps=1.0, mfu=None)
    assert main(["report", str(good), "--baseline", str(bad)]) == 2
    assert "bad.json: not a BottleneckDoctor report" in capsys.readouterr().err


def test_report_is_listed_in_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "report" in capsys.readouterr().out
