"""The held small gains tried together (:meth:`Bundles._bundle`): each measured faster than the configuration before
it but below the gate alone, applied together, guarded (split on a numerics failure, the culprit dropped), and confirmed
A B B A with :func:`~lightning_accel.core.autopilot.pairing.measure_pairs`."""

from __future__ import annotations

from collections.abc import Callable

from lightning_accel.core.autopilot.pairing import measure_pairs
from lightning_accel.core.autopilot.plan import Outcome, TrialRecord
from lightning_accel.core.autopilot.protocol import Bundle, Candidate, without_alternatives
from lightning_accel.core.autopilot.trials import Trials, rate_ratio, short_error, undo_all

__all__ = ["Bundles"]


class Bundles(Trials):
    """The trials, and the bundle of held small gains."""

    def _apply_each(self, members: list[Candidate]) -> tuple[list[Callable[[], None]], list[Candidate], list[str]]:
        """Apply the members that apply (a held change may no longer fit the configuration): undos, members
        applied, and the dropped ones with their reasons."""
        undos: list[Callable[[], None]] = []
        applied: list[Candidate] = []
        dropped: list[str] = []
        for member in members:
            undo, failure = self._apply(member)
            if undo is None:
                dropped.append(f"{member.name} (could not apply: {failure})")
                continue
            undos.append(undo)
            applied.append(member)
        return undos, applied, dropped

    def _split(self, bundle: Bundle, index: int, dropped: list[str]) -> tuple[Bundle, list[Callable[[], None]]]:
        """A bundle that failed numerics, its members added one at a time with the guard after each: a member that
        breaks the numbers is dropped (named in ``dropped``). Returns the survivors and their undos."""
        undos: list[Callable[[], None]] = []
        survivors: list[Candidate] = []
        for member in bundle.members:
            undo, failure = self._apply(member)
            if undo is None:
                dropped.append(f"{member.name} ({failure})")
                continue
            probe = TrialRecord(index, "bundle", "", None, None, False, "")
            culprit = self._guard(Bundle([*survivors, member]), probe)
            if culprit is None:
                undos.append(undo)
                survivors.append(member)
            else:
                undo()
                dropped.append(f"{member.name} ({culprit[1]})")
        return Bundle(survivors), undos

    def _bundle(self) -> bool:
        """Apply the held changes together, guard, split on a numerics failure, confirm A B B A; True if kept."""
        backend = self.backend
        held, self._held = sorted(self._held, key=lambda h: -h.ratio), []
        members, alternatives = without_alternatives([h.candidate for h in held])
        bundle = Bundle(members)
        started = backend.clock()
        record = self._new_record("bundle", " + ".join(m.describe() for m in bundle.members))
        index = record.index
        undos: list[Callable[[], None]] = []
        kept = False
        try:
            self._phase("measuring the current configuration", "bundle", index)
            before = self._measure_current()
            self._phase("numerics probe", "bundle", index)
            undos, applied, dropped = self._apply_each(bundle.members)
            dropped = [*alternatives, *dropped]
            if len(applied) < 2:
                record.outcome, record.reason = Outcome.REJECTED, "bundle not formed: " + "; ".join(dropped)
                return False
            bundle = Bundle(applied)
            if self._guard(bundle, record) is not None:  # split: add the members one at a time, the guard after each
                undo_all(undos)
                bundle, undos = self._split(bundle, index, dropped)
                if not bundle.members:
                    record.outcome = Outcome.REJECTED
                    record.reason = "numerics guard failed on the bundle; split: " + "; ".join(dropped)
                    return False
            record.change = " + ".join(m.describe() for m in bundle.members)
            self._phase("measuring", "bundle", index)
            warm = bundle.warmup_steps

            def switch(on: bool) -> str | None:
                nonlocal undos
                if on:
                    undos, failure = self._apply_all(bundle.members)
                    return failure
                undo_all(undos)
                undos = []
                return None

            pairs = measure_pairs(
                before,
                b=lambda first: self._measure(warm if first else 0),
                a=self._measure,
                switch=switch,
                ratio=rate_ratio,
                gate=self._gate,
                floor=self.threshold,
                confirm=lambda r: True,
                third=lambda: self._affords(1.2 * self._window_seconds),
                phase=lambda name: self._phase(name, "bundle", index),
                fresh=self._set_fresh,
            )
            keep, reason = pairs.keep, pairs.reason
            if keep and not undos:  # back on after the last A window
                undos, failure = self._apply_all(bundle.members)
                if failure is not None:
                    keep = False
                    reason = f"{reason}; re-applying it after the confirmation failed: {failure}"
            if dropped:
                reason = f"{reason}; dropped: " + "; ".join(dropped)
            self._score(record, pairs.windows, pairs.ratios)
            record.shares = pairs.last.shares()
            record.reason = reason
            if keep:
                kept = True
                # the last window measured is the third pair's B (the bundle, current now) or the confirmation's A
                self._fresh = pairs.last if len(pairs.ratios) == 3 else None
                self.result.kept.extend(bundle.members)
                self._kept.extend(zip(bundle.members, undos))
                for h in held:
                    if h.candidate in bundle.members:
                        h.record.kept = True
                        h.record.reason += f"; kept in the bundle (trial {index})"
                self._adopt(pairs.last, [w.samples_per_sec for w in pairs.windows])
            return kept
        except Exception as err:  # noqa: BLE001
            record.outcome, record.reason = (
                Outcome.FAILED,
                f"failed during the trial: {type(err).__name__}: {short_error(err)}",
            )
            return False
        finally:
            record.kept = kept
            record.seconds = backend.clock() - started
            if not kept:
                try:
                    undo_all(undos)
                except Exception as err:  # noqa: BLE001
                    self.result.notes.append(f"reverting the bundle raised {err!r}")
            backend.restore()
            self._record(record)
