"""Ending a finished multi-process script cleanly: destroy the process groups, and leave safely if they outlive it.

torch's advice is to call ``destroy_process_group()`` before a distributed script exits: left to interpreter exit,
gloo's worker threads are sometimes destroyed while still joinable and the C++ runtime aborts a process that has
finished all its work ("terminate called without an active exception", exit code -6 / 134).

Under DeepSpeed that call is not enough. ZeRO-3 stores the group on every parameter it partitions
(``param.ds_process_group``), and the engine, its optimizer and ``deepspeed.utils.groups`` hold it too, so the
group's C++ object, and its ``pt_gloo_runloop`` / ``gloo_tcp_loop`` threads, live on after ``destroy_process_group``
until the interpreter tears the objects down: the same random abort, measured after a 2-process ZeRO-3 fit on CPU
(10 such threads alive in rank 0 after the call). :func:`exit_distributed` then ends the process without the
interpreter's teardown, once the exit handlers have run and the open files and standard streams are flushed; in a
process that never started a group it is a plain ``sys.exit``.

A user's script should not have to call it: every strategy of the collection calls :func:`register_clean_exit`
when it sets up and again when it tears down, which arranges the same at interpreter exit through ``atexit``.
Measured before (2-process CPU ``ddp_powersgd``): about 1 in 25 finished runs aborted with -6.

A process that leaves keeps the default group's object alive to its end. Destroying the groups in torch's registry
can leave the last reference to a group in a Python callback of a DDP comm hook (PowerSGD's closures hold
``group_to_use``): the gloo worker thread that finishes the callback's work then drops that reference and runs the
group's destructor, which joins the worker threads, that thread among them: "terminate called after throwing an
instance of 'std::system_error' what(): Resource deadlock avoided", exit -6 (gdb: ``~ProcessGroupGloo`` ←
``func_dealloc`` of ``powerSGD_hook``'s ``unpack_uncompressed_tensors_and_allreduce_ps`` ← ``finishWorkGloo`` on
``pt_gloo_runloop``). Measured: 5 of 12 runs of the 12-fit compression test script aborted so, at the end, after
all their work. Kept, the group is never destroyed on any thread: the process leaves before the teardown, as above.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["backend_threads_alive", "destroy_process_groups", "exit_distributed", "register_clean_exit"]

#: thread names of the communication backends' C++ threads (gloo's worker and transport loops, the TCP store)
_BACKEND_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore")


def backend_threads_alive() -> bool:
    """Whether a communication backend's C++ threads still run in this process (Linux: read from ``/proc``).

    Elsewhere, where the threads cannot be listed, DeepSpeed having been imported stands for them.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return "deepspeed" in sys.modules
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while being listed
            continue
        if name.startswith(_BACKEND_THREAD_PREFIXES):
            return True
    return False


#: how long :func:`destroy_process_groups` waits for the backend's threads to end after destroying their groups
THREAD_END_SECONDS = 0.5


def destroy_process_groups() -> bool:
    """Destroy every process group of this process; a no-op when none was started.

    Returns whether backend threads outlive the call (groups still referenced elsewhere, as under DeepSpeed).
    """
    dist = _started_distributed()
    if dist is None:
        return False
    if dist.is_initialized():
        _destroy_registered_groups(dist)
    # the backend's threads end a moment after their group is destroyed: a CI run asked at once and found gloo's
    # still running; a group held elsewhere (DeepSpeed) keeps them, and costs this wait (a leaving process does
    # not wait: _destroy_groups_before_leaving)
    deadline = time.monotonic() + THREAD_END_SECONDS
    while backend_threads_alive():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)
    return False


def _started_distributed() -> Any:
    """``torch.distributed`` if this process imported it and it is usable, else None (nothing to destroy)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() else None


def _destroy_registered_groups(dist: Any) -> None:
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()  # also drops deepspeed.utils.groups' references
    else:
        dist.destroy_process_group()


#: the default groups of a leaving process, kept alive to its end (module docstring: never destroyed on a gloo thread)
_KEPT_TO_THE_END: list[Any] = []


def _destroy_groups_before_leaving() -> bool:
    """:func:`destroy_process_groups` for a process about to leave; returns whether it must leave before the
    interpreter's teardown (backend threads outlive the groups).

    The default group's object is kept alive to the end of the process, so that its destructor never runs on one of
    its own worker threads (module docstring); its threads then outlive the call, and no wait is spent on them.
    """
    dist = _started_distributed()
    if dist is not None and dist.is_initialized():
        _KEPT_TO_THE_END.append(dist.group.WORLD)
        _destroy_registered_groups(dist)
    if _KEPT_TO_THE_END:
        return True
    return destroy_process_groups()


def exit_distributed(code: int = 0) -> NoReturn:
    """End a finished script of a multi-process run: ``exit_distributed()`` as its last line, on every rank.

    Destroys the process groups in torch's registry (keeping the default group's object alive, see the module
    docstring); when backend threads outlive them, runs the ``atexit`` handlers, flushes the files still open, the
    logging handlers and the standard streams, and leaves with ``os._exit(code)`` so that the interpreter's
    teardown cannot abort the finished process. Files the script wrote are complete either way.
    """
    if not _destroy_groups_before_leaving():
        sys.exit(code)
    _leave_before_teardown(code)


def _leave_before_teardown(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush the open files, logging and the standard streams, and ``os._exit(code)``:
    the interpreter's teardown (which can abort on live gloo threads) never runs."""
    atexit.unregister(_at_interpreter_exit)  # leaving already: it would leave again, with its own status
    atexit._run_exitfuncs()
    logging.shutdown()
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced stream
            pass
    os._exit(code)


def _flush_open_files() -> None:
    """Flush every file object still open: the teardown that is skipped would have flushed them as it freed them
    (a script that writes a file and never closes it must not lose the buffered part)."""
    for obj in gc.get_objects():
        try:
            # the type, not isinstance: a dead weakref.proxy raises ReferenceError on any look at it
            if issubclass(type(obj), io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - detached, closed meanwhile, not a real file: leaving must go on
            pass


_exit_code: dict[str, object] = {"code": 0, "known": False}
_original_exit = sys.exit


def _recording_exit(code: object = None) -> NoReturn:
    """``sys.exit`` that remembers the code, for :func:`_at_interpreter_exit`'s ``os._exit``."""
    _exit_code.update(code=code, known=True)
    _original_exit(code)


def _status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # sys.exit("message"): Python prints it and exits 1


def _uncaught_exception() -> BaseException | None:
    """The uncaught exception the script ends on, if any: the interpreter sets ``sys.last_exc`` (3.12+) /
    ``sys.last_value`` when it prints one, before the exit handlers run. Read here rather than through a
    ``sys.excepthook`` of ours: torch's ``init_process_group`` installs its own hook, and so may other libraries."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _at_interpreter_exit() -> None:
    """The ``atexit`` handler of :func:`register_clean_exit`."""
    uncaught = _uncaught_exception()
    if uncaught is not None:  # Python's exit status after an uncaught exception (Ctrl-C: 128 + SIGINT, as a shell)
        status = 130 if isinstance(uncaught, KeyboardInterrupt) else 1
    elif _exit_code["known"]:
        status = _status(_exit_code["code"])
    elif "_pytest" in sys.modules:
        # `python -m pytest` ends with `raise SystemExit(status)`, which no hook sees: never turn a failing test
        # run into exit 0; leave through the interpreter's teardown (as without this handler), the groups
        # destroyed outright so that their threads are joined before it
        destroy_process_groups()
        return
    else:
        status = 0
    if not _destroy_groups_before_leaving():
        return  # no group was started, no backend thread outlives: the interpreter's own teardown is safe
    # backend threads outlive the groups: run the other exit handlers, flush, and leave before teardown
    _leave_before_teardown(status)


def register_clean_exit() -> None:
    """Arrange a clean end for this process at interpreter exit, without the script calling anything.

    At exit the handler destroys the process groups (torch's advice: left to interpreter teardown, gloo's threads
    are sometimes destroyed while joinable and abort the finished process with -6); as backend threads outlive
    them (the default group's object is kept, see the module docstring; DeepSpeed keeps references too), it runs
    the remaining exit handlers, flushes the open files, logging and the standard streams and leaves with
    ``os._exit`` and the script's exit status (0, ``sys.exit(n)``'s ``n``, or 1 after an
    uncaught exception; a bare ``raise SystemExit(n)`` is not seen by any hook and counts as 0 there, so end such
    a script with ``sys.exit(n)``; under pytest, whose ``-m`` entry raises SystemExit, an unseen status leaves
    through the normal teardown instead). Idempotent; each call moves the
    handler to the end of the ``atexit`` list, so that it runs first and the others, run from it, run once
    (a handler registered after the last call would run twice on that path).
    """
    atexit.unregister(_at_interpreter_exit)
    atexit.register(_at_interpreter_exit)
    global _original_exit
    if sys.exit is not _recording_exit:
        _original_exit = sys.exit  # whatever is installed now (another library may have wrapped it too)
        sys.exit = _recording_exit
