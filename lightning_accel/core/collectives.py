"""A bounded all-gather for the collection's own collectives (the doctor's windows, the Autopilot's agreement):
a rank that died or hangs makes the others fail within a bounded time with a message naming it, never hang.

torch only. On gloo a peer that died closes its sockets and the collective fails at once, but gloo's error names a
socket address, not a rank; a peer that hangs blocks the collective for the process group's timeout (30 minutes
by default). :func:`all_gather_bounded` waits at most ``timeout_s`` and then, on gloo, runs a short
``monitored_barrier(wait_all_ranks=True)``, whose error names every rank that does not answer; on NCCL (which
has no monitored barrier) the message names this rank and the collective.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

__all__ = ["COLLECTIVE_TIMEOUT_S", "RankFailure", "all_gather_bounded"]

#: seconds one of our collectives waits before it declares a peer lost (``LIGHTNING_ACCEL_COLLECTIVE_TIMEOUT_S``)
COLLECTIVE_TIMEOUT_S = float(os.environ.get("LIGHTNING_ACCEL_COLLECTIVE_TIMEOUT_S", "300"))
_PROBE_TIMEOUT_S = 10.0


class RankFailure(RuntimeError):
    """Another rank did not take part in one of the collection's collectives (it died, hangs, or diverged)."""


def _missing_ranks(dist: Any) -> str:
    """On gloo: which ranks do not answer a short monitored barrier (its error names them); else ''."""
    try:
        if dist.get_backend() != "gloo":
            return ""
        dist.monitored_barrier(
            timeout=datetime.timedelta(seconds=_PROBE_TIMEOUT_S),
            wait_all_ranks=True,
        )
    except RuntimeError as err:  # "Ranks 1, 3 failed to pass monitoredBarrier" or a closed connection
        return str(err).strip().splitlines()[0][:300]
    return ""


def all_gather_bounded(tensor: torch.Tensor, *, what: str, timeout_s: float | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked as ``(world_size, *tensor.shape)``; raises :class:`RankFailure` after at
    most ``timeout_s`` (default :data:`COLLECTIVE_TIMEOUT_S`) plus a 10 s probe if a rank does not take part.

    Args:
        tensor: this rank's contribution (same shape and dtype on every rank).
        what: the collective's purpose, for the message (e.g. ``"BottleneckDoctor window"``).
        timeout_s: seconds to wait for the other ranks.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    out = [torch.empty_like(tensor) for _ in range(world)]
    limit = COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        work = dist.all_gather(out, tensor.contiguous(), async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:
        rank = dist.get_rank()
        missing = _missing_ranks(dist)
        if "monitoredBarrier" not in missing and world == 2:  # a closed connection: the only peer is the other rank
            missing = f"rank {1 - rank} stopped ({missing or 'no answer'})"
        raise RankFailure(
            f"{what}: rank {rank} of {world} waited for the other ranks' all_gather and it failed "
            f"within {limit:g} s ({str(err).strip().splitlines()[0][:200]}); "
            f"{missing or 'the rank that stopped is named in its own log'}. Set "
            "LIGHTNING_ACCEL_COLLECTIVE_TIMEOUT_S to wait longer."
        ) from err
    return torch.stack(out)
