"""Every rank: the straggler rule over per-rank stage seconds.

Under DDP every rank waits in the gradient all-reduce for the slowest one, so a straggler shows up on the *other*
ranks as exposed ``communication``. The rule therefore compares each rank's time *outside* the all-reduce (its own
work) with the other ranks', names the stage where the straggler's extra time goes, and reports the others'
communication wait as the straggler's cost, not as a communication problem (:func:`own_communication_share` is
what the all-reduce itself costs: the wait of the rank that waits least).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from lightning_accel.core.findings import STAGES, Finding, Thresholds

__all__ = ["find_stragglers", "own_communication_share"]

_STRAGGLER_FIX = {
    "data": ("give that rank's input pipeline what the others have: check its shard (larger files or samples, "
             "slower storage or a network mount), raise its DataLoader num_workers / prefetch_factor "
             "(DataLoaderTuner) and copy the data set to local disk when one rank reads remotely"),
    "transfer": ("check that rank's host→device path: pin_memory=True + DevicePrefetcher, and its NUMA binding "
                 "(the process should run on the CPU socket attached to its GPU)"),
    "forward": ("find why that rank computes slower: a throttled or slower GPU (nvidia-smi -q -d "
                "PERFORMANCE,CLOCK), another process on its device or cores, or larger batches on it (bucket "
                "variable-length samples so every rank gets equal shapes)"),
    "backward": ("find why that rank computes slower: a throttled or slower GPU (nvidia-smi -q -d "
                 "PERFORMANCE,CLOCK), another process on its device or cores, or larger batches on it (bucket "
                 "variable-length samples so every rank gets equal shapes)"),
    "optimizer": "check that rank's device and cores for contention (another process, CPU frequency)",
    "other": ("move per-step host work off that rank (rank-0-only logging, plotting or checkpoint writes: log every "
              "N steps, AsyncCheckpointIO) and check its cores for contention (OMP_NUM_THREADS per rank)"),
}


def _step(seconds: Mapping[str, float]) -> float:
    return sum(seconds.get(s, 0.0) for s in STAGES)


def own_communication_share(rank_seconds: Sequence[Mapping[str, float]]) -> float | None:
    """The all-reduce's own cost as a share of the mean step: the exposed communication of the rank that waits
    least (the others' extra wait is time spent waiting for a slower rank). ``None`` with fewer than two ranks."""
    if len(rank_seconds) < 2:
        return None
    step = statistics.fmean(_step(r) for r in rank_seconds)
    if step <= 0:
        return None
    return min(r.get("communication", 0.0) for r in rank_seconds) / step


def find_stragglers(rank_seconds: Sequence[Mapping[str, float]], thresholds: Thresholds | None = None) -> list[Finding]:
    """Straggler findings from each rank's mean seconds per batch and stage (index = global rank).

    A rank is a straggler when its time outside the all-reduce exceeds the median of the other ranks' by more than
    ``thresholds.straggler_share`` of the mean step. The finding names the rank, the stage its extra time goes to,
    how much (ms per batch and ×), the other ranks' wait, and the fix for that stage.

    Args:
        rank_seconds: per rank, stage → mean seconds per batch (keys of :data:`~lightning_accel.core.rules.STAGES`).
        thresholds: where the rule fires (``straggler_share``).
    """
    th = thresholds or Thresholds()
    if len(rank_seconds) < 2:
        return []
    for r, seconds in enumerate(rank_seconds):
        for stage, value in seconds.items():
            if stage not in STAGES or value != value or value < 0:
                raise ValueError(f"rank {r}: {stage}={value!r}; give seconds >= 0 per stage of {list(STAGES)}")
    steps = [_step(r) for r in rank_seconds]
    mean_step = statistics.fmean(steps)
    if mean_step <= 0:
        return []
    own = [s - r.get("communication", 0.0) for s, r in zip(steps, rank_seconds)]
    out = []
    for rank, seconds in enumerate(rank_seconds):
        others = [i for i in range(len(rank_seconds)) if i != rank]
        base = statistics.median(own[i] for i in others)
        excess = own[rank] - base
        if excess <= th.straggler_share * mean_step:
            continue
        deltas = {s: seconds.get(s, 0.0) - statistics.median(rank_seconds[i].get(s, 0.0) for i in others)
                  for s in STAGES if s != "communication"}
        stage = max(deltas, key=lambda s: deltas[s])
        wait = statistics.median(rank_seconds[i].get("communication", 0.0) for i in others)
        ratio = f"{own[rank] / base:.1f}x" if base > 0 else "far longer"
        evidence = (f"rank {rank} is a straggler: its batch takes {1e3 * own[rank]:.2f} ms outside the all-reduce "
                    f"against {1e3 * base:.2f} ms on the other ranks (+{1e3 * excess:.2f} ms, {ratio}; threshold "
                    f"+{100 * th.straggler_share:.0f} % of the {1e3 * mean_step:.2f} ms step), mostly in {stage} "
                    f"(+{1e3 * deltas[stage]:.2f} ms per batch)")
        if wait > seconds.get("communication", 0.0):
            evidence += (f"; the other ranks wait for it in the all-reduce: {1e3 * wait:.2f} ms per batch against "
                         f"{1e3 * seconds.get('communication', 0.0):.2f} ms on rank {rank}, which is this "
                         "straggler's cost, not the network's")
        fix = f"rank {rank}'s {stage} is slow: {_STRAGGLER_FIX[stage]}."
        out.append(Finding("straggler", stage, evidence + ".", fix, excess / mean_step))
    return out
