"""A clock the test moves by hand, usable wherever the code takes a clock or reads ``time.perf_counter``."""

from __future__ import annotations


class FakeClock:
    """Seconds that pass only when the test says so.

    Call it (``clock()``) where the code takes a ``clock=`` callable, or pass ``clock.perf_counter`` where it reads
    ``time.perf_counter``; move it with :meth:`advance` or by setting :attr:`now` (``t`` is the same value).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value
