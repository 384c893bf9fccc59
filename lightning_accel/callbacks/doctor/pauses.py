"""The moments between the doctor's batches: validation, checkpoint saving and the epoch's end pause the stage clock
and open a phase of the fit's clock. The base of :class:`~lightning_accel.callbacks.doctor.measure.DoctorMeasure`;
see ``docs/measuring/doctor.md``, "Findings"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_accel.core.phases import FitClock
    from lightning_accel.core.stages import StageMachine

__all__ = ["FitPauses", "guarded"]


def guarded(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a moment's body; a measuring problem warns once and stops the stage timing, never the training."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.broken:
                return None
            try:
                return fn(self, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - measuring must never stop training
                self.stop(f"{what}: {err!r}")
                return None

        return wrapper

    return decorate


class FitPauses:
    """What is not a training batch: the stage clock pauses and the fit's clock charges its own phase.

    The measuring object sets the state; a measuring problem (:meth:`stop`) stops the stage clock, never the
    fit's phases.
    """

    machine: StageMachine | None
    fit_clock: FitClock
    broken: bool
    epoch_paused: bool
    in_validation: bool
    validation_hooks_only: bool

    def stop(self, what: str) -> None:
        raise NotImplementedError

    @guarded("_pause")
    def pause(self) -> None:
        if self.machine is not None:
            self.machine.pause()

    @guarded("_resume")
    def resume(self) -> None:
        if self.machine is not None:
            self.machine.resume()

    def epoch_end(self) -> None:
        # The time between epochs (epoch-end checkpoints, a new iterator) is not a batch's data wait: the clock
        # pauses until the next epoch starts.
        if not self.epoch_paused and self.machine is not None:
            self.epoch_paused = True
            self.pause()

    @guarded("_resume_after_epoch")
    def epoch_start(self) -> None:
        if self.epoch_paused and self.machine is not None:  # the gap between two epochs is not part of any batch
            self.epoch_paused = False
            self.machine.resume()

    def validation_begin(self, sanity: bool) -> bool:
        """The validation loop's ``run`` starts (in ``fit``): open the phase (its run is counted at
        :meth:`validation_start`, which a loop with no batches never reaches)."""
        if self.in_validation:
            return False
        self.in_validation = True
        self.fit_clock.enter("validation", sanity=sanity, count=False)
        self.pause()
        return True

    def validation_end(self, opened: bool) -> None:
        if opened:
            self.in_validation = False
            self.fit_clock.exit("validation")
            self.resume()

    def validation_start(self, sanity: bool) -> None:
        """The first validation hook (in ``fit``): count the run, or time it from the hooks when the loop's run
        was not wrapped (timers not installed)."""
        if self.in_validation:
            self.fit_clock.count_run("validation", sanity=sanity)
            return
        self.in_validation = self.validation_hooks_only = True
        self.fit_clock.enter("validation", sanity=sanity)
        self.pause()

    def validation_stop(self) -> None:
        """The last validation hook (in ``fit``): close the phase if the hooks opened it."""
        if not self.validation_hooks_only:
            return
        self.in_validation = self.validation_hooks_only = False
        self.fit_clock.exit("validation")
        self.resume()

    def checkpoint_begin(self, save: bool) -> None:
        try:
            self.fit_clock.enter("checkpoint", count=save)
            if self.machine is not None and not self.broken:
                self.machine.pause()
        except Exception as err:  # noqa: BLE001
            self.stop(f"save_checkpoint: {err!r}")

    def checkpoint_end(self, _token: Any) -> None:
        try:
            if self.machine is not None and not self.broken:
                self.machine.resume()
            self.fit_clock.exit("checkpoint")
        except Exception as err:  # noqa: BLE001
            self.stop(f"save_checkpoint: {err!r}")
