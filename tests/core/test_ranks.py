"""The straggler rule: one rank's slow stage is named, and the others' all-reduce wait is blamed on it."""

import pytest

from lightning_accel.core.ranks import find_stragglers, own_communication_share, straggler_shares
from lightning_accel.core.rules import RunContext, diagnose


def ms(**stages):
    return {
        k: v / 1000
        for k, v in {
            "data": 0,
            "transfer": 0,
            "forward": 0,
            "backward": 0,
            "optimizer": 0,
            "communication": 0,
            "other": 0,
            **stages,
        }.items()
    }


# rank 1 waits 16 ms for data; ranks 0 and 2 wait ~16 ms for rank 1 in the all-reduce
SLOW_DATA = [
    ms(data=0.5, forward=2, backward=4, communication=16.5, other=0.5),
    ms(data=16.5, forward=2, backward=4, communication=0.5, other=0.5),
    ms(data=0.5, forward=2, backward=4, communication=16.5, other=0.5),
]


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
    even = [
        ms(data=1, forward=5, backward=10, communication=2),
        ms(data=1.2, forward=5.1, backward=10, communication=1.9),
    ]
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


# rank 1 loads its batches 16 ms slower; its own all-reduce (4 ms, what the network costs) is above the 15 %
# communication threshold of the 25.5 ms step, and rank 0 waits 16 ms more for rank 1 in it
OWN_COMM_ABOVE = [
    ms(data=0.5, forward=2, backward=2, optimizer=0.5, communication=20, other=0.5),
    ms(data=16.5, forward=2, backward=2, optimizer=0.5, communication=4, other=0.5),
]


def _shares(rank_seconds):
    total = sum(sum(r.values()) for r in rank_seconds)
    return {s: sum(r[s] for r in rank_seconds) / total for s in rank_seconds[0]}


def test_the_straggler_comes_first_and_the_network_keeps_only_its_own_cost():
    ctx = RunContext(world_size=2, communication_measured=True)
    findings = diagnose(_shares(OWN_COMM_ABOVE), ctx, rank_seconds=OWN_COMM_ABOVE).findings
    assert [f.rule for f in findings] == ["straggler", "communication"]
    straggler, comm = findings
    assert straggler.saving == pytest.approx(16 / 25.5)  # every rank's step shortens by rank 1's 16 ms excess
    # 24 ms of the 51 ms summed steps are all-reduce; 16 of them are rank 0's wait for rank 1: 8 / 51 is left
    assert comm.value == pytest.approx(8 / 51) and comm.saving == pytest.approx(8 / 51)
    assert "takes 15.7 % of the step" in comm.evidence
    assert "Not counted here: 31.4 % of the step, which the straggler finding accounts for." in comm.evidence
    # rank 1's data wait is the straggler's slow stage: no data_wait finding blames the loader for it again
    assert straggler.stage == "data"


def test_a_loader_slow_on_every_rank_and_a_straggler_are_two_findings_sized_by_what_each_fix_saves():
    # every rank waits 6 ms per batch for data; rank 1 waits 12 ms more, and rank 0 waits for it in the all-reduce
    ranks = [
        ms(data=6, forward=2, backward=2, optimizer=0.5, communication=12.5, other=0.5),
        ms(data=18, forward=2, backward=2, optimizer=0.5, communication=0.5, other=0.5),
    ]
    ctx = RunContext(world_size=2, communication_measured=True, num_workers=0)
    findings = diagnose(_shares(ranks), ctx, rank_seconds=ranks).findings
    assert [f.rule for f in findings] == ["straggler", "data_wait"]
    straggler, data = findings
    assert straggler.saving == pytest.approx(12 / 23.5)  # removing rank 1's extra 12 ms
    assert data.saving == pytest.approx(6 / 23.5)  # removing the 6 ms every rank waits
    assert "Not counted here: 25.5 % of the step, which the straggler finding accounts for." in data.evidence
    assert straggler_shares(ranks) == pytest.approx({"data": 12 / 47, "communication": 12 / 47})


def test_straggler_shares_are_empty_without_a_straggler_and_check_their_input():
    even = [ms(data=1, forward=5, backward=10, communication=2), ms(data=1.2, forward=5, backward=10, communication=1)]
    assert straggler_shares(even) == {} and straggler_shares(even[:1]) == {}
    with pytest.raises(ValueError, match="rank 0"):
        straggler_shares([{"data": -1.0}, ms()])
