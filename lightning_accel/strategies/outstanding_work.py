"""The end of a trainer entry point under a multi-process strategy: the collectives this process started complete,
and the gloo worker threads have let go of every Python object those collectives held, before Python ends.

Otherwise a worker that frees one while Python finalises aborts the process (exit -6). Collective, and only after an
entry point that ended normally. See docs/distributed.md ("How processes end").
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from typing_extensions import override

__all__ = ["FinishesOutstandingWork", "finish_collectives_at_teardown", "finish_outstanding_work"]

log = logging.getLogger(__name__)

#: barrier rounds over every group: the first lets the workers free what had finished and completes the rest, the
#: second frees what completed during the first
_ROUNDS = 2


def finish_outstanding_work() -> None:
    """Wait until every collective this process started has completed and its worker thread has freed it (with the
    Python objects it held); collective.

    Every rank must call it at the same point: the collection's strategies call it from their teardown, the last of
    the collection's callbacks from its ``teardown`` under Lightning's own strategies, and a script that uses
    neither calls it after ``trainer.fit(...)``. A no-op when no process group is initialised. A barrier that fails
    (a peer that already left) is logged and ends the wait: the end of a fit must not raise over what it finished.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from lightning_accel import _compat

    for _round in range(_ROUNDS):
        for group in _compat.process_groups_of_this_rank():
            if not _barrier(dist, group):
                return


def _barrier(dist: Any, group: Any) -> bool:
    """One barrier on ``group``; False (logged) when it failed."""
    try:
        if dist.get_backend(group) == "nccl":
            import torch

            dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier(group=group)
    except Exception as err:  # noqa: BLE001 - a peer gone at the end: its own status tells; this rank goes on
        log.warning(
            "lightning_accel: the barrier that completes the outstanding collectives of process group "
            "%r failed (%s: %s); a peer may have left already",
            getattr(group, "group_name", group),
            type(err).__name__,
            err,
        )
        return False
    return True


class FinishesOutstandingWork:
    """Strategy mixin: after an entry point (fit, validate, test, predict) that ended normally, complete the
    outstanding collectives before the strategy tears down (:func:`finish_outstanding_work`).

    List it before the Lightning strategy class: ``class MyStrategy(FinishesOutstandingWork, DDPStrategy)``.
    """

    _ended_on_exception = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._ended_on_exception = True
        super().on_exception(exception)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        ended_on_exception, self._ended_on_exception = self._ended_on_exception, False
        if not ended_on_exception:
            finish_outstanding_work()
        super().teardown()  # type: ignore[misc]


_PACKAGE = "lightning_accel."


def _is_ours(component: object) -> bool:
    # a user's subclass of one of our callbacks or data modules is ours too
    return any(cls.__module__.startswith(_PACKAGE) for cls in type(component).__mro__)


def finish_collectives_at_teardown(component: object, trainer: Any) -> None:
    """From the ``teardown`` hook of one of our callbacks or data modules: :func:`finish_outstanding_work` if
    ``component`` is the last of ours that Lightning tears down and the strategy is not one of ours; collective.

    Lightning's own strategies (``"ddp"``, ``"fsdp"``, ``"deepspeed"``) end without it, so a Trainer that holds any of
    our callbacks or data modules runs it from theirs. Only the last of ours in the order Lightning calls those hooks
    (the data module, then ``trainer.callbacks``) runs it: once per entry point, and the same barriers on every rank,
    which holds the same components in the same order. Lightning calls ``teardown`` only after an entry point that
    ended normally, so a rank that died is never waited for.
    """
    if trainer is None or trainer.world_size < 2:  # a data module used outside a Trainer, or one process
        return
    if isinstance(trainer.strategy, FinishesOutstandingWork):
        return  # it ran in the strategy's teardown, which Lightning calls before these hooks
    in_teardown_order = [trainer.datamodule, *trainer.callbacks]
    ours = [c for c in in_teardown_order if c is not None and _is_ours(c)]
    if ours and ours[-1] is component:
        finish_outstanding_work()
