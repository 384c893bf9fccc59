"""The end of a trainer entry point under a multi-process strategy: the collectives this process started complete,
and the Python callbacks they hold are released, before the strategy lets go of its process groups.

Why. A DDP communication hook chains Python callbacks on the futures of its collectives (torch's PowerSGD hook
does; so do the Top-K and QSGD hooks and the doctor's communication recorder). On gloo, a callback runs on one of
the group's worker threads, and that thread releases the callback only after the future it feeds has completed:
the main thread, woken by that future, can run ahead while the worker still waits for the GIL to drop the callback.
Two failures follow from a callback released late:

- The callback may hold the last reference to its group (PowerSGD's closures hold ``group_to_use``). If the main
  thread drops every other reference first (``destroy_process_group()``, as torch advises at the end of a script),
  the worker frees the group, whose destructor joins the worker threads, itself among them: ``std::system_error:
  Resource deadlock avoided``, exit -6 after all the work was done.
- If the interpreter is already finalising when the worker asks for the GIL, CPython ends that thread in the middle
  of a C++ destructor: "terminate called without an active exception", exit -6.

The fix is to wait until the outstanding work has completed in full. A gloo barrier does exactly that: it snapshots
the work in progress and queued on its group and waits for each to finish, and a gloo work finishes only after its
future's callbacks have run and been released. :func:`finish_outstanding_work` runs one barrier per process group
this rank belongs to, in creation order (the same on every rank), while the main thread waits with the GIL released.
After it, no worker thread holds a Python callback, and the last reference to a group is dropped on the main thread
whenever Python drops it (``destroy_process_group()``, the strategy's teardown, or Python's own end), with its worker
threads idle and joined.

It is collective, so it runs only when the entry point ended normally (every rank reaches its teardown). After an
exception the ranks may not all get there, and a barrier could wait for a rank that is gone: it is skipped, which
leaves the process to end as it would without this module.

Nothing here touches how the process ends: no exit hook, no replaced ``sys.exit``, no ``os._exit``.
"""

from __future__ import annotations

import logging
import sys

from typing_extensions import override

__all__ = ["FinishesOutstandingWork", "finish_outstanding_work"]

log = logging.getLogger(__name__)


def finish_outstanding_work() -> None:
    """Wait until every collective this process started has completed and released its callbacks; collective.

    Every rank must call it at the same point (the strategies call it from their teardown after an entry point that
    ended normally). A no-op when no process group is initialised. A barrier that fails (a peer that already left)
    is logged and the others still run: the end of a fit must not raise over what it finished.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from lightning_accel import _compat

    for group in _compat.process_groups_of_this_rank():
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
