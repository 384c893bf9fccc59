"""The doctor's measuring object without a Trainer: the moments of planted steps on a fake clock, the windows and
their gather over ranks, the pauses, a measuring problem, the window log and the report."""

import json
import math

import pytest
import torch
from torch import nn

from lightning_accel.callbacks.doctor.live_log import LiveLog
from lightning_accel.callbacks.doctor.measure import DoctorMeasure
from lightning_accel.core.rules import RunContext
from lightning_accel.core.window_row import RankWindow

# seconds each stage of a planted batch takes on the fake clock
PLANT = {"data": 1.0, "forward": 2.0, "backward": 3.0, "optimizer": 4.0}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def started(clock, *, window=2, skip=1, live_log=None):
    m = DoctorMeasure(window=window, clock=clock, smells=False, attribute_compute=False, live_log=live_log)
    m.setup_fit()
    m.start_fit(
        nn.Linear(2, 2),
        device=torch.device("cpu"),
        skip=skip,
        context=RunContext(device_type="cpu", world_size=1),
        utilisation=False,
    )
    m.train_start()
    m.epoch_start()
    m.open_data_wait()
    return m


def batch(m, clock, plant=PLANT):
    """One automatic-optimization batch, the moments in the order Lightning's hooks and the timers run them;
    returns what :meth:`DoctorMeasure.batch_end` asks for."""
    module = nn.Linear(2, 2)
    clock.now += plant["data"]
    m.batch_start(module)
    clock.now += plant["forward"]
    m.backward_start()
    clock.now += plant["backward"]
    m.backward_end(module)
    m.optimizer_step_start()
    m.before_optimizer_step_hook(None, (), {})
    clock.now += plant["optimizer"]
    m.after_optimizer_step(None, (), {})
    due = m.batch_end(torch.zeros(4, 2))
    return due


def test_the_planted_stages_are_the_windows_shares_and_the_reports():
    clock = Clock()
    m = started(clock)
    dues = []
    for _ in range(5):
        dues.append(batch(m, clock))
        if dues[-1] == "window":
            closed = m.close_window(None)
        m.next_batch(lambda: None)
    # batch 1 is the warm-up; the window of 2 fills at batches 3 and 5
    assert dues == [None, None, "window", None, "window"]
    total = sum(PLANT.values())
    for stage, seconds in PLANT.items():
        assert closed.metrics[f"doctor/share_{stage}"] == pytest.approx(seconds / total)
    assert closed.metrics["doctor/step_ms"] == pytest.approx(1e3 * total)
    assert closed.findings is not None
    report = m.report(world_size=1)
    assert report.bottleneck == "optimizer"
    assert report.shares["optimizer"] == pytest.approx(0.4)
    assert report.batches == 4
    assert report.fit["seconds"]["startup"] == pytest.approx(total)  # the warm-up batch
    assert report.fit["seconds"]["train"] == pytest.approx(4 * total)


def test_a_window_gathers_every_ranks_row_once_and_leaves_an_unmeasured_rank_out():
    clock = Clock()
    m = started(clock)
    for _ in range(3):
        batch(m, clock)
    calls = []

    def gather(row):
        calls.append(list(row))
        return [row, RankWindow.unmeasured().to_floats()]  # rank 1's measuring broke: a row of NaN

    closed = m.close_window(gather)
    assert len(calls) == 1 and calls[0] == RankWindow.from_floats(calls[0]).to_floats()
    assert closed.metrics["doctor/share_backward"] == pytest.approx(0.3)
    assert m.window_count == 0


def test_a_measuring_problem_stops_the_timing_but_every_window_is_still_counted_and_gathered():
    clock = Clock()
    m = started(clock, skip=0)

    class Broken:
        def stage_start(self, stage):
            raise RuntimeError("event query failed")

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    m.machine = Broken()
    with pytest.warns(UserWarning, match="measuring problem"):
        dues = [batch(m, clock), batch(m, clock)]
    assert m.broken and any("on_train_batch_start: RuntimeError('event query failed')" in n for n in m.notes)
    assert dues == [None, "window"]  # the window fills at the same batch as on the ranks that measure
    sent = []
    assert m.close_window(lambda row: sent.append(row) or [row]) is None
    assert len(sent) == 1 and all(math.isnan(v) for v in sent[0])


def test_validation_and_checkpoints_pause_the_stage_clock_and_are_the_fits_phases():
    clock = Clock()
    m = started(clock, skip=0)
    batch(m, clock)
    m.next_batch(lambda: None)  # the next batch's data wait is open
    opened = m.validation_begin(sanity=False)
    clock.now += 50.0
    m.validation_end(opened)
    m.checkpoint_begin(True)
    clock.now += 20.0
    m.checkpoint_end(None)
    batch(m, clock)
    closed = m.close_window(None)
    assert closed.metrics["doctor/share_data"] == pytest.approx(0.1)  # neither pause is the data wait
    fit = m.fit_clock.breakdown(m.windows.train_wall)
    assert fit.seconds["validation"] == pytest.approx(50.0) and fit.seconds["checkpoint"] == pytest.approx(20.0)
    assert fit.counts["checkpoint"] == 1


def test_each_gathered_window_is_a_line_of_the_window_log(tmp_path):
    clock = Clock()
    log = LiveLog()
    path = tmp_path / "run.windows.jsonl"
    assert log.start(path, world_size=1, window=2)
    m = started(clock, live_log=log)
    for _ in range(3):
        batch(m, clock)
    m.close_window(None, live=False)  # diagnosed for the log even without live warnings
    log.end("finished", [tmp_path / "run.json", tmp_path / "run.html"])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["start", "window", "end"]
    assert lines[1]["batch"] == 2 and lines[1]["shares"]["optimizer"] == pytest.approx(0.4)
    assert lines[1]["findings"] and lines[1]["findings"][0]["stage"] == "optimizer"
    assert lines[2]["report"].endswith("run.html")
