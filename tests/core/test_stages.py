"""The pure stage state machine, driven by hand with a fake clock: exact seconds, no Trainer."""

import pytest

from lightning_accel.core.rules import STAGES, diagnose
from lightning_accel.core.stages import StageMachine
from tests.helpers import FakeClock as Clock


def step(machine, clock, data=0.0, transfer=0.0, forward=0.0, backward=0.0, optimizer=0.0, other=0.0, samples=8):
    machine.batch_requested()
    clock.advance(data)
    if transfer:
        machine.stage_start("transfer")
        clock.advance(transfer)
        machine.stage_end("transfer")
    machine.stage_start("forward")
    clock.advance(forward)
    machine.stage_start("backward")
    clock.advance(backward)
    machine.stage_start("optimizer")
    clock.advance(optimizer)
    machine.stage_end()
    clock.advance(other)
    machine.step_end(samples=samples)


def test_warmup_is_not_measured_and_stages_are_exact():
    clock = Clock()
    machine = StageMachine(clock=clock, warmup_batches=2)
    step(machine, clock, data=5, forward=5)  # warm-up: slow first batches (FLOP counting, compilation)
    step(machine, clock, data=5, forward=5)
    assert machine.measuring and machine.window_batches == 0
    for _ in range(3):
        step(machine, clock, data=0.2, transfer=0.05, forward=0.2, backward=0.4, optimizer=0.1, other=0.05)
    window = machine.close_window()
    assert window.batches == 3 and window.samples == 24 and window.first_batch == 2
    assert window.wall == pytest.approx(3.0)
    assert window.seconds == pytest.approx(
        {"data": 0.6, "transfer": 0.15, "forward": 0.6, "backward": 1.2, "optimizer": 0.3, "communication": 0.0}
    )
    shares = window.shares()
    assert set(shares) == set(STAGES) and sum(shares.values()) == pytest.approx(1.0)
    assert shares["other"] == pytest.approx(0.05) and shares["backward"] == pytest.approx(0.4)
    assert window.step_times == pytest.approx([1.0, 1.0, 1.0]) and window.data_times == pytest.approx([0.2] * 3)
    # the shares feed the rules directly (the Autopilot's path): 20 % data wait is the finding
    assert [f.rule for f in diagnose(shares).findings] == ["data_wait"]


def test_pauses_are_taken_out_and_nest_and_the_data_wait_continues():
    clock = Clock()
    machine = StageMachine(clock=clock)
    step(machine, clock, data=0.5, forward=0.5)
    machine.batch_requested()
    clock.advance(0.2)  # waiting for data ...
    machine.pause()  # ... validation starts
    clock.advance(10)
    machine.pause()  # a checkpoint saved at the end of validation
    clock.advance(5)
    machine.resume()
    assert machine.paused  # still inside validation
    clock.advance(1)
    machine.resume()
    assert not machine.paused and machine.stage == "data" and machine.awaiting_batch
    clock.advance(0.3)  # the wait goes on after validation
    machine.stage_start("forward")
    clock.advance(0.5)
    machine.step_end()
    window = machine.close_window()
    assert window.wall == pytest.approx(2.0)  # 16 s of pauses are in no stage
    assert window.seconds["data"] == pytest.approx(1.0) and window.seconds["forward"] == pytest.approx(1.0)
    assert window.step_times == pytest.approx([1.0, 1.0]) and window.data_times == pytest.approx([0.5, 0.5])
    machine.resume()  # a resume without a pause is ignored
    assert not machine.paused


def test_windows_tile_time_and_finish_drops_what_came_after_the_last_batch():
    clock = Clock()
    machine = StageMachine(clock=clock)
    step(machine, clock, forward=1.0)
    machine.batch_requested()
    first = machine.close_window()  # closing (gather, logging) is counted in the next window ...
    clock.advance(0.5)  # ... as data wait here, since the loop already asked for the next batch
    machine.stage_start("forward")
    clock.advance(1.0)
    machine.step_end()
    machine.add_seconds("communication", 0.25)
    machine.batch_requested()
    clock.advance(3.0)  # the loop ends: this wait is for a batch that never comes
    machine.pause()
    clock.advance(7.0)
    last = machine.finish()
    assert first.wall == pytest.approx(1.0) and first.batches == 1
    assert last.wall == pytest.approx(1.5) and last.batches == 1
    assert last.seconds["data"] == pytest.approx(0.5) and last.seconds["communication"] == pytest.approx(0.25)
    assert machine.finish() is None  # nothing left
    machine.batch_requested()
    clock.advance(1.0)
    empty = machine.close_window()  # a wait in progress, no batch: no shares to diagnose
    assert empty.batches == 0 and set(empty.shares().values()) == {0.0}


def test_stage_end_with_a_name_only_closes_that_stage_and_cancel_drops_the_open_one():
    clock = Clock()
    machine = StageMachine(clock=clock)
    machine.stage_start("forward")
    clock.advance(1.0)
    machine.stage_end("transfer")  # not open: ignored
    assert machine.stage == "forward"
    machine.cancel()  # an exception inside the step
    machine.step_end()
    assert machine.close_window().seconds["forward"] == 0.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.stage_start("other"), "'other' is derived"),
        (lambda m: m.stage_start("communication"), "add_seconds"),
        (lambda m: m.add_seconds("gpu", 1.0), "add_seconds"),
        (lambda m: StageMachine(warmup_batches=-1), "warmup_batches"),
    ],
)
def test_bad_input_raises_with_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call(StageMachine(clock=Clock()))


def test_held_batches_are_in_no_window_neither_their_time_nor_their_count():
    clock = Clock()
    machine = StageMachine(clock=clock, warmup_batches=0)
    step(machine, clock, data=0.1, forward=0.2, backward=0.3)
    machine.hold()  # between batches, as the doctor does before its profiled window
    step(machine, clock, data=5, forward=5, backward=5)  # a slow, profiled batch
    machine.pause()  # validation inside the held stretch: already out of the window
    clock.advance(7)
    machine.resume()
    step(machine, clock, data=5, forward=5, backward=5)
    assert machine.held and machine.batches_seen == 3
    machine.release()
    step(machine, clock, data=0.1, forward=0.2, backward=0.3)
    window = machine.close_window()
    assert window.batches == 2 and len(window.step_times) == 2
    assert window.wall == pytest.approx(1.2)
    assert window.seconds["forward"] == pytest.approx(0.4) and window.seconds["data"] == pytest.approx(0.2)
    assert window.step_times == pytest.approx([0.6, 0.6])


def test_hold_inside_a_pause_is_refused():
    clock = Clock()
    machine = StageMachine(clock=clock)
    machine.pause()
    with pytest.raises(RuntimeError, match="hold between batches"):
        machine.hold()
