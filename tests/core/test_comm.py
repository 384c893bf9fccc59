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
    f1 = timed(None, torch.ones(3))       # first bucket launched during backward
    clock.t = 1.5
    pending[0][0].set_result(pending[0][1] * 2)  # ... and finished, hidden behind backward
    clock.t = 2.0
    f2 = timed(None, torch.ones(2))       # last bucket: local backward is done
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
