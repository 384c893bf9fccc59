"""find_batch_size / find_throughput_batch_size on simulated probes: probe counts and results asserted."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_accel.core.batch_size_search import (
    BatchSizeSearchError,
    MemoryModel,
    find_batch_size,
    find_throughput_batch_size,
    is_oom_error,
)

GiB = 2**30
BUDGET = 0.8 * 80 * GiB


class Curve:
    """Simulated step: peak = (fixed + per·b + quad·b²)·(1 ± noise); OOM above ``cliff`` or above ``capacity``."""

    def __init__(
        self,
        fixed: float,
        per: float,
        quad: float = 0.0,
        noise: float = 0.0,
        cliff: int | None = None,
        capacity: float | None = None,
        seed: int = 0,
    ) -> None:
        self.fixed, self.per, self.quad, self.noise, self.cliff, self.capacity = (
            fixed,
            per,
            quad,
            noise,
            cliff,
            capacity,
        )
        self.rng = random.Random(seed)
        self.calls: list[int] = []

    def exact(self, b: int) -> float:
        return self.fixed + self.per * b + self.quad * b * b

    def __call__(self, b: int) -> float:
        self.calls.append(b)
        if (self.cliff is not None and b > self.cliff) or (self.capacity is not None and self.exact(b) > self.capacity):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.exact(b) * (1 + self.rng.uniform(-self.noise, self.noise))

    def true_max(self, budget: float) -> int:
        lo, hi = 1, 1
        while self.exact(hi) <= budget:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.exact(mid) <= budget else (lo, mid)
        return min(lo, self.cliff) if self.cliff is not None else lo


def _never_failed(result) -> None:
    failed = {p.batch_size for p in result.probes if p.outcome != "ok"}
    assert result.batch_size not in failed
    assert any(
        p.batch_size == result.batch_size and p.outcome == "ok" and p.peak_bytes <= result.budget_bytes
        for p in result.probes
    )
    assert all(result.batch_size < f for f in failed)


@pytest.mark.parametrize(("fixed", "per"), [(1 * GiB, 10e6), (60 * GiB, 3e6), (0.2 * GiB, 150e6), (5 * GiB, 1e5)])
def test_linear_curve_reaches_95_percent_in_at_most_6_probes(fixed: float, per: float) -> None:
    curve = Curve(fixed, per)
    result = find_batch_size(curve, budget_bytes=BUDGET)
    true_max = curve.true_max(BUDGET)
    assert result.num_probes <= 6
    assert 0.95 * true_max <= result.batch_size <= true_max
    assert result.mode == "max_fit"
    _never_failed(result)
    assert result.model is not None
    assert result.model.bytes_per_sample == pytest.approx(per, rel=1e-6)
    assert result.model.fixed_bytes == pytest.approx(fixed, rel=1e-6)


def test_linear_curve_probe_sequence_is_two_small_probes_then_the_jump() -> None:
    curve = Curve(1 * GiB, 10e6)
    result = find_batch_size(curve, budget_bytes=BUDGET)
    assert curve.calls[0] == 2
    assert result.num_probes == 3 and curve.calls[2] == result.batch_size


@pytest.mark.parametrize("seed", range(5))
def test_noisy_linear_curve(seed: int) -> None:
    curve = Curve(2 * GiB, 8e6, noise=0.01, seed=seed)
    result = find_batch_size(curve, budget_bytes=BUDGET)
    assert result.num_probes <= 6
    assert result.batch_size >= 0.95 * curve.true_max(BUDGET)
    _never_failed(result)


def test_convex_curve_converges_without_exceeding_the_budget() -> None:
    curve = Curve(1 * GiB, 2e6, quad=5e3)
    result = find_batch_size(curve, budget_bytes=BUDGET)
    assert result.batch_size >= 0.95 * curve.true_max(BUDGET)
    assert result.num_probes <= 10
    _never_failed(result)
    assert any(p.outcome == "over_budget" for p in result.probes)  # the overshoot was measured, not returned


@pytest.mark.parametrize("cliff", [37, 300, 3000])
def test_oom_cliff_below_the_prediction_is_bracketed(cliff: int) -> None:
    curve = Curve(1 * GiB, 1e6, cliff=cliff)
    result = find_batch_size(curve, budget_bytes=BUDGET, max_probes=12)
    assert any(p.outcome == "oom" for p in result.probes)
    assert 0.9 * cliff <= result.batch_size <= cliff
    _never_failed(result)


def test_oom_at_the_first_probe_halves_until_one_fits() -> None:
    curve = Curve(1 * GiB, 1e6, cliff=5)
    result = find_batch_size(curve, budget_bytes=BUDGET, init_batch_size=64)
    assert curve.calls[:5] == [64, 32, 16, 8, 4]
    assert result.batch_size == 5


def test_real_capacity_oom_when_the_budget_is_above_capacity() -> None:
    curve = Curve(1 * GiB, 10e6, capacity=20 * GiB)
    result = find_batch_size(curve, budget_bytes=40 * GiB)
    assert result.batch_size >= 0.95 * curve.true_max(20 * GiB)
    _never_failed(result)


def test_max_batch_size_caps_the_search() -> None:
    curve = Curve(1 * GiB, 1e3)
    result = find_batch_size(curve, budget_bytes=BUDGET, max_batch_size=8192)
    assert result.batch_size == 8192
    assert max(curve.calls) == 8192
    assert result.num_probes <= 4


def test_multiple_of_rounds_every_jump_down() -> None:
    curve = Curve(1 * GiB, 10e6)
    result = find_batch_size(curve, budget_bytes=BUDGET, multiple_of=8)
    assert result.batch_size % 8 == 0
    assert all(b % 8 == 0 for b in curve.calls[1:])
    assert result.batch_size >= 0.95 * curve.true_max(BUDGET)


def test_budget_smaller_than_one_sample_raises_a_clear_error() -> None:
    curve = Curve(1 * GiB, 10e6)
    with pytest.raises(BatchSizeSearchError, match="smaller than one sample"):
        find_batch_size(curve, budget_bytes=0.5 * GiB)
    assert curve.calls == [2, 1]


def test_oom_at_batch_size_one_raises() -> None:
    with pytest.raises(BatchSizeSearchError, match="batch size 1 already runs out of memory"):
        find_batch_size(Curve(1 * GiB, 1e6, cliff=0), budget_bytes=BUDGET)


def test_non_oom_errors_propagate_unchanged() -> None:
    err = ValueError("shape mismatch in my model")

    def probe(b: int) -> float:
        if b > 2:
            raise err
        return 1e9

    with pytest.raises(ValueError) as info:
        find_batch_size(probe, budget_bytes=BUDGET)
    assert info.value is err


def test_runtime_errors_that_are_not_oom_propagate() -> None:
    def probe(b: int) -> float:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_batch_size(probe, budget_bytes=BUDGET)


def test_is_oom_error() -> None:
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert is_oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom_error(RuntimeError("size mismatch"))
    assert not is_oom_error(ValueError("out of memory"))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(budget_bytes=0),
        dict(budget_bytes=1e9, init_batch_size=0),
        dict(budget_bytes=1e9, multiple_of=0),
        dict(budget_bytes=1e9, max_probes=1),
        dict(budget_bytes=1e9, tolerance=0.7),
    ],
)
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        find_batch_size(Curve(1, 1), **kwargs)


def test_memory_model_fit_and_predict() -> None:
    model = MemoryModel.fit([(2, 1000.0 + 2 * 50), (10, 1000.0 + 10 * 50), (20, 1000.0 + 20 * 50)])
    assert model is not None
    assert model.fixed_bytes == pytest.approx(1000) and model.bytes_per_sample == pytest.approx(50)
    assert model.max_batch_size(6000) == 100
    assert MemoryModel.fit([(2, 5.0)]) is None
    assert MemoryModel(10, 0).max_batch_size(100) is None


# ------------------------------------------------------------------ throughput mode
def _launch_bound(b: int) -> tuple[float, float]:
    # 10 ms fixed per step + 0.1 ms per sample: samples/s saturates at 10k
    return 1 * GiB + 10e6 * b, 0.010 + 0.0001 * b


def test_throughput_mode_stops_when_doubling_stops_paying() -> None:
    result = find_throughput_batch_size(_launch_bound, budget_bytes=BUDGET, threshold=0.15, max_probes=20)
    # rates: 256 -> 7191/s, 512 -> 8366/s (+16 %), 1024 -> 9110/s (+9 % < 15 %)
    assert result.batch_size == 512
    assert [p.batch_size for p in result.probes][-1] == 1024
    assert result.mode == "throughput"


def test_throughput_mode_respects_the_memory_budget() -> None:
    result = find_throughput_batch_size(_launch_bound, budget_bytes=3 * GiB, threshold=0.05)
    assert result.batch_size == max(p.batch_size for p in result.probes if p.outcome == "ok")
    assert result.batch_size <= (3 * GiB - 1 * GiB) / 10e6
    assert result.stop_reason == "memory budget reached"
