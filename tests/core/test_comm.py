import pytest
import torch

from lightning_accel.core.comm import CommRecorder, timed_comm_hook
from tests.helpers import FakeClock as Clock


def test_exposed_time_is_last_completion_minus_last_launch():
    clock = Clock()
    rec = CommRecorder(clock=clock)
    pending = []

    def hook(state, bucket):
        fut = torch.futures.Future()
        pending.append((fut, bucket))
        return fut

    timed = timed_comm_hook(hook, rec)
    clock.t = 1.0
    f1 = timed(None, torch.ones(3))  # first bucket launched during backward
    clock.t = 1.5
    pending[0][0].set_result(pending[0][1] * 2)  # ... and finished, hidden behind backward
    clock.t = 2.0
    f2 = timed(None, torch.ones(2))  # last bucket: local backward is done
    clock.t = 2.75
    pending[1][0].set_result(pending[1][1])
    assert torch.equal(f1.wait(), torch.full((3,), 2.0)) and torch.equal(f2.wait(), torch.ones(2))
    rec.end_backward()
    assert rec.buckets == 2
    seconds, passes = rec.flush()
    assert seconds == pytest.approx(0.75) and passes == 1
    assert rec.flush() == (0.0, 0)


def test_fully_hidden_allreduce_counts_zero_and_no_launch_is_no_pass():
    clock = Clock()
    rec = CommRecorder(clock=clock)
    rec.end_backward()  # accumulation step under no_sync: no bucket
    rec.launch()
    clock.t = 0.5
    rec.complete()
    clock.t = 0.6
    rec.launch()  # completes at the same instant as its launch
    rec.complete()
    rec.end_backward()
    assert rec.flush() == (0.0, 1)
    rec.launch()
    rec.discard()
    rec.end_backward()
    assert rec.flush() == (0.0, 0)


def test_wrapper_keeps_name_and_annotations_for_ddp_validation():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    timed = timed_comm_hook(default_hooks.allreduce_hook, CommRecorder())
    assert timed.__name__ == "allreduce_hook"
    assert timed.__annotations__ == default_hooks.allreduce_hook.__annotations__


def _completed(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


class _Bucket:
    def __init__(self, tensor):
        self._tensor = tensor

    def buffer(self):
        return self._tensor


def _hook(state, bucket):  # the user's all-reduce, here over one process: the buffer itself
    state.append("ran")
    return _completed(bucket.buffer() * 2)


@pytest.mark.parametrize("broken", ["launch", "complete"])
def test_an_error_in_our_recording_stops_it_and_the_users_hook_result_goes_through(broken):
    from lightning_accel.core.comm import CommRecorder, timed_comm_hook

    recorder = CommRecorder()

    def fail(*args, **kwargs):
        raise RuntimeError(f"{broken} broke")

    setattr(recorder, broken, fail)
    timed = timed_comm_hook(_hook, recorder)
    state = []
    for _ in range(3):
        out = timed(state, _Bucket(torch.ones(4))).wait()
        assert torch.equal(out, torch.full((4,), 2.0))  # the all-reduce's result, untouched
    assert state == ["ran"] * 3  # the user's hook ran every time
    assert recorder.failed == f"RuntimeError: {broken} broke"
    assert recorder.flush() == (0.0, 0)  # no communication share built on a partial record


def test_the_users_hook_errors_stay_the_users():
    from lightning_accel.core.comm import CommRecorder, timed_comm_hook

    def broken_hook(state, bucket):
        raise ValueError("user hook")

    recorder = CommRecorder()
    with pytest.raises(ValueError, match="user hook"):
        timed_comm_hook(broken_hook, recorder)(None, _Bucket(torch.ones(2)))
    assert recorder.failed is None
