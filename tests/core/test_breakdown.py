import math

import pytest

from lightning_accel.core.breakdown import ROW_FIELDS, Breakdown, split_seconds
from lightning_accel.core.rules import STAGES


def row(wall, samples=8, batches=4, **stages):
    values = {"wall": wall, "samples": samples, "batches": batches, **stages}
    return [values.get(f, 0.0) for f in ROW_FIELDS]


def test_split_subtracts_exposed_communication_from_backward_and_fills_other():
    s = split_seconds(1.0, {"data": 0.1, "forward": 0.2, "backward": 0.5, "communication": 0.2, "optimizer": 0.1})
    assert s["backward"] == pytest.approx(0.3)
    assert s["communication"] == pytest.approx(0.2)
    assert s["other"] == pytest.approx(0.1)
    assert sum(s.values()) == pytest.approx(1.0)
    assert list(s) == list(STAGES)


def test_split_when_stages_exceed_wall_time():
    s = split_seconds(1.0, {"data": 0.6, "forward": 0.6})
    assert s["other"] == 0.0 and sum(s.values()) == pytest.approx(1.2)
    with pytest.raises(ValueError):
        split_seconds(-1.0, {})


def test_window_over_two_ranks_is_time_weighted_and_sums_to_one():
    bd = Breakdown()
    w = bd.add([row(1.0, data=0.5, forward=0.5), row(1.0, data=0.1, forward=0.9)])
    assert w.shares["data"] == pytest.approx(0.3)
    assert sum(w.shares.values()) == pytest.approx(1.0)
    assert w.per_rank_shares[0]["data"] == pytest.approx(0.5)
    assert w.samples_per_sec == pytest.approx(16.0)  # 8 samples/s per rank, global
    assert w.step_seconds == pytest.approx(0.25) and w.batches == 4
    bd.add([row(3.0, data=0.0, forward=3.0), row(3.0, data=0.0, forward=3.0)])
    total = bd.shares()
    assert total["data"] == pytest.approx(0.6 / 8.0)
    assert sum(total.values()) == pytest.approx(1.0)
    assert bd.batches == 8
    assert bd.stage_seconds()["forward"] == pytest.approx(7.4 / 16)


def test_empty_windows_and_bad_rows():
    bd = Breakdown()
    assert bd.shares() is None and bd.step_seconds() is None and bd.samples_per_sec() is None
    assert bd.add([row(1.0, batches=0)]) is None
    with pytest.raises(ValueError, match="expected"):
        bd.add([[1.0, 2.0]])
    with pytest.raises(ValueError):
        bd.add([])
    assert not math.isnan(bd.add([row(0.5, forward=0.5)]).shares["forward"])
