import pytest
import torch

from lightning_accel.core.throughput import Rates, WindowedThroughput
from lightning_accel.core.timing import StageTimer
from tests.helpers import FakeClock


def test_window_rates_from_a_mocked_clock():
    clock, syncs = FakeClock(100.0), []
    meter = WindowedThroughput(window=2, clock=clock, synchronize=lambda: syncs.append(clock.now))
    meter.start()
    clock.now += 0.5
    assert meter.update(8, tokens=800, flops=1e9) is None
    clock.now += 0.5
    rates = meter.update(8, tokens=800, flops=1e9)
    assert rates == Rates(batches=2, samples=16, seconds=1.0, tokens=1600, flops=2e9)
    assert rates.samples_per_sec == 16 and rates.tokens_per_sec == 1600 and rates.flops_per_sec == 2e9
    assert syncs == [100.0, 101.0]  # synchronised at the window edges only, not per batch


def test_pause_excludes_time_and_close_flushes_partial_window():
    clock = FakeClock(100.0)
    meter = WindowedThroughput(window=10, clock=clock)
    meter.start()
    clock.now += 1.0
    meter.update(4)
    meter.pause()
    clock.now += 30.0  # validation
    meter.resume()
    clock.now += 1.0
    meter.update(4)
    rates = meter.close()
    assert rates.seconds == pytest.approx(2.0) and rates.samples == 8 and rates.tokens is None
    assert meter.close() is None
    assert meter.total().samples_per_sec == pytest.approx(4.0)


def test_window_validation():
    with pytest.raises(ValueError, match="window"):
        WindowedThroughput(window=0)
    meter = WindowedThroughput(window=1)
    with pytest.raises(RuntimeError, match="start"):
        meter.update(1)
    meter.start()
    with pytest.raises(ValueError, match=">= 0"):
        meter.update(-1)


def test_stage_timer_cpu_accumulates_and_flushes():
    clock = FakeClock(100.0)
    timer = StageTimer("cpu", clock=clock)
    for _ in range(3):
        timer.start("forward")
        clock.now += 0.25
        timer.stop("forward")
    timer.start("data", host=True)
    clock.now += 1.0
    timer.stop("data")
    timer.stop("never-started")  # ignored
    assert timer.flush() == {"forward": 0.75, "data": 1.0}
    assert timer.flush() == {}


def test_stage_timer_cuda_path_records_events_and_syncs_once_on_flush(monkeypatch):
    made = []

    class FakeEvent:
        def __init__(self, enable_timing):
            self.t, self.synced = None, 0
            made.append(self)

        def record(self):
            self.t = len(made) * 10.0  # ms

        def synchronize(self):
            self.synced += 1

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = StageTimer(torch.device("cuda", 0))
    timer.start("forward")
    timer.stop("forward")
    assert all(e.synced == 0 for e in made)  # no synchronisation inside the step
    out = timer.flush()
    assert out == {"forward": pytest.approx(0.01)}
    assert sum(e.synced for e in made) == 1
    timer.start("backward")  # events are reused from the pool
    timer.stop("backward")
    assert len(made) == 2
