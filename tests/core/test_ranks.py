"""The straggler rule: one rank's slow stage is named, and the others' all-reduce wait is blamed on it."""

import pytest

from lightning_accel.core.ranks import find_stragglers, own_communication_share
from lightning_accel.core.rules import RunContext, diagnose


def ms(**stages):
    return {k: v / 1000 for k, v in {"data": 0, "transfer": 0, "forward": 0, "backward": 0, "optimizer": 0,
                                      "communication": 0, "other": 0, **stages}.items()}


# rank 1 waits 16 ms for data; ranks 0 and 2 wait ~16 ms for rank 1 in the all-reduce
SLOW_DATA = [ms(data=0.5, forward=2, backward=4, communication=16.5, other=0.5),
             ms(data=16.5, forward=2, backward=4, communication=0.5, other=0.5),
             ms(data=0.5, forward=2, backward=4, communication=16.5, other=0.5)]


def test_the_straggler_is_named_with_its_stage_and_the_others_wait():
    [finding] = find_stragglers(SLOW_DATA)
    assert finding.rule == "straggler" and finding.stage == "data"
    assert "rank 1 is a straggler" in finding.evidence
    assert "23.00 ms outside the all-reduce against 7.00 ms" in finding.evidence
    assert "+16.00 ms per batch" in finding.evidence
    assert "wait for it in the all-reduce: 16.50 ms per batch against 0.50 ms on rank 1" in finding.evidence
    assert finding.fix.startswith("rank 1's data is slow") and "num_workers" in finding.fix
    assert finding.value == pytest.approx(16.0 / 23.5)


def test_balanced_ranks_have_no_straggler():
    even = [ms(data=1, forward=5, backward=10, communication=2),
            ms(data=1.2, forward=5.1, backward=10, communication=1.9)]
    assert find_stragglers(even) == [] and find_stragglers(even[:1]) == []


def test_a_slow_compute_rank_gets_the_compute_fix():
    ranks = [ms(forward=2, backward=4, communication=8), ms(forward=6, backward=8, communication=0.2)]
    [finding] = find_stragglers(ranks)
    assert finding.stage == "backward" or finding.stage == "forward"
    assert "throttled or slower GPU" in finding.fix


def test_diagnose_blames_the_straggler_not_communication():
    mean = {s: sum(r[s] for r in SLOW_DATA) / 3 for s in SLOW_DATA[0]}
    shares = {s: v / sum(mean.values()) for s, v in mean.items()}
    ctx = RunContext(world_size=3, communication_measured=True)
    without = {f.rule for f in diagnose(shares, ctx).findings}
    assert "communication" in without  # the mean alone looks like a network problem
    rules = {f.rule for f in diagnose(shares, ctx, rank_seconds=SLOW_DATA).findings}
    assert "straggler" in rules and "communication" not in rules
    assert own_communication_share(SLOW_DATA) == pytest.approx(0.5 / 23.5)


def test_bad_rank_rows_raise():
    with pytest.raises(ValueError, match="rank 1"):
        find_stragglers([ms(), {"gpu": 1.0}])
