"""The end of an entry point under Lightning's own multi-process strategies: the last of the collection's callbacks
on the Trainer completes the outstanding collectives, as the collection's strategies do from their teardown.

Why the callbacks. Lightning's ``"ddp"``, ``"fsdp"`` and ``"deepspeed"`` strategies end without waiting for the gloo
worker threads to free the collectives they ran, and a worker that frees one after Python began to end aborts the
process (:mod:`lightning_accel.strategies.outstanding_work` says how). A Trainer that holds any of our callbacks ends
its fits as one under our strategies does. Each callback calls :func:`finish_collectives_at_teardown` from its
``teardown`` hook; only the last of ours in ``trainer.callbacks`` runs the barriers, once per entry point, and every
rank holds the same callbacks in the same order, so every rank runs the same barriers. Lightning calls ``teardown``
only after an entry point that ended normally, so a rank that died is never waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

__all__ = ["finish_collectives_at_teardown"]

_PACKAGE = "lightning_accel."


def _is_ours(callback: object) -> bool:
    # a user's subclass of one of our callbacks is ours too
    return any(cls.__module__.startswith(_PACKAGE) for cls in type(callback).__mro__)


def finish_collectives_at_teardown(callback: Callback, trainer: pl.Trainer) -> None:
    """From ``callback.teardown``: complete the outstanding collectives if ``callback`` is the last of the
    collection's callbacks on ``trainer`` and the strategy does not do it itself; collective."""
    if trainer.world_size < 2:
        return
    from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork, finish_outstanding_work

    if isinstance(trainer.strategy, FinishesOutstandingWork):
        return  # it ran in the strategy's teardown, which Lightning calls before the callbacks'
    ours = [cb for cb in trainer.callbacks if _is_ours(cb)]
    if ours and ours[-1] is callback:
        finish_outstanding_work()
