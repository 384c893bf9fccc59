"""The protocol of the Autopilot's fixes: :class:`Run` (what a fix may look at and change) and
:class:`Intervention` (the base class: ``change(run, undo)`` or ``apply`` + ``revert``). The contract: docs/autopilot.md,
Fixes of your own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lightning_accel.core.autopilot import Undo

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource
    from lightning_accel.callbacks.autopilot.windows import RunConfig, TrialRunner, Window

__all__ = ["Intervention", "Run"]


@dataclass
class Run:
    """What an intervention may look at and change."""

    trainer: pl.Trainer
    module: pl.LightningModule
    source: TrainLoaderSource
    config: RunConfig
    runner: TrialRunner
    baseline: Window | None = None
    current: Window | None = None
    steps_left: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.trainer.strategy.root_device


class Intervention:
    """Base class of the Autopilot's fixes (the contract is in docs/autopilot.md, Fixes of your own). Subclasses may be passed to
    ``Autopilot(interventions=[...])`` to trial fixes of your own with the same protocol and numerics guard."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "exact"
    knobs: ClassVar[tuple[str, ...]] = ()
    #: estimated extra warm-up steps the change needs (compilation)
    warmup_steps: ClassVar[int] = 0
    #: after being kept, a fresh instance may be trialled again (a micro-batch doubled once more)
    repeatable: ClassVar[bool] = False
    #: the numerics probe runs through the strategy's wrapper (DDP), with collectives (communication changes)
    probe_through_strategy: ClassVar[bool] = False

    def __init__(self, **params: Any) -> None:
        self.params = dict(params)

    def setup_seconds(self, run: Run) -> float:
        """Seconds of one-off work a trial pays before its windows (a first compile); the search costs the trial
        with it against its budget."""
        return 0.0

    def unavailable(self, run: Run) -> str | None:
        return None

    def apply(self, run: Run) -> Undo:
        """Make the change and return its undo. If :meth:`change` raises, what it did so far is undone first."""
        undo = Undo()
        try:
            self.change(run, undo)
        except BaseException as err:
            try:
                undo()
            except BaseException as undo_err:  # noqa: BLE001 - the original error is the one to see
                err.add_note(f"undoing the partial {self.name} change also raised {undo_err!r}")
            raise
        self._undo = undo
        return undo

    def change(self, run: Run, undo: Undo) -> None:
        """Make the change, pushing onto ``undo`` the undo of each part as it is made (or override ``apply`` and
        ``revert`` instead, as fixes written for earlier versions do)."""
        raise NotImplementedError(f"{type(self).__name__}: implement change(run, undo), or apply(run) and revert(run)")

    def revert(self, run: Run) -> None:
        """Undo the last :meth:`apply` (nothing if it is undone already)."""
        undo = self.__dict__.pop("_undo", None)
        if undo is not None:
            undo()

    def describe(self, run: Run) -> str:
        return self.name

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return [], []

    def changed_nothing(self, run: Run) -> str | None:
        """Asked after the numerics probe ran training steps with the change: why it turned out to change nothing
        (it is then rejected without being measured), or ``None``."""
        return None

    def judge(self, run: Run, before: Window, after: Window) -> tuple[bool, str] | None:
        """An extra condition for keeping the change once it measured faster (``None``: none)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"
