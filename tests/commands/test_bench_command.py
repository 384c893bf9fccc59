import pytest

from lightning_accel.cli import main
from lightning_accel.demo.bench import run_bench


def test_bench_prints_the_side_by_side_table(capsys):
    assert main(["bench", "--steps", "16", "--rounds", "1", "--compile-backend", "aot_eager", "--no-autopilot"]) == 0
    out = capsys.readouterr().out
    assert "vanilla Lightning: samples/s per round" in out and "recommended stack: samples/s per round" in out
    assert "vanilla vs recommended stack" in out and "MFU" in out and "Autopilot: samples/s" not in out


def test_bench_results_measure_every_variant():
    results = run_bench(steps=16, rounds=1, compile_backend="aot_eager", autopilot_budget=6.0)
    assert [r.name for r in results] == ["vanilla Lightning", "recommended stack", "Autopilot"]
    for r in results:
        assert r.samples_per_sec > 0 and r.peak_memory_bytes > 0 and len(r.rounds) == 1
        assert sum(r.shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert results[0].search_seconds is None and results[2].search_seconds > 0


def test_bench_rejects_bad_input(capsys):
    assert main(["bench", "--rounds", "0"]) == 2
    assert "--rounds must be an integer >= 1, got 0" in capsys.readouterr().err
