"""The end of a trainer entry point under a multi-process strategy: the collectives this process started complete,
and the gloo worker threads have let go of every Python object those collectives held, before Python ends.

Why. A gloo collective runs on one of its group's worker threads, and that thread frees the work object after the
work completed. Freeing it can need the GIL, because a work holds Python objects:

- the Python callbacks chained on its future (torch's PowerSGD hook, our Top-K and QSGD hooks, the doctor's
  communication recorder);
- the Python objects of the tensors it was given, when the caller dropped them first (an ``all_gather`` whose
  output list went out of scope);
- on torch 2.13, every collective issued inside ``backward()``: the backward stashes a copy of the caller's
  ``contextvars`` context in the thread-local state that each work captures, so DDP's own gradient all-reduce holds
  one.

The main thread, woken by the completed future, runs on; the worker waits for the GIL to free the work. On a loaded
machine it can wait through the rest of the script (the main thread takes the GIL back after each short release).
If Python is already finalising when the worker gets its turn, CPython ends that thread in the middle of a C++
destructor: "terminate called without an active exception", exit -6 after all the work was done. A worker that
frees the last reference to its own group (PowerSGD's closures hold ``group_to_use``) after
``destroy_process_group()`` joins itself instead: ``std::system_error: Resource deadlock avoided``, exit -6.

The fix. A gloo worker frees a finished work while it holds its group's queue lock, and every new collective must
take that lock to be queued; the caller waits for it with the GIL released. A barrier therefore first lets every
worker finish freeing what it had finished, then snapshots the work in progress and queued and waits for each of
them. :func:`finish_outstanding_work` runs two such rounds (the second frees what completed during the first) over
every process group this rank belongs to, in creation order (the same on every rank). After it no worker thread
holds a Python object, and the groups are freed on the main thread whenever Python drops them
(``destroy_process_group()``, the strategy's teardown, or Python's own end).

Who calls it. The collection's strategies, from their teardown (:class:`FinishesOutstandingWork`). Under Lightning's
own strategies (``"ddp"``, ``"fsdp"``, ``"deepspeed"``) the last of the collection's callbacks on the Trainer calls
it from its ``teardown`` hook. A script that uses neither calls it once after ``trainer.fit(...)``.

It is collective, so it runs only when the entry point ended normally (every rank reaches its teardown). After an
exception the ranks may not all get there, and a barrier could wait for a rank that is gone: it is skipped, which
leaves the process to end as it would without this module.

Nothing here touches how the process ends: no exit hook, no replaced ``sys.exit``, no ``os._exit``.
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
