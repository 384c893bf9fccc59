"""The doctor's per-window row: a typed record that survives the flat-vector exchange across ranks."""

from __future__ import annotations

import math

import pytest

from lightning_accel.core.breakdown import ROW_FIELDS
from lightning_accel.core.utilisation import reduce_utilisation, usable_cores_per_rank, usable_cpu_count
from lightning_accel.core.variability import VARIABILITY_FIELDS
from lightning_accel.core.window_row import UTIL_FIELDS, RankWindow


def _row(**util: float) -> RankWindow:
    stages = {f: float(i + 1) for i, f in enumerate(ROW_FIELDS)}
    utilisation = {f: util.get(f, math.nan) for f in UTIL_FIELDS}
    variability = {f: 10.0 + i for i, f in enumerate(VARIABILITY_FIELDS)}
    return RankWindow(stages, utilisation, 3.0, variability)


def test_round_trip_through_the_flat_vector_keeps_every_field_in_its_place():
    row = _row(cpu_process_pct=50.0, memory_peak_frac=0.5)
    flat = row.to_floats()
    assert len(flat) == RankWindow.SIZE
    back = RankWindow.from_floats(flat)
    assert back.stages == row.stages and back.comm_passes == 3.0 and back.variability == row.variability
    assert back.utilisation["cpu_process_pct"] == 50.0 and math.isnan(back.utilisation["gpu_util_pct"])
    assert back.stage_row() == [float(i + 1) for i in range(len(ROW_FIELDS))]
    assert back.variability_row() == [10.0 + i for i in range(len(VARIABILITY_FIELDS))]
    assert back.measured


def test_an_unmeasured_rank_is_all_nan_and_says_so():
    row = RankWindow.unmeasured()
    assert not row.measured and row.variability_row() is None
    assert all(math.isnan(v) for v in row.to_floats())
    with pytest.raises(ValueError, match=f"a window row has {RankWindow.SIZE} values, got 3"):
        RankWindow.from_floats([1.0, 2.0, 3.0])


def test_utilisation_reduction_takes_the_peak_of_peaks_and_the_mean_of_the_rest():
    assert reduce_utilisation(
        {"memory_peak_frac": [0.2, 0.7, 0.4], "cpu_process_pct": [10.0, 30.0], "gpu_util_pct": []}
    ) == {"memory_peak_frac": 0.7, "cpu_process_pct": 20.0}


def test_one_cpu_count_divided_among_ranks():
    assert usable_cores_per_rank(1) == usable_cpu_count() >= 1
    assert usable_cores_per_rank(10**6) == 1  # never 0 workers' worth of cores
