"""find_batch_size: the largest batch that fits a memory budget, from a memory model instead of blind doubling.

The search runs over a ``probe(batch_size)`` callable that runs one training step (or a few) at that size and returns
the peak memory in bytes, or raises ``torch.OutOfMemoryError``. Peak memory of a training step is, to first order,
``fixed + per_sample × batch_size``: weights, gradients, optimizer state and workspace are fixed; activations grow
with the batch. So instead of Lightning's doubling-then-bisecting (``BatchSizeFinder``: ~20 trials in binsearch
mode, up to 2x short of the maximum in power mode), the search fits the line from two measured probes, jumps to
the largest batch the line predicts under the budget, verifies it, and refits on the points that bracket the budget
(secant / regula falsi) when the curve is not linear. An OOM (a cliff the line did not predict) is bracketed by
bisection. On a linear curve it reaches the maximum in three probes.

Nothing here imports Lightning; :class:`lightning_accel.BatchSizeTuner` is the Trainer adapter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_accel._checks import check_int

__all__ = [
    "LR_RULES",
    "BatchSizeSearch",
    "BatchSizeSearchError",
    "MemoryModel",
    "ProbeRecord",
    "find_batch_size",
    "find_throughput_batch_size",
    "is_oom_error",
    "lr_scale",
    "split_global_batch",
]

OK, OVER_BUDGET, OOM = "ok", "over_budget", "oom"


class BatchSizeSearchError(RuntimeError):
    """No batch size fits: even the smallest probe exceeded the budget or ran out of memory."""


def is_oom_error(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error of any torch backend (CUDA, cuDNN, CPU allocator, MPS, XPU).

    ``torch.OutOfMemoryError`` is what the CUDA caching allocator raises; older kernels and other backends raise a
    ``RuntimeError`` whose message says so (the same messages Lightning's ``is_oom_error`` matches).
    """
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if not isinstance(err, RuntimeError) or not err.args:
        return False
    msg = str(err.args[0])
    return any(
        s in msg
        for s in (
            "CUDA out of memory",
            "out of memory",
            "CUDNN_STATUS_NOT_SUPPORTED",
            "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
            "DefaultCPUAllocator: can't allocate memory",
            "MPS backend out of memory",
        )
    )


@dataclass(frozen=True)
class ProbeRecord:
    """One probe of the search.

    Attributes:
        batch_size: the batch size probed.
        outcome: ``"ok"`` (ran, peak within the budget), ``"over_budget"`` (ran, peak above the budget) or
            ``"oom"`` (raised an out-of-memory error).
        peak_bytes: peak memory of the step in bytes (``None`` after an OOM).
        seconds_per_step: median wall time of one step in seconds, when the probe timed it.
    """

    batch_size: int
    outcome: str
    peak_bytes: float | None = None
    seconds_per_step: float | None = None

    @property
    def samples_per_sec(self) -> float | None:
        """Samples per second of the step (per device), when the probe timed it."""
        if self.seconds_per_step is None or self.seconds_per_step <= 0:
            return None
        return self.batch_size / self.seconds_per_step


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of a training step as ``fixed_bytes + bytes_per_sample × batch_size``."""

    fixed_bytes: float
    bytes_per_sample: float

    def predict(self, batch_size: float) -> float:
        """Predicted peak bytes at ``batch_size``."""
        return self.fixed_bytes + self.bytes_per_sample * batch_size

    def max_batch_size(self, budget_bytes: float) -> int | None:
        """Largest batch size whose predicted peak is within ``budget_bytes`` (``None``: no growth with the batch)."""
        if self.bytes_per_sample <= 0:
            return None
        return max(0, math.floor((budget_bytes - self.fixed_bytes) / self.bytes_per_sample))

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> MemoryModel | None:
        """Least-squares line through ``(batch_size, peak_bytes)`` points (``None`` with fewer than 2 sizes)."""
        if len({s for s, _ in points}) < 2:
            return None
        n = len(points)
        mx = sum(s for s, _ in points) / n
        my = sum(p for _, p in points) / n
        sxx = sum((s - mx) ** 2 for s, _ in points)
        sxy = sum((s - mx) * (p - my) for s, p in points)
        slope = sxy / sxx
        return cls(fixed_bytes=my - slope * mx, bytes_per_sample=slope)


@dataclass(frozen=True)
class BatchSizeSearch:
    """Result of :func:`find_batch_size` / :func:`find_throughput_batch_size`.

    Attributes:
        batch_size: the chosen batch size; always one that was probed and succeeded within the budget.
        budget_bytes: the memory budget searched against.
        probes: every probe, in order.
        model: least-squares memory model over all probes that measured a peak (``None`` with fewer than 2 sizes).
        stop_reason: why the search stopped, in words.
        mode: ``"max_fit"`` or ``"throughput"``.
    """

    batch_size: int
    budget_bytes: float
    probes: tuple[ProbeRecord, ...]
    model: MemoryModel | None
    stop_reason: str
    mode: str = "max_fit"
    notes: tuple[str, ...] = field(default=())

    @property
    def num_probes(self) -> int:
        return len(self.probes)

    @property
    def predicted_max_batch_size(self) -> int | None:
        """Largest batch the fitted model predicts within the budget."""
        return None if self.model is None else self.model.max_batch_size(self.budget_bytes)


# ---------------------------------------------------------------------------------------------------------- helpers
def _validate(
    budget_bytes: float,
    init_batch_size: int,
    max_batch_size: int | None,
    multiple_of: int | None,
    max_probes: int,
    tolerance: float,
) -> None:
    if not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0 or math.isinf(budget_bytes):
        raise ValueError(f"find_batch_size(budget_bytes={budget_bytes!r}): give a positive, finite number of bytes")
    check_int("find_batch_size", "init_batch_size", init_batch_size, example=2)
    check_int("find_batch_size", "max_batch_size", max_batch_size, optional=True)
    check_int("find_batch_size", "multiple_of", multiple_of, optional=True, example=8)
    check_int("find_batch_size", "max_probes", max_probes, minimum=2, example=10)
    if not 0 < tolerance < 0.5:
        raise ValueError(f"find_batch_size(tolerance={tolerance!r}): give a fraction in (0, 0.5), e.g. 0.02")


class _Search:
    """Book-keeping shared by both modes: runs probes, classifies them, knows the bracket [lo, hi)."""

    def __init__(
        self, probe: Callable[[int], object], budget: float, max_batch_size: int | None, multiple_of: int | None
    ) -> None:
        self.probe_fn = probe
        self.budget = float(budget)
        self.cap = max_batch_size
        self.multiple = multiple_of or 1
        self.records: list[ProbeRecord] = []

    def run(self, size: int) -> ProbeRecord:
        try:
            out = self.probe_fn(size)
        except Exception as err:
            if not is_oom_error(err):
                raise
            rec = ProbeRecord(size, OOM)
        else:
            peak, seconds = out if isinstance(out, tuple) else (out, None)
            peak = float(peak)
            rec = ProbeRecord(
                size, OK if peak <= self.budget else OVER_BUDGET, peak, None if seconds is None else float(seconds)
            )
        self.records.append(rec)
        return rec

    @property
    def hi(self) -> float:
        """Smallest size known not to fit (a failed probe, or one past ``max_batch_size``)."""
        bad = [r.batch_size for r in self.records if r.outcome != OK]
        if self.cap is not None:
            bad.append(self.cap + 1)
        return min(bad, default=math.inf)

    @property
    def failed_hi(self) -> float:
        """Smallest size that failed (OOM or over budget); ``inf`` when none has."""
        return min((r.batch_size for r in self.records if r.outcome != OK), default=math.inf)

    @property
    def lo(self) -> int:
        """Largest size that succeeded and is below every failed size (memory is assumed monotone in the batch)."""
        hi = self.hi
        return max((r.batch_size for r in self.records if r.outcome == OK and r.batch_size < hi), default=0)

    def measured(self) -> list[tuple[int, float]]:
        return [(r.batch_size, r.peak_bytes) for r in self.records if r.peak_bytes is not None]

    def round_down(self, size: float) -> int:
        size = math.floor(size)
        if size >= self.multiple:
            size -= size % self.multiple
        return max(1, size)

    def best(self) -> int:
        """Largest successful size, preferring a multiple of ``multiple_of`` when one succeeded."""
        lo = self.lo
        ok = [r.batch_size for r in self.records if r.outcome == OK and r.batch_size <= lo]
        aligned = [s for s in ok if s % self.multiple == 0]
        return max(aligned or ok)

    def start(self, init: int) -> None:
        """Probe ``init`` (capped at ``max_batch_size``), halving after failures until one size succeeds."""
        size = min(init, self.cap) if self.cap is not None else init
        while True:
            rec = self.run(size)
            if rec.outcome == OK:
                return
            if size == 1:
                if rec.outcome == OOM:
                    raise BatchSizeSearchError(
                        "batch size 1 already runs out of memory: the model, its gradients and optimizer state do "
                        "not fit. Free memory, use a smaller model, or shard it (e.g. strategy='deepspeed_zero3')."
                    )
                raise BatchSizeSearchError(
                    f"the memory budget ({_fmt_bytes(self.budget)}) is smaller than one sample: batch size 1 peaks at "
                    f"{_fmt_bytes(rec.peak_bytes or 0)}. Raise the budget (memory_fraction / memory_budget) or make "
                    "the model smaller."
                )
            size = max(1, size // 2)

    def result(self, reason: str, mode: str) -> BatchSizeSearch:
        notes = []
        best = self.best()
        if self.multiple > 1 and best % self.multiple:
            notes.append(f"no multiple of {self.multiple} fitted; {best} is the largest size that did")
        return BatchSizeSearch(
            batch_size=best,
            budget_bytes=self.budget,
            probes=tuple(self.records),
            model=MemoryModel.fit(self.measured()),
            stop_reason=reason,
            mode=mode,
            notes=tuple(notes),
        )


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _secant(a: tuple[int, float], b: tuple[int, float], budget: float) -> float | None:
    """Size where the line through points ``a`` and ``b`` crosses ``budget`` (``None`` if it does not rise)."""
    (sa, pa), (sb, pb) = a, b
    if sb == sa or pb <= pa:
        return None
    return sa + (budget - pa) * (sb - sa) / (pb - pa)


def _prediction(search: _Search) -> float | None:
    """Predicted largest size within the budget from the measured points nearest the budget crossing.

    Two secants are available once a probe went over the budget: the interpolation between the largest point
    within the budget and the smallest above it, and the extrapolation of the two largest points within it. On a
    linear curve both are exact; on a convex one (allocator rounding, size-dependent kernels) the first falls short
    and the second overshoots, so their mean converges in a few probes where the interpolation alone (regula
    falsi) creeps up one side. ``None`` when the measured curve does not rise with the batch (flat or noisy).
    """
    pts = sorted(search.measured())
    below = sorted((s, p) for s, p in pts if p <= search.budget)
    above = sorted((s, p) for s, p in pts if p > search.budget)
    extrapolated = _secant(below[-2], below[-1], search.budget) if len({s for s, _ in below}) >= 2 else None
    if not (below and above):
        return extrapolated
    interpolated = _secant(below[-1], above[0], search.budget)
    if interpolated is None:
        return None
    if extrapolated is None or extrapolated >= above[0][0] or extrapolated <= interpolated:
        return interpolated
    return (interpolated + extrapolated) / 2


# ---------------------------------------------------------------------------------------------------------- max fit
def find_batch_size(
    probe: Callable[[int], float],
    *,
    budget_bytes: float,
    init_batch_size: int = 2,
    max_batch_size: int | None = None,
    multiple_of: int | None = None,
    max_probes: int = 10,
    tolerance: float = 0.02,
) -> BatchSizeSearch:
    """Largest batch size whose training step peaks within ``budget_bytes``.

    Args:
        probe: ``probe(batch_size) -> peak_bytes`` runs the step at that size; raises ``torch.OutOfMemoryError``
            (or another OOM error, see :func:`is_oom_error`) when it does not fit. Any other exception propagates
            unchanged. A probe may also return ``(peak_bytes, seconds_per_step)``.
        budget_bytes: the memory the step may use (e.g. 0.8 × device memory).
        init_batch_size: first size probed; halved after failures until one fits.
        max_batch_size: never probe above this (e.g. the dataset length).
        multiple_of: probe and return multiples of this (e.g. 8 for tensor cores) once sizes reach it.
        max_probes: hard limit on probes.
        tolerance: stop once the next candidate would gain less than this fraction over the best size found,
            or the bracket between the best success and the smallest failure is narrower than this fraction.

    Returns:
        A :class:`BatchSizeSearch`: the chosen size (never one that failed or went over the budget), every probe,
        and the fitted memory model.

    Raises:
        BatchSizeSearchError: batch size 1 already exceeds the budget or runs out of memory.
    """
    _validate(budget_bytes, init_batch_size, max_batch_size, multiple_of, max_probes, tolerance)
    search = _Search(probe, budget_bytes, max_batch_size, multiple_of)
    search.start(init_batch_size)
    reason = f"reached max_probes={max_probes}"
    while len(search.records) < max_probes:
        lo, hi = search.lo, search.hi
        step = search.multiple if lo >= search.multiple else 1
        if hi - lo <= step or (hi != math.inf and hi - lo <= tolerance * hi):
            reason = (
                "max_batch_size reached"
                if search.cap is not None and lo >= search.cap
                else f"bracketed: {lo} fits, {int(hi)} does not"
            )
            break
        candidate = _next_candidate(search, lo, hi, tolerance)
        if candidate is None:
            reason = f"model predicts no gain above {lo} beyond tolerance {tolerance:.0%}"
            break
        search.run(candidate)
    return search.result(reason, "max_fit")


def _next_candidate(search: _Search, lo: int, hi: float, tolerance: float) -> int | None:
    """The next size to probe, or ``None`` when the model says nothing within tolerance is left above ``lo``."""
    failed = search.failed_hi
    measured = search.measured()
    if len({s for s, _ in measured}) == 1:
        # One point (s0, p0): with fixed >= 0 the per-sample cost is at most p0/s0, so s0·budget/p0 is a lower bound
        # of the maximum on a linear curve: a safe first jump, and far from s0 so the secant it gives is accurate.
        s0, p0 = measured[0]
        aim = max(s0 * search.budget / p0 * (1 - tolerance / 2) if p0 > 0 else 0.0, 2.0 * s0)
    else:
        pred = _prediction(search)
        if pred is None:  # flat or non-increasing curve: no information; grow geometrically
            aim = 2.0 * lo
        else:
            # Aim slightly short so the verifying probe lands within the budget rather than just over it.
            aim = pred * (1 - tolerance / 2)
            if aim <= lo * (1 + tolerance) and aim < failed:
                return None
    if aim >= failed:
        # The model says a size that failed fits: an OOM the memory curve did not predict (a cliff: allocator
        # fragmentation, a kernel workspace). Bisect the bracket, geometrically while it spans more than 4x.
        aim = math.sqrt(lo * failed) if failed > 4 * lo else (lo + failed) / 2
    candidate = search.round_down(min(aim, hi - 1))
    return candidate if candidate > lo else None


# ---------------------------------------------------------------------------------------------------------- throughput
def find_throughput_batch_size(
    probe: Callable[[int], tuple[float, float]],
    *,
    budget_bytes: float,
    init_batch_size: int = 2,
    max_batch_size: int | None = None,
    multiple_of: int | None = None,
    max_probes: int = 10,
    threshold: float = 0.05,
) -> BatchSizeSearch:
    """Largest batch size that still raises samples/s by at least ``threshold`` over half of it, within the budget.

    Doubles from ``init_batch_size``; each probe returns ``(peak_bytes, seconds_per_step)``. Stops at the first
    doubling that gains less than ``threshold`` (the smaller size is chosen), at a failure or over-budget probe, at
    ``max_batch_size``, or where the memory model says the next doubling would exceed the budget (then the model's
    maximum is probed as the last rung). Useful where memory is not the limit: CPUs, launch-bound GPUs.

    Args:
        probe: ``probe(batch_size) -> (peak_bytes, seconds_per_step)``; raises an OOM error when it does not fit.
        budget_bytes: memory budget in bytes.
        init_batch_size: first size probed.
        max_batch_size: never probe above this.
        multiple_of: round rungs down to multiples of this.
        max_probes: hard limit on probes.
        threshold: minimum relative samples/s gain for a larger batch to be worth it (0.05 = 5 %).

    Returns:
        A :class:`BatchSizeSearch` with ``mode="throughput"``; each probe carries its step time.
    """
    _validate(budget_bytes, init_batch_size, max_batch_size, multiple_of, max_probes, 0.02)
    if not 0 <= threshold < 10:
        raise ValueError(f"find_throughput_batch_size(threshold={threshold!r}): give a fraction such as 0.05")
    search = _Search(probe, budget_bytes, max_batch_size, multiple_of)
    search.start(init_batch_size)
    chosen = search.lo
    reason = f"reached max_probes={max_probes}"
    while len(search.records) < max_probes:
        prev = next(r for r in reversed(search.records) if r.outcome == OK and r.batch_size == chosen)
        nxt = 2 * chosen
        if search.cap is not None:
            nxt = min(nxt, search.cap)
        model = MemoryModel.fit(search.measured())
        limit = model.max_batch_size(search.budget) if model is not None else None
        if limit is not None and limit < nxt:
            nxt = limit
        nxt = search.round_down(nxt)
        if nxt <= chosen:
            reason = (
                "max_batch_size reached" if search.cap is not None and chosen >= search.cap else "memory budget reached"
            )
            break
        rec = search.run(nxt)
        if rec.outcome != OK:
            reason = f"batch size {nxt} does not fit ({rec.outcome})"
            break
        gain_ok = (
            rec.samples_per_sec is not None
            and prev.samples_per_sec is not None
            and rec.samples_per_sec >= prev.samples_per_sec * (1 + threshold)
        )
        if not gain_ok:
            reason = f"batch size {nxt} gains less than {threshold:.0%} samples/s over {chosen}"
            break
        chosen = nxt
    result = search.result(reason, "throughput")
    # `result` picks the largest success; throughput mode keeps the rung that last paid off.
    return BatchSizeSearch(
        batch_size=chosen,
        budget_bytes=result.budget_bytes,
        probes=result.probes,
        model=result.model,
        stop_reason=reason,
        mode="throughput",
        notes=result.notes,
    )


#: How a learning rate follows the effective batch: ``"linear"`` (Goyal et al. 2017, arXiv:1706.02677), ``"sqrt"``
#: (Krizhevsky 2014, arXiv:1404.5997) or ``"none"``.
LR_RULES = ("linear", "sqrt", "none")


def lr_scale(rule: str, old_global: int, new_global: int) -> float:
    """The factor ``rule`` (one of :data:`LR_RULES`) multiplies the learning rate by when the effective batch goes
    from ``old_global`` to ``new_global`` samples per optimizer step."""
    if rule == "none" or old_global == new_global:
        return 1.0
    ratio = new_global / old_global
    return ratio if rule == "linear" else math.sqrt(ratio)


def split_global_batch(target: int, devices: int, largest: int) -> tuple[int, int]:
    """``(micro, accumulation)`` with micro × devices × accumulation == ``target`` and micro <= ``largest``: the
    largest micro-batch that divides the per-device share."""
    per_device = target // devices
    for accum in range(max(1, math.ceil(per_device / largest)), per_device + 1):
        if per_device % accum == 0:
            return per_device // accum, accum
    return 1, per_device
