"""Windowed throughput: count work per batch, turn it into rates when a window of batches closes.

The device is synchronised only when a window opens or closes (and around pauses), never per batch: between two
synchronised points the host clock measures exactly the time the device needed for the work in between.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from lightning_accel._checks import check_int

__all__ = ["Rates", "WindowedThroughput"]


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
