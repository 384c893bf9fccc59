"""Windowed throughput: count work per batch, turn it into rates when a window of batches closes.

The device is synchronised only when a window opens or closes (and around pauses), never per batch: between two
synchronised points the host clock measures exactly the time the device needed for the work in between.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

from lightning_accel._checks import check_int

__all__ = ["RankWindows", "Rates", "WindowedThroughput", "raised_peaks"]


@dataclass(frozen=True)
class Rates:
    """Work done in a span of time. Rates are ``None`` where the quantity was not counted."""

    batches: int
    samples: float
    seconds: float
    tokens: float | None = None
    flops: float | None = None

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def batches_per_sec(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_sec(self) -> float | None:
        return None if self.tokens is None or self.seconds <= 0 else self.tokens / self.seconds

    @property
    def flops_per_sec(self) -> float | None:
        return None if self.flops is None or self.seconds <= 0 else self.flops / self.seconds

    def to_dict(self) -> dict[str, float | int | None]:
        out = asdict(self)
        out.update(
            samples_per_sec=self.samples_per_sec, tokens_per_sec=self.tokens_per_sec, flops_per_sec=self.flops_per_sec
        )
        return out


@dataclass
class _Counts:
    batches: int = 0
    samples: float = 0.0
    tokens: float | None = None
    flops: float | None = None

    def add(self, samples: float, tokens: float | None, flops: float | None) -> None:
        self.batches += 1
        self.samples += samples
        if tokens is not None:
            self.tokens = (self.tokens or 0.0) + tokens
        if flops is not None:
            self.flops = (self.flops or 0.0) + flops


@dataclass
class WindowedThroughput:
    """Counts samples / tokens / FLOPs per batch and reports rates every ``window`` batches.

    Time paused with :meth:`pause` / :meth:`resume` (validation inside training, say) is not counted.

    Args:
        window: batches per window (> 0).
        synchronize: called before the clock is read at a window edge (``torch.cuda.synchronize`` on GPU).
        clock: host clock in seconds.
    """

    window: int = 20
    synchronize: Callable[[], None] = field(default=lambda: None)
    clock: Callable[[], float] = field(default=lambda: time.perf_counter())
    windows: list[Rates] = field(default_factory=list)
    _counts: _Counts = field(default_factory=_Counts)
    _started_at: float | None = None
    _paused_at: float | None = None
    _paused_total: float = 0.0

    def __post_init__(self) -> None:
        check_int("WindowedThroughput", "window", self.window, unit="batches")

    @property
    def started(self) -> bool:
        return self._started_at is not None

    def start(self) -> None:
        """Open the first window (call after warm-up batches)."""
        self.synchronize()
        self._started_at = self.clock()
        self._counts = _Counts()
        self._paused_total = 0.0
        self._paused_at = None

    def pause(self) -> None:
        if self._started_at is not None and self._paused_at is None:
            self.synchronize()
            self._paused_at = self.clock()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += self.clock() - self._paused_at
            self._paused_at = None

    def update(self, samples: float, tokens: float | None = None, flops: float | None = None) -> Rates | None:
        """Count one finished batch; returns the window's rates when this batch closes a window."""
        if self._started_at is None:
            raise RuntimeError("WindowedThroughput.update() before start()")
        if samples < 0 or (tokens is not None and tokens < 0) or (flops is not None and flops < 0):
            raise ValueError(f"counts must be >= 0, got samples={samples}, tokens={tokens}, flops={flops}")
        self._counts.add(samples, tokens, flops)
        if self._counts.batches >= self.window:
            return self.close()
        return None

    def close(self) -> Rates | None:
        """Close the current window early (end of training); ``None`` if it holds no batch."""
        if self._started_at is None or self._counts.batches == 0:
            return None
        self.resume()
        self.synchronize()
        now = self.clock()
        c = self._counts
        rates = Rates(c.batches, c.samples, now - self._started_at - self._paused_total, c.tokens, c.flops)
        self.windows.append(rates)
        self._started_at, self._counts, self._paused_total = now, _Counts(), 0.0
        return rates

    def total(self) -> Rates | None:
        """All closed windows together (time-weighted), or ``None`` before the first window closed."""
        if not self.windows:
            return None
        tokens = [w.tokens for w in self.windows if w.tokens is not None]
        flops = [w.flops for w in self.windows if w.flops is not None]
        return Rates(
            batches=sum(w.batches for w in self.windows),
            samples=sum(w.samples for w in self.windows),
            seconds=sum(w.seconds for w in self.windows),
            tokens=sum(tokens) if len(tokens) == len(self.windows) else None,
            flops=sum(flops) if len(flops) == len(self.windows) else None,
        )

    def median_samples_per_sec(self) -> float | None:
        return statistics.median(w.samples_per_sec for w in self.windows) if self.windows else None


def raised_peaks(achieved: Sequence[float], peaks: Sequence[float]) -> list[float]:
    """Each rank's peak after a window whose achieved FLOP/s exceeded one: a measured rate is a lower bound of the true
    peak. Ranks that started from one peak are one kind of device and keep one peak (the fastest rank's rate); ranks
    with different peaks are raised each to its own rate."""
    if len(set(peaks)) == 1:
        return [max(peaks[0], *achieved)] * len(peaks)
    return [max(a, p) for a, p in zip(achieved, peaks)]


#: A raise handler: ``(achieved, peaks, raised, seconds)`` of the window, called before the window is recorded.
PeakRaise = Callable[[list[float], list[float], list[float], float], None]


class RankWindows:
    """Every rank's windows → global rates, per-device MFU, and the fit's time-weighted summary.

    A window is one row per rank: ``[samples, tokens, flops, seconds, batches, peak]`` (NaN where unknown), as
    gathered from the ranks. Samples and tokens are summed over ranks (a batch shared by a group of
    ``batch_replicas`` tensor-parallel ranks counts once); batch and FLOP rates and MFU are means over ranks. MFU is
    a fraction: a window whose achieved FLOP/s exceeds a rank's peak raises the peaks first (:func:`raised_peaks`).

    Attributes:
        history: one record per window (``samples_per_sec``, ``batches_per_sec``, ``tokens_per_sec``,
            ``flops_per_sec_per_device``, ``seconds``, ``batches``, ``mfu``).
        rank_peaks: every rank's current peak, as the last window's gather showed them.
    """

    def __init__(self, batch_replicas: int = 1) -> None:
        self.batch_replicas = batch_replicas
        self.history: list[dict[str, float | None]] = []
        self.rank_peaks: list[float] = []
        self._achieved_weighted: list[float] = []  # per rank: sum over windows of achieved FLOP/s x window seconds

    def add(self, rows: Sequence[Sequence[float]], on_raise: PeakRaise | None = None) -> dict[str, float | None]:
        """Record one window from its gathered rows; returns its record. ``on_raise`` hears of a raise of the peaks."""
        # plain floats: a handful of values per rank, where tensor ops would cost ~10 µs each (the window's flush
        # is the monitor's main hot-path cost)
        sec = [max(r[3], 1e-12) for r in rows]
        n = len(rows)
        no_tokens = any(math.isnan(r[1]) for r in rows)
        no_flops = any(math.isnan(r[2]) for r in rows)
        record: dict[str, float | None] = {
            "samples_per_sec": sum(r[0] / t for r, t in zip(rows, sec)) / self.batch_replicas,
            "batches_per_sec": sum(r[4] / t for r, t in zip(rows, sec)) / n,
            "tokens_per_sec": None if no_tokens else sum(r[1] / t for r, t in zip(rows, sec)) / self.batch_replicas,
            "flops_per_sec_per_device": None if no_flops else sum(r[2] / t for r, t in zip(rows, sec)) / n,
            "seconds": max(sec),
            "batches": sum(r[4] for r in rows),
            "mfu": None,
        }
        if not no_flops and not any(math.isnan(r[5]) for r in rows):
            achieved = [r[2] / t for r, t in zip(rows, sec)]
            peaks = [r[5] for r in rows]
            if any(a > p for a, p in zip(achieved, peaks)):
                raised = raised_peaks(achieved, peaks)
                if on_raise is not None:
                    on_raise(achieved, peaks, raised, max(sec))
                peaks = raised
            record["mfu"] = sum(a / p for a, p in zip(achieved, peaks)) / n
            self.rank_peaks = peaks
            if not self._achieved_weighted:
                self._achieved_weighted = [0.0] * n
            self._achieved_weighted = [w + a * max(sec) for w, a in zip(self._achieved_weighted, achieved)]
        self.history.append(record)
        return record

    @property
    def mean_peak(self) -> float | None:
        """The ranks' mean peak as the last window with MFU left them, or ``None`` before one."""
        return sum(self.rank_peaks) / len(self.rank_peaks) if self.rank_peaks else None

    @property
    def batches_measured(self) -> int:
        return int(sum(h["batches"] or 0 for h in self.history))

    def summary(self) -> dict[str, float | None]:
        """The windows' time-weighted rates (``None`` where a window lacks one); MFU divides every window by the
        final peaks (windows recorded before a raise divided by lower ones). Empty before the first window."""
        if not self.history:
            return {}
        weights = [h["seconds"] or 0.0 for h in self.history]
        total = sum(weights)

        def weighted(key: str) -> float | None:
            values = [h[key] for h in self.history]
            if total <= 0 or any(v is None for v in values):
                return None
            return sum(cast(float, v) * w for v, w in zip(values, weights)) / total

        mfu = None
        if weighted("mfu") is not None and self.rank_peaks:
            mfu = sum(w / total / p for w, p in zip(self._achieved_weighted, self.rank_peaks)) / len(self.rank_peaks)
        return {
            "samples_per_sec": weighted("samples_per_sec"),
            "median_samples_per_sec": statistics.median(cast(float, h["samples_per_sec"]) for h in self.history),
            "tokens_per_sec": weighted("tokens_per_sec"),
            "flops_per_sec_per_device": weighted("flops_per_sec_per_device"),
            "mfu": mfu,
            "seconds_measured": total,
        }
