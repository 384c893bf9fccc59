"""The framework-free arithmetic under MFUMonitor and BatchSizeTuner: gathered windows → rates and MFU, the peak's
raise, the split of a global batch and the learning-rate rules."""

from __future__ import annotations

import math

import pytest

from lightning_accel.core.batch_size_search import lr_scale, split_global_batch
from lightning_accel.core.throughput import RankWindows, raised_peaks

NAN = math.nan


def test_ranks_of_one_peak_share_the_fastest_rate_and_others_rise_each_to_their_own():
    assert raised_peaks([3.0, 5.0], [4.0, 4.0]) == [5.0, 5.0]
    assert raised_peaks([5.0, 5.0], [4.0, 6.0]) == [5.0, 6.0]


def test_a_window_sums_samples_over_ranks_and_averages_mfu_per_device():
    windows = RankWindows(batch_replicas=1)
    # samples, tokens, flops, seconds, batches, peak
    record = windows.add([[10.0, NAN, 4.0, 2.0, 5, 4.0], [20.0, NAN, 4.0, 1.0, 5, 8.0]])
    assert record["samples_per_sec"] == pytest.approx(5 + 20)
    assert record["tokens_per_sec"] is None and record["seconds"] == 2.0 and record["batches"] == 10
    assert record["mfu"] == pytest.approx((2 / 4 + 4 / 8) / 2)
    assert windows.summary()["mfu"] == pytest.approx(0.5) and windows.batches_measured == 10


def test_a_window_above_the_peak_raises_it_before_mfu_is_taken():
    heard = []
    windows = RankWindows()
    record = windows.add([[1.0, NAN, 8.0, 1.0, 1, 4.0]], on_raise=lambda *window: heard.append(window))
    assert heard == [([8.0], [4.0], [8.0], 1.0)]
    assert record["mfu"] == 1.0 and windows.rank_peaks == [8.0] and windows.mean_peak == 8.0


def test_a_global_batch_splits_into_the_largest_micro_batch_that_fits_and_divides():
    assert split_global_batch(64, 2, 12) == (8, 4)
    assert split_global_batch(64, 2, 32) == (32, 1)


def test_the_learning_rate_rules():
    assert lr_scale("linear", 32, 128) == 4.0 and lr_scale("sqrt", 32, 128) == 2.0
    assert lr_scale("none", 32, 128) == 1.0 and lr_scale("linear", 32, 32) == 1.0
