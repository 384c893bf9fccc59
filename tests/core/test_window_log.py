"""The doctor's window log and the live view ``lightning-accel watch`` draws from it."""

import json

import pytest
from rich.console import Console

from lightning_accel.core.window_log import (
    LiveState,
    WindowLogReader,
    WindowLogWriter,
    find_window_log,
    render_live,
)


def window(batch, data=0.5, findings=()):
    return {
        "event": "window",
        "batch": batch,
        "shares": {"data": data, "forward": 1 - data},
        "step_ms": 20.0,
        "samples_per_sec": 400.0 + batch,
        "mfu": 0.12,
        "findings": list(findings),
    }


def test_the_reader_returns_each_complete_line_once_and_waits_for_a_partial_one(tmp_path):
    path = tmp_path / "r.windows.jsonl"
    reader = WindowLogReader(path)
    assert reader.read_events() == []  # not written yet
    line = json.dumps(window(4)) + "\n"
    path.write_text(json.dumps({"event": "start", "world_size": 2}) + "\n" + line[:10])
    assert [e["event"] for e in reader.read_events()] == ["start"]
    with open(path, "a") as fh:
        fh.write(line[10:])
    assert [e["batch"] for e in reader.read_events()] == [4]
    assert reader.read_events() == []


def test_the_writer_starts_a_new_log_per_fit_and_flushes_each_line(tmp_path):
    path = tmp_path / "sub" / "r.windows.jsonl"
    path.parent.mkdir()
    path.write_text("an old fit's line\n")
    writer = WindowLogWriter(path)
    writer.write("start", world_size=1)
    writer.write("window", **{k: v for k, v in window(4).items() if k != "event"})
    events = WindowLogReader(path).read_events()  # flushed: visible before close
    assert [e["event"] for e in events] == ["start", "window"]
    writer.close()
    writer.write("window", batch=8)  # after close: nothing, no error
    assert len(path.read_text().splitlines()) == 2


def test_the_state_follows_start_windows_and_end():
    state = LiveState()
    for event in [
        {"event": "start", "world_size": 2},
        window(4),
        window(8),
        {"event": "end", "status": "finished", "report": "r.html"},
    ]:
        state.apply(event)
    assert state.world_size == 2 and [w["batch"] for w in state.windows] == [4, 8]
    assert state.ended and state.status == "finished" and state.report == "r.html"


def test_the_view_shows_the_latest_window_its_findings_and_the_end():
    state = LiveState()
    finding = {"stage": "data", "rule": "data_wait", "evidence": "waiting 50 %", "fix": "DataLoaderTuner()"}
    for event in [{"event": "start", "world_size": 1}, window(4, data=0.2), window(8, data=0.5, findings=[finding])]:
        state.apply(event)
    console = Console(width=120, record=True)
    console.print(render_live(state, "run"))
    text = console.export_text()
    assert "window 2 (batch 8" in text and "50.0 %" in text and "20.0 %" not in text
    assert "MFU 12.0 %" in text and "408.0 samples/s" in text
    assert "waiting 50 % Fix: DataLoaderTuner()" in text
    state.apply({"event": "end", "status": "finished", "report": "r.html"})
    console = Console(width=120, record=True)
    console.print(render_live(state, "run"))
    assert "fit finished; report: r.html" in console.export_text()


def test_the_newest_log_under_a_folder_is_followed(tmp_path):
    import os

    old, new = tmp_path / "version_0" / "a.windows.jsonl", tmp_path / "version_1" / "b.windows.jsonl"
    for i, p in enumerate((old, new)):
        p.parent.mkdir()
        p.write_text("")
        os.utime(p, (1000 + i, 1000 + i))
    assert find_window_log(tmp_path) == new
    assert find_window_log(old) == old
    assert find_window_log(tmp_path / "version_0" / "..") is not None
    with pytest.raises(FileNotFoundError, match="no such folder"):
        find_window_log(tmp_path / "missing")
