"""Paired measurement: every decision compares a window of the change (B) with a window of the configuration it would
replace (A) measured next to it, never with a baseline measured minutes earlier.

:func:`measure_pairs` is the one routine that measures them — A B, then A B B A when the first pair calls for its
confirmation, then A B B A B when two pairs leave the question open — for the step trials, the bundles and the
checkpoint trial alike; :func:`decide_paired` is the keep rule, :func:`noise_gate` the gain it needs,
:func:`claimed_speedup` the speed-up a set of pairs bears out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "DECISIVE_GAIN",
    "NOISE_CAP",
    "Pairs",
    "claimed_speedup",
    "decide_paired",
    "measure_pairs",
    "needs_third_pair",
    "noise_gate",
    "paired_bar",
    "relative_noise",
]

#: A first paired ratio this far above 1 (and at least 4 gates) is kept without a confirmation pair: no burst of
#: interference measured on a shared 2-core CPU (at most 25 % between two windows) makes a window 1.5x faster, and a short
#: fit cannot afford two more windows for a fix that halves its data wait.
DECISIVE_GAIN = 0.5
#: The gate stops at this many thresholds (:func:`noise_gate`); a baseline noisier than that lengthens its windows,
#: or the search stops: paired windows that noisy cannot resolve the gate's gain
NOISE_CAP = 2.0
#: Two-sided 90 % Student t quantiles by degrees of freedom (pairs - 1), for the claim's interval
_T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def relative_noise(rates: Sequence[float]) -> float:
    """The spread of repeated windows of one configuration, ``(max - min) / median``; 0 with fewer than two."""
    values = [float(r) for r in rates if r is not None and math.isfinite(r) and r > 0]
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def noise_gate(threshold: float, noise: float) -> float:
    """The relative gain a change must clear: ``threshold``, raised by the measured A/A ``noise`` up to twice the
    threshold (one burst of interference in the baseline would otherwise hide every later gain)."""
    return max(threshold, min(noise, NOISE_CAP * threshold))


def paired_bar(pairs: int, gate: float, floor: float = 0.0) -> float:
    """The gain the mean of ``pairs`` paired ratios must clear: ``gate`` for one or two pairs; for more, the
    gate shrinks as the noise of a mean does, ``gate x sqrt(2 / pairs)``, but never below ``floor`` (the
    threshold: the smallest gain worth keeping)."""
    return gate if pairs <= 2 else max(floor, gate * math.sqrt(2.0 / pairs))


def decide_paired(ratios: Sequence[float], gate: float, floor: float = 0.0) -> tuple[bool, str]:
    """One or two pairs: keep when every paired ratio B/A exceeds 1 and their mean clears ``1 + gate``. Three or
    more (a third pair settles two that disagree): keep when most of them exceed 1 and their mean clears
    ``1 +`` :func:`paired_bar`."""
    mean = statistics.fmean(ratios)
    bar = paired_bar(len(ratios), gate, floor)
    shown = " and ".join(f"{r:.3f}x" for r in ratios)
    above = sum(r > 1.0 for r in ratios)
    ok = (above == len(ratios)) if len(ratios) <= 2 else (above > len(ratios) / 2)
    if ok and mean >= 1.0 + bar:
        return True, f"paired {shown} beat the {1 + bar:.2f}x gate"
    return False, f"paired {shown} {'inside' if mean >= 1.0 else 'below'} the {1 + bar:.2f}x gate"


def needs_third_pair(ratios: Sequence[float], gate: float) -> bool:
    """Two pairs that leave the question open: their mean is at least half the gate above 1 but they were not
    kept (one pair below 1, or the mean short of the gate). On a 2-core CPU a real 15-30 % gain of the larger
    micro-batch can measure 1.16 then 0.98, or 1.20 then 0.92 (benchmarks/bench_autopilot_real.py); one more pair
    decides by majority instead of by the unluckiest window."""
    return len(ratios) == 2 and statistics.fmean(ratios) >= 1.0 + gate / 2 and not decide_paired(ratios, gate)[0]


def claimed_speedup(ratios: Sequence[float]) -> tuple[float, float | None, float | None]:
    """The speed-up a set of paired ratios (B ÷ A, each from adjacent windows) bears out: their geometric mean and its
    two-sided 90 % interval from their spread (Student t on the log ratios, ``pairs - 1`` degrees of freedom); no
    interval from one pair."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"claimed_speedup({list(ratios)!r}): needs one or more positive ratios")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = _T90.get(len(logs) - 1, 1.645) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


W = TypeVar("W")


@dataclass
class Pairs(Generic[W]):
    """What :func:`measure_pairs` measured and decided.

    Attributes:
        ratios: the paired ratios B/A, in order (one, two or three).
        windows: the change's windows (B), in order.
        again: the confirmation's A window (the configuration without the change), when it was measured.
        keep: the verdict of :func:`decide_paired`; reason: the verdict in words.
        on: whether the change is applied after the last window (off after the confirmation's A unless a third pair
            put it back on).
    """

    ratios: list[float]
    windows: list[W]
    again: W | None
    keep: bool
    reason: str
    on: bool

    @property
    def last(self) -> W:
        """The change's last window."""
        return self.windows[-1]


def measure_pairs(
    before: W,
    *,
    b: Callable[[bool], W],
    a: Callable[[], W],
    switch: Callable[[bool], str | None],
    ratio: Callable[[W, W], float],
    gate: float,
    confirm: Callable[[float], bool],
    third: Callable[[], bool],
    floor: float = 0.0,
    phase: Callable[[str], None] = lambda name: None,
    fresh: Callable[[W | None], None] = lambda window: None,
) -> Pairs[W]:
    """Measure a change, already applied, against ``before`` (a window of the configuration without it, measured just
    before it went on): A B; A B B A when ``confirm(first ratio)`` (the second pair in reverse order cancels a linear
    drift of the machine's speed); A B B A B when the two pairs leave the question open (:func:`needs_third_pair`)
    and ``third()`` affords it, the last A shared.

    Args:
        b: a window of the change (``True``: its first after being applied, with the change's extra warm-up).
        a: a window of the configuration without it.
        switch: puts the change on (``True``) or takes it off; returns why putting it on failed, else ``None``.
        ratio: ``ratio(b_window, a_window)``, the change's speed over the other's.
        gate: the gain to clear; ``floor``: the smallest gain a third pair's shrunk gate may ask (:func:`paired_bar`).
        phase: told ``"confirmation (A B B A)"`` and ``"a third pair (A B B A B)"`` as they start.
        fresh: told the window of the configuration without the change that nothing was measured after (the
            confirmation's A), or ``None`` once the change was measured since.
    """
    first = b(True)
    fresh(None)
    windows = [first]
    ratios = [ratio(first, before)]
    again: W | None = None
    on = True
    if confirm(ratios[0]):
        phase("confirmation (A B B A)")
        windows.append(b(False))
        switch(False)
        on = False
        again = a()
        fresh(again)
        ratios.append(ratio(windows[-1], again))
    keep, reason = decide_paired(ratios, gate)
    if again is not None and needs_third_pair(ratios, gate) and third():
        phase("a third pair (A B B A B)")
        failure = switch(True)
        if failure is None:
            on = True
            windows.append(b(True))
            fresh(None)
            ratios.append(ratio(windows[-1], again))
            keep, reason = decide_paired(ratios, gate, floor)
        else:
            reason = f"{reason}; re-applying it for a third pair failed: {failure}"
    return Pairs(ratios, windows, again, keep, reason, on)
