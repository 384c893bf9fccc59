"""Ending a finished multi-process script cleanly: destroy the process groups, and leave safely if they outlive it.

torch's advice is to call ``destroy_process_group()`` before a distributed script exits: left to interpreter exit,
gloo's worker threads are sometimes destroyed while still joinable and the C++ runtime aborts a process that has
finished all its work ("terminate called without an active exception", exit code -6 / 134).

Under DeepSpeed that call is not enough. ZeRO-3 stores the group on every parameter it partitions
(``param.ds_process_group``), and the engine, its optimizer and ``deepspeed.utils.groups`` hold it too, so the
group's C++ object, and its ``pt_gloo_runloop`` / ``gloo_tcp_loop`` threads, live on after ``destroy_process_group``
until the interpreter tears the objects down: the same random abort, measured after a 2-process ZeRO-3 fit on CPU
(10 such threads alive in rank 0 after the call). :func:`exit_distributed` then ends the process without the
interpreter's teardown, once the exit handlers have run and the standard streams are flushed; where nothing
outlives the groups it is a plain ``sys.exit``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

__all__ = ["backend_threads_alive", "destroy_process_groups", "exit_distributed"]

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


def destroy_process_groups() -> bool:
    """Destroy every process group of this process; a no-op when none was started.

    Returns whether backend threads outlive the call (groups still referenced elsewhere, as under DeepSpeed).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return False
    if dist.is_initialized():
        deepspeed_comm = sys.modules.get("deepspeed.comm")
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()  # also drops deepspeed.utils.groups' references
        else:
            dist.destroy_process_group()
    return backend_threads_alive()


def exit_distributed(code: int = 0) -> NoReturn:
    """End a finished script of a multi-process run: ``exit_distributed()`` as its last line, on every rank.

    Destroys the process groups; when backend threads outlive them, runs the ``atexit`` handlers, flushes the
    logging handlers and standard streams, and leaves with ``os._exit(code)`` so that the interpreter's teardown
    cannot abort the finished process. Files the script wrote and closed are complete either way.
    """
    if not destroy_process_groups():
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced stream
            pass
    os._exit(code)
