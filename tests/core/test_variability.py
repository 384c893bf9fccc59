"""Step-time variability: spikes, their period, and the cause named from the data waits and run facts."""

import math

import pytest

from lightning_accel.core.rules import RunContext, Thresholds
from lightning_accel.core.variability import VARIABILITY_FIELDS, merge_windows, summarise_window, variability_finding


def periodic(n=20, every=5, base=0.010, spike=0.040):
    return [spike if (i + 1) % every == 0 else base for i in range(n)]


def test_periodic_spikes_match_the_logging_cadence():
    steps = periodic()
    row = summarise_window(steps, [0.001] * len(steps), first_batch=0)
    stats = dict(zip(VARIABILITY_FIELDS, row))
    assert stats["spikes"] == 4 and stats["spike_gap"] == 5 and (stats["spike_first"], stats["spike_last"]) == (4, 19)
    assert stats["spike_excess"] == pytest.approx(4 * 0.030)
    assert merge_windows([row])["spike_period"] == 5
    merged = merge_windows([row, summarise_window(steps, [0.001] * 20, first_batch=20)])
    assert merged["spikes"] == 8 and merged["spike_period"] == 5 and merged["windows"] == 2
    finding = variability_finding(merged, RunContext(log_every_n_steps=5), Thresholds(variability=1.5))
    assert finding.rule == "step_variability" and finding.stage == "other"
    assert "every 5 batches" in finding.evidence and "log_every_n_steps=5" in finding.fix
    ckpt = variability_finding(merged, RunContext(checkpoint_every_n_train_steps=5), Thresholds(variability=1.5))
    assert "AsyncCheckpointIO" in ckpt.fix


def test_the_period_is_found_across_windows_with_two_spikes_each():
    rows = [summarise_window(periodic(10), [0.0] * 10, first_batch=10 * w) for w in range(4)]
    assert [r[VARIABILITY_FIELDS.index("spikes")] for r in rows] == [2, 2, 2, 2]
    assert merge_windows(rows)["spike_period"] == 5


def test_spikes_made_of_data_wait_are_bursty_data_stalls():
    steps = [0.010] * 20
    data = [0.0005] * 20
    for i in (2, 9, 11, 17):  # irregular
        steps[i], data[i] = 0.050, 0.0405
    stats = merge_windows([summarise_window(steps, data)])
    assert stats["spike_period"] == 0
    finding = variability_finding(
        stats, RunContext(num_workers=2, persistent_workers=False), Thresholds(variability=1.5)
    )
    assert finding.stage == "data" and "bursty data stalls" in finding.evidence
    assert "prefetch_factor=4" in finding.fix and "persistent_workers=True" in finding.fix
    # a DALI pipeline has no DataLoader workers: its own queue is the knob
    dali = variability_finding(
        stats, RunContext(loader="DALIImageDataModule", prefetch_queue_depth=2), Thresholds(variability=1.5)
    )
    assert "prefetch_queue_depth=3" in dali.fix and "num_workers" not in dali.fix


def test_rare_periodic_spikes_leave_p95_alone_but_are_found():
    # one 60 ms spike every 50 batches of 10 ms (logging every 50 steps): p95/p5 ~ 1, 10 % of the time in spikes
    rows = [summarise_window([0.010] * 49 + [0.060], [0.0] * 50, first_batch=50 * w) for w in range(4)]
    stats = merge_windows(rows)
    assert stats["step_p95"] / stats["step_p5"] < 1.5 and stats["spike_period"] == 50
    finding = variability_finding(stats, RunContext(log_every_n_steps=50))
    assert finding is not None and "every 50 batches" in finding.evidence and "log_every_n_steps=50" in finding.fix
    assert "of the measured time" in finding.evidence
    assert variability_finding(merge_windows(rows[:2]), RunContext()) is None  # 2 spikes: too few to call


def test_steady_steps_have_no_finding_and_empty_windows_are_nan():
    stats = merge_windows([summarise_window([0.010, 0.011, 0.0105, 0.0102], [0.0] * 4)])
    assert variability_finding(stats) is None
    assert all(math.isnan(v) for v in summarise_window([], []))
    assert merge_windows([summarise_window([], [])]) is None


def test_mismatched_lengths_and_bad_threshold_raise():
    with pytest.raises(ValueError, match="data times"):
        summarise_window([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="variability"):
        Thresholds(variability=0.5)
