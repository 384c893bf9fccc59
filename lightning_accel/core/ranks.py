"""Every rank: the straggler rule over per-rank stage seconds.

Under DDP every rank waits in the gradient all-reduce for the slowest one, so a straggler shows up on the *other*
ranks as exposed ``communication``: the rule compares each rank's time outside the all-reduce with the others' and
charges their wait to the straggler, not to the network. See docs/method.md (Outside the step).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from lightning_accel.core.findings import STAGES, Finding, Thresholds

__all__ = ["find_stragglers", "own_communication_share", "straggler_shares"]

_STRAGGLER_FIX = {
    "data": (
        "give that rank's input pipeline what the others have: check its shard (larger files or samples, "
        "slower storage or a network mount), raise its DataLoader num_workers / prefetch_factor "
        "(DataLoaderTuner) and copy the data set to local disk when one rank reads remotely"
    ),
    "transfer": (
        "check that rank's host→device path: pin_memory=True + DevicePrefetcher, and its NUMA binding "
        "(the process should run on the CPU socket attached to its GPU)"
    ),
    "forward": (
        "find why that rank computes slower: a throttled or slower GPU (nvidia-smi -q -d "
        "PERFORMANCE,CLOCK), another process on its device or cores, or larger batches on it (bucket "
        "variable-length samples so every rank gets equal shapes)"
    ),
    "backward": (
        "find why that rank computes slower: a throttled or slower GPU (nvidia-smi -q -d "
        "PERFORMANCE,CLOCK), another process on its device or cores, or larger batches on it (bucket "
        "variable-length samples so every rank gets equal shapes)"
    ),
    "optimizer": "check that rank's device and cores for contention (another process, CPU frequency)",
    "other": (
        "move per-step host work off that rank (rank-0-only logging, plotting or checkpoint writes: log every "
        "N steps, AsyncCheckpointIO) and check its cores for contention (OMP_NUM_THREADS per rank)"
    ),
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


def _check(rank_seconds: Sequence[Mapping[str, float]]) -> None:
    for r, seconds in enumerate(rank_seconds):
        for stage, value in seconds.items():
            if stage not in STAGES or value != value or value < 0:
                raise ValueError(f"rank {r}: {stage}={value!r}; give seconds >= 0 per stage of {list(STAGES)}")


def _straggler_ranks(rank_seconds: Sequence[Mapping[str, float]], th: Thresholds) -> dict[int, float]:
    """Rank → its excess (seconds per batch outside the all-reduce over the other ranks' median), for the ranks
    whose excess is above ``th.straggler_share`` of the mean step."""
    steps = [_step(r) for r in rank_seconds]
    mean_step = statistics.fmean(steps)
    if mean_step <= 0:
        return {}
    own = [s - r.get("communication", 0.0) for s, r in zip(steps, rank_seconds)]
    out = {}
    for rank in range(len(rank_seconds)):
        excess = own[rank] - statistics.median(own[i] for i in range(len(rank_seconds)) if i != rank)
        if excess > th.straggler_share * mean_step:
            out[rank] = excess
    return out


def straggler_shares(
    rank_seconds: Sequence[Mapping[str, float]], thresholds: Thresholds | None = None
) -> dict[str, float]:
    """Per stage, the share of the mean step that the stragglers account for (empty without a straggler).

    A straggler's extra time in a stage is its seconds above the median of the ranks that keep pace (all other
    ranks when every other one is a straggler too); the all-reduce's is every rank's wait above the least any rank
    waits (the others' wait for the slowest). Shares are of the ranks' summed step time, as
    :meth:`~lightning_accel.core.breakdown.Breakdown.shares` weighs them, so ``shares[s] - straggler_shares[s]``
    is what stage ``s`` would take if the stragglers kept pace.

    Args:
        rank_seconds: per rank, stage → mean seconds per batch.
        thresholds: where a rank counts as a straggler (``straggler_share``).
    """
    th = thresholds or Thresholds()
    if len(rank_seconds) < 2:
        return {}
    _check(rank_seconds)
    slow = _straggler_ranks(rank_seconds, th)
    total = sum(_step(r) for r in rank_seconds)
    if not slow or total <= 0:
        return {}
    pace = [i for i in range(len(rank_seconds)) if i not in slow]
    out = dict.fromkeys(STAGES, 0.0)
    for rank in slow:
        baseline = pace or [i for i in range(len(rank_seconds)) if i != rank]
        for stage in STAGES:
            if stage == "communication":
                continue
            typical = statistics.median(rank_seconds[i].get(stage, 0.0) for i in baseline)
            out[stage] += max(0.0, rank_seconds[rank].get(stage, 0.0) - typical)
    least = min(r.get("communication", 0.0) for r in rank_seconds)
    out["communication"] = sum(r.get("communication", 0.0) - least for r in rank_seconds)
    return {stage: seconds / total for stage, seconds in out.items() if seconds > 0}


def find_stragglers(rank_seconds: Sequence[Mapping[str, float]], thresholds: Thresholds | None = None) -> list[Finding]:
    """Straggler findings from each rank's mean seconds per batch and stage (index = global rank).

    A rank is a straggler when its time outside the all-reduce exceeds the median of the other ranks' by more than
    ``thresholds.straggler_share`` of the mean step. The finding names the rank, the stage its extra time goes to,
    how much (ms per batch and ×), the other ranks' wait, and the fix for that stage; its ``value`` and ``saving``
    are the excess as a share of the mean step.

    Args:
        rank_seconds: per rank, stage → mean seconds per batch (keys of :data:`~lightning_accel.core.rules.STAGES`).
        thresholds: where the rule fires (``straggler_share``).
    """
    th = thresholds or Thresholds()
    if len(rank_seconds) < 2:
        return []
    _check(rank_seconds)
    steps = [_step(r) for r in rank_seconds]
    mean_step = statistics.fmean(steps)
    own = [s - r.get("communication", 0.0) for s, r in zip(steps, rank_seconds)]
    out = []
    for rank, excess in _straggler_ranks(rank_seconds, th).items():
        seconds = rank_seconds[rank]
        others = [i for i in range(len(rank_seconds)) if i != rank]
        base = statistics.median(own[i] for i in others)
        deltas = {
            s: seconds.get(s, 0.0) - statistics.median(rank_seconds[i].get(s, 0.0) for i in others)
            for s in STAGES
            if s != "communication"
        }
        stage = max(deltas, key=lambda s: deltas[s])
        wait = statistics.median(rank_seconds[i].get("communication", 0.0) for i in others)
        ratio = f"{own[rank] / base:.1f}x" if base > 0 else "far longer"
        evidence = (
            f"rank {rank} is a straggler: its batch takes {1e3 * own[rank]:.2f} ms outside the all-reduce "
            f"against {1e3 * base:.2f} ms on the other ranks (+{1e3 * excess:.2f} ms, {ratio}; threshold "
            f"+{100 * th.straggler_share:.0f} % of the {1e3 * mean_step:.2f} ms step), mostly in {stage} "
            f"(+{1e3 * deltas[stage]:.2f} ms per batch)"
        )
        if wait > seconds.get("communication", 0.0):
            evidence += (
                f"; the other ranks wait for it in the all-reduce: {1e3 * wait:.2f} ms per batch against "
                f"{1e3 * seconds.get('communication', 0.0):.2f} ms on rank {rank}, which is this "
                "straggler's cost, not the network's"
            )
        fix = f"rank {rank}'s {stage} is slow: {_STRAGGLER_FIX[stage]}."
        out.append(Finding("straggler", stage, evidence + ".", fix, excess / mean_step, saving=excess / mean_step))
    return out
