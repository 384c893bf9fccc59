"""Checkpoints written in a background thread (:class:`AsyncCheckpoint`): the Autopilot's fix outside the step.

Trialled after the step search by ``callbacks/autopilot/checkpoint_trial.py`` (its periods are one save plus steps),
never by the search itself; replayed from a plan like every other change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["AsyncCheckpoint"]


def _saves_through_checkpoint_io(strategy: Any) -> bool:
    """Whether the strategy writes its checkpoints through ``strategy.checkpoint_io`` (the base ``Strategy``'s
    ``save_checkpoint``: single device, DDP and this collection's ``ddp_*``; not DeepSpeed or sharded strategies)."""
    from lightning.pytorch.strategies import Strategy

    return type(strategy).save_checkpoint is Strategy.save_checkpoint


class AsyncCheckpoint(Intervention):
    """Checkpoints written by :class:`~lightning_accel.checkpoint_io.OrderedAsyncCheckpointIO` (a background
    thread) instead of on the training thread; same files, same cadence. Trialled after the step search, by
    ``callbacks/autopilot/checkpoint_trial.py`` (its windows are a save plus steps), never by the search itself."""

    name = "async_checkpoint"
    kind = "exact"
    knobs = ("checkpoint_io",)

    def unavailable(self, run: Run) -> str | None:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        strategy = run.trainer.strategy
        if not run.trainer.checkpoint_callbacks:
            return "no ModelCheckpoint in this fit"
        if not _saves_through_checkpoint_io(strategy):
            return f"{type(strategy).__name__} writes its own checkpoints (not through a CheckpointIO plugin)"
        if isinstance(strategy.checkpoint_io, AsyncCheckpointIO):
            return "checkpoints are already written in the background (AsyncCheckpointIO)"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.checkpoint_io import OrderedAsyncCheckpointIO

        strategy = run.trainer.strategy
        previous = strategy.checkpoint_io
        background = OrderedAsyncCheckpointIO(previous)

        def restore() -> None:
            try:
                background.teardown()  # every queued write finished (or its error raised) before going back
            finally:
                strategy.checkpoint_io = previous

        undo.push(restore)
        strategy.checkpoint_io = background

    def describe(self, run: Run) -> str:
        return "OrderedAsyncCheckpointIO (checkpoints written in a background thread)"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return (
            [("trainer.plugins", [{"class_path": "lightning_accel.OrderedAsyncCheckpointIO"}])],
            ["trainer_kwargs.setdefault('plugins', []).append(la.OrderedAsyncCheckpointIO())"],
        )
