"""The claim (:meth:`Claim._claim`): the kept set against the untouched configuration in fresh paired windows after the
search (B A, A B, B A), its geometric mean with a 90 % interval, and the kept set reverted when it measures slower
beyond the noise."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lightning_accel.core.autopilot.bundle import Bundles
from lightning_accel.core.autopilot.pairing import claimed_speedup
from lightning_accel.core.autopilot.plan import Outcome
from lightning_accel.core.autopilot.protocol import MeasurementLike
from lightning_accel.core.autopilot.trials import rate_ratio, short_error, undo_all

__all__ = ["Claim"]


class Claim(Bundles):
    """The trials, the bundle, and the claim."""

    if TYPE_CHECKING:

        def _loop(self, tried: set[str] | None = None) -> None: ...

    def _claim(self) -> None:
        """The speed-up the search claims: the kept set against the untouched configuration, measured the way
        decisions are (adjacent windows, pairs in alternating order: B A, A B, B A), not the winning windows of the
        last trial. A kept set measured slower than the untouched configuration beyond the noise (the interval's
        upper end below 1) is reverted. A kept change that costs one-off work to re-apply (a compile) is not
        toggled: the claim is then the product of the kept trials' paired ratios, labelled so."""
        result = self.result
        if not result.kept:
            return
        trials = [r.ratio for r in result.records[1:] if r.kept and r.ratio is not None and r.name != "final A/B"]
        toggles = len(self._kept) == len(result.kept) and not any(
            int(c.warmup_steps) > 0 or float(c.setup_seconds()) > 0 for c, _ in self._kept
        )
        if self.final_pairs == 0 or not toggles:
            if trials:
                result.speedup, result.speedup_source = math.prod(trials), "trials"
            return
        started = self.backend.clock()
        record = self._new_record("final A/B", " + ".join(c.describe() for c, _ in self._kept))
        ratios: list[float] = []
        on = True
        try:
            self._phase("final check: kept set vs untouched", "final A/B", record.index)
            # every window its own, the first too: the trial's last window of the kept set is the one that won, and
            # reusing it would carry its luck into the claim
            pending: MeasurementLike | None = None
            for pair in range(self.final_pairs):
                if pair % 2 == 0:  # B then A
                    kept_window = pending or self._measure()
                    self._switch_kept(off=True)
                    on = False
                    untouched = self._measure()
                    pending = self._measure() if pair + 1 < self.final_pairs else None
                else:  # A then B (the A measured at the end of the last pair)
                    assert pending is not None
                    untouched = pending
                    self._switch_kept(off=False)
                    on = True
                    kept_window = self._measure()
                    pending = None  # the next pair measures its own B: no window counts in two pairs
                ratios.append(rate_ratio(kept_window, untouched))
            if not on:
                self._switch_kept(off=False)
                on = True
            speedup, low, high = claimed_speedup(ratios)
            result.final_ratios = ratios
            result.speedup, result.speedup_low, result.speedup_high = speedup, low, high
            result.speedup_source = "final A/B"
            record.ratio, record.kept = speedup, True
            shown = " ".join(f"{r:.3f}" for r in ratios)
            interval = f" (90 % interval {low:.2f}-{high:.2f})" if low is not None and high is not None else ""
            record.reason = f"kept set ÷ untouched, paired {shown}: {speedup:.2f}x{interval}"
            slower, _ = self.backend.agree(high is not None and high < 1.0, None)
            if slower:
                self._switch_kept(off=True)
                on = False
                reverted = ", ".join(c.describe() for c, _ in self._kept)
                self._reverted = [c for c, _ in self._kept]
                result.kept, self._kept = [], []
                # the untouched configuration is current again: its window, its numerics reference, no held gains
                self._current, self._current_rates, self._fresh, self._held = (
                    untouched,
                    [untouched.samples_per_sec],
                    None,
                    [],
                )
                self.backend.adopt(untouched, None)
                record.kept = False
                record.reason += "; slower than the untouched configuration beyond the noise: reverted"
                result.notes.append(
                    f"the kept set ({reverted}) measured {speedup:.2f}x{interval} against the untouched "
                    "configuration: reverted to it"
                )
            elif low is not None and low <= 1.0:
                record.reason += "; not resolved from 1.0 at this noise"
        except Exception as err:  # noqa: BLE001 - the claim falls back to the trials' ratios
            record.outcome = Outcome.FAILED
            record.reason = f"failed during the final check: {type(err).__name__}: {short_error(err)}"
            if not on:
                try:
                    self._switch_kept(off=False)
                except Exception as again:  # noqa: BLE001
                    result.notes.append(f"re-applying the kept set after the final check raised {again!r}")
                    result.kept, self._kept = [], []
            if result.speedup is None and trials:
                result.speedup, result.speedup_source = math.prod(trials), "trials"
        finally:
            record.seconds = result.final_seconds = self.backend.clock() - started
            self.backend.restore()
            self._record(record)

    def _switch_kept(self, *, off: bool) -> None:
        """Take every kept change off (their undos, last first) or put them back on in order (their undos renewed)."""
        if off:
            undo_all([undo for _, undo in self._kept])
            return
        candidates = [c for c, _ in self._kept]
        undos, failure = self._apply_all(candidates)
        if failure is not None:
            raise RuntimeError(f"re-applying the kept set failed: {failure}")
        self._kept = list(zip(candidates, undos))

    def _search_again(self) -> bool:
        """After the final A/B reverted the kept set: the candidates measured on top of its first change were judged
        against a configuration that is gone (one lucky keep takes the real gains measured after it along), so they
        are trialled again against the untouched configuration while the budget allows, the first decision with its
        confirmation pair. Once; True when something was kept again."""
        reverted, self._reverted = self._reverted, []
        if not reverted:
            return False
        records = self.result.records
        first = next((i for i, r in enumerate(records) if r.index and r.kept and r.name == reverted[0].name), None)
        if first is None:  # kept through a bundle only: no trial of its own to count from
            return False
        again = {r.name for r in records[first + 1 :] if r.ratio is not None and r.name != "final A/B"}
        again.discard(reverted[0].name)
        if not again:
            return False
        self.result.notes.append(
            f"{', '.join(sorted(again))} measured on top of the reverted {reverted[0].describe()}: trialled again "
            "against the untouched configuration"
        )
        self._settling = True
        self._loop(tried={r.name for r in records} - again)
        return bool(self.result.kept)
