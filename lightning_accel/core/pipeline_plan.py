"""The stage split of a pipeline-parallel run and its arithmetic (torch-free: plain numbers in, a plan out): the
balanced plan, the schedule and mesh sizes a run can use, and the bubble ``(P - 1) / (V·m + P - 1)``.
See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_accel.core.findings import Finding

__all__ = [
    "SCHEDULES",
    "StagePlan",
    "bubble_finding",
    "bubble_fraction",
    "check_schedule",
    "mesh_sizes",
    "plan_stages",
    "stage_counts",
    "stage_ranks",
]

#: schedule name -> (torch class name, whether it runs several stages per rank)
SCHEDULES: dict[str, tuple[str, bool]] = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
}


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs, which rank holds it, and what each stage costs.

    Attributes:
        blocks: ``blocks[s]`` is the ``range`` of block indices stage ``s`` runs.
        ranks: ``ranks[s]`` is the pipeline rank (0 .. P-1) that holds stage ``s``.
        costs: the cost of each stage (its blocks, plus the embedding on stage 0 and the head on the last).
        unit: what the costs count (``"parameters"``, ``"s"``, ...), for :meth:`describe`.
    """

    blocks: tuple[range, ...]
    ranks: tuple[int, ...]
    costs: tuple[float, ...]
    unit: str = "parameters"

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` holds, in order."""
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def stage_of_block(self, block: int) -> int:
        for s, run in enumerate(self.blocks):
            if block in run:
                return s
        raise IndexError(f"block {block} is in no stage of this plan ({self.blocks})")

    @property
    def imbalance(self) -> float:
        """The slowest stage's cost ÷ the mean stage cost (1.0 = perfectly balanced)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def describe(self, block_name: str = "blocks") -> str:
        lines = []
        for s, (run, rank, cost) in enumerate(zip(self.blocks, self.ranks, self.costs)):
            what = f"{block_name} {run.start}-{run.stop - 1}" if len(run) else f"no {block_name}"
            extra = (" + embedding" if s == 0 else "") + (" + head and loss" if s == self.num_stages - 1 else "")
            lines.append(f"  stage {s} (rank {rank}): {what}{extra}  [{cost:,.0f} {self.unit}]")
        lines.append(f"  slowest stage / mean: {self.imbalance:.2f}")
        return "\n".join(lines)


def stage_ranks(num_stages: int, pipeline_ranks: int) -> tuple[int, ...]:
    """Looped placement: stage ``s`` on rank ``s % pipeline_ranks``."""
    return tuple(s % pipeline_ranks for s in range(num_stages))


def check_schedule(schedule: str, *, num_stages: int, pipeline_ranks: int, microbatches: int) -> None:
    """Refuse a schedule the stage and micro-batch counts cannot run, naming the value and the fix."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline microbatches={microbatches!r} must be an integer >= 1")
    if num_stages % pipeline_ranks:
        raise ValueError(
            f"pipeline stages={num_stages} do not divide over {pipeline_ranks} pipeline ranks; give "
            f"a multiple of {pipeline_ranks}"
        )
    per_rank = num_stages // pipeline_ranks
    multi = SCHEDULES[schedule][1]
    if multi and per_rank < 2:
        raise ValueError(
            f"pipeline schedule={schedule!r} runs several stages per rank, but stages={num_stages} on "
            f"{pipeline_ranks} pipeline ranks is {per_rank} per rank; give stages={2 * pipeline_ranks} "
            f"(or more), or schedule='1f1b'"
        )
    if not multi and per_rank != 1:
        raise ValueError(
            f"pipeline schedule={schedule!r} runs one stage per rank, but stages={num_stages} on "
            f"{pipeline_ranks} pipeline ranks is {per_rank} per rank; give stages={pipeline_ranks}, "
            f"or schedule='interleaved_1f1b' for {per_rank} stages per rank"
        )
    if schedule != "gpipe" and microbatches < pipeline_ranks:
        raise ValueError(
            f"pipeline schedule={schedule!r} needs microbatches >= the {pipeline_ranks} pipeline ranks "
            f"(got microbatches={microbatches}); give microbatches={pipeline_ranks} or more (the bubble "
            f"shrinks with more), or schedule='gpipe'"
        )
    if multi and microbatches % pipeline_ranks:
        up = pipeline_ranks * -(-microbatches // pipeline_ranks)
        raise ValueError(
            f"pipeline schedule={schedule!r}: microbatches={microbatches} must be a multiple of the "
            f"{pipeline_ranks} pipeline ranks; give microbatches={up}"
        )


def mesh_sizes(
    world: int, *, data_parallel: int | str = 1, pipeline: int | str = "auto", compression: str | None = None
) -> tuple[int, int]:
    """``(pipeline ranks, data-parallel replicas)`` on ``world`` processes; ``"auto"`` for both is 1 replica below 4
    processes, 2 from 4 on; refused where they do not fit, or where ``compression`` would have no replicas to
    reduce over."""
    dp, p = data_parallel, pipeline
    if dp == "auto" and p == "auto":
        dp = 1 if world < 4 else 2
    if p == "auto":
        p = world // dp if world % dp == 0 else 0  # type: ignore[operator]
    if dp == "auto":
        dp = world // p if p and world % p == 0 else 0  # type: ignore[operator]
    if not (p and dp) or p * dp != world:  # type: ignore[operator]
        raise ValueError(
            f"pipeline: pipeline_size={pipeline} × data_parallel_size={data_parallel} does not "
            f"fit {world} processes; give sizes whose product is {world}"
        )
    if compression is not None and dp == 1:
        raise ValueError(
            f"pipeline: compression={compression!r} compresses the all-reduce over data-parallel "
            f"replicas, but {world} processes with data_parallel_size={data_parallel} make 1 replica "
            "per stage (nothing to reduce); use strategy='pp_ddp' / data_parallel_size='auto' with "
            "more processes, or compression=None"
        )
    return int(p), int(dp)


def stage_counts(
    schedule: str, pipeline_ranks: int, *, stages: int | None = None, microbatches: int | None = None
) -> tuple[int, int]:
    """``(stages, micro-batches)`` of a run, checked by :func:`check_schedule`: the given ones, else the schedule's
    defaults (``P`` stages, or ``2·P`` interleaved; ``P`` micro-batches, or one per stage interleaved)."""
    multi = SCHEDULES[schedule][1]
    num_stages = stages or pipeline_ranks * (2 if multi else 1)
    m = microbatches or (num_stages if multi else pipeline_ranks)
    check_schedule(schedule, num_stages=num_stages, pipeline_ranks=pipeline_ranks, microbatches=m)
    return num_stages, m


def plan_stages(
    block_costs: Sequence[float],
    num_stages: int,
    *,
    pipeline_ranks: int | None = None,
    first_cost: float = 0.0,
    last_cost: float = 0.0,
    unit: str = "parameters",
    blocks_per_stage: Sequence[int] | None = None,
) -> StagePlan:
    """Divide the blocks into ``num_stages`` contiguous runs with the smallest possible maximum stage cost (the
    pipeline runs at the pace of its slowest stage). Costs are any positive measure: parameter counts (the
    default), measured times, FLOPs.

    Args:
        block_costs: the cost of each repeated block, in order.
        num_stages: how many stages (``S``); every stage gets at least one block.
        pipeline_ranks: ranks of the pipeline (``P``, default ``S``); stage ``s`` goes to rank ``s % P``.
        first_cost: the cost of what only the first stage runs (the embedding).
        last_cost: the cost of what only the last stage runs (final norm, head, loss).
        unit: what the costs count, for :meth:`StagePlan.describe`.
        blocks_per_stage: an explicit split (blocks of each stage), used instead of the balancing.

    Raises:
        ValueError: more stages than blocks, or a ``blocks_per_stage`` that does not cover the blocks.
    """
    n = len(block_costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline stages={num_stages!r} must be an integer >= 1")
    if num_stages > n:
        raise ValueError(
            f"pipeline stages={num_stages} but the model has {n} repeated blocks: every stage needs "
            f"at least one block; give stages <= {n} (fewer pipeline ranks), or a deeper model"
        )
    if any(c < 0 for c in block_costs):
        raise ValueError(f"block costs must be >= 0, got {list(block_costs)}")
    p = num_stages if pipeline_ranks is None else pipeline_ranks
    if blocks_per_stage is not None:
        sizes = list(blocks_per_stage)
        if len(sizes) != num_stages or any(not isinstance(k, int) or k < 1 for k in sizes) or sum(sizes) != n:
            raise ValueError(
                f"blocks_per_stage={sizes} must give {num_stages} positive block counts that sum to the {n} blocks"
            )
    else:
        sizes = _balanced_sizes(list(block_costs), num_stages, first_cost, last_cost)
    blocks, start = [], 0
    for k in sizes:
        blocks.append(range(start, start + k))
        start += k
    costs = [sum(block_costs[i] for i in run) for run in blocks]
    costs[0] += first_cost
    costs[-1] += last_cost
    return StagePlan(tuple(blocks), stage_ranks(num_stages, p), tuple(float(c) for c in costs), unit)


def _balanced_sizes(costs: list[float], stages: int, first: float, last: float) -> list[int]:
    """Linear partition by dynamic programming: ``best[s][i]`` = the smallest max cost of the first ``i`` blocks
    in ``s`` stages. Ties go to the split that puts blocks earlier (the last stage also carries the head)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s runs blocks i..j-1
        return prefix[j] - prefix[i] + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j] - 1e-12 * max(1.0, abs(value)):
                    best[s][j], cut[s][j] = value, i
    sizes, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def bubble_fraction(pipeline_ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a pipeline step: ``(P - 1) / (V·m + P - 1)``. GPipe and 1F1B leave each of ``P`` ranks idle
    for ``P - 1`` of the ``m + P - 1`` micro-batch slots of a step; ``V`` interleaved stages per rank divide the
    bubble's length by ``V`` (Narayanan et al. 2021 §2.2, §2.2.2)."""
    if pipeline_ranks < 1 or microbatches < 1 or stages_per_rank < 1:
        raise ValueError(
            f"bubble_fraction needs positive sizes, got P={pipeline_ranks}, m={microbatches}, V={stages_per_rank}"
        )
    return (pipeline_ranks - 1) / (stages_per_rank * microbatches + pipeline_ranks - 1)


def bubble_finding(
    bubbles: Sequence[float | None],
    *,
    pipeline_ranks: int,
    microbatches: int,
    stages_per_rank: int = 1,
    schedule: str = "1f1b",
    threshold: float = 0.2,
) -> Finding | None:
    """The ``pipeline_bubble`` finding when the idle share of a pipeline step is above ``threshold`` on any rank.

    Args:
        bubbles: each rank's measured idle share (1 - its stages' compute time / the step's wall time).
        pipeline_ranks / microbatches / stages_per_rank: ``P``, ``m``, ``V`` of the run.
        schedule: the schedule's name, for the fix.
        threshold: the idle share above which the bubble is reported.

    The fix named: more micro-batches (the bubble falls to ``(P-1)/(2V·m+P-1)`` with twice as many), interleaving
    (``V = 2``), and, when the measured bubble is well above the formula, balancing the stages (the slowest stage
    sets the pace) or fewer, larger point-to-point messages.
    """
    known = [b for b in bubbles if b is not None]
    if not known or max(known) <= threshold:
        return None
    expected = bubble_fraction(pipeline_ranks, microbatches, stages_per_rank)
    per_rank = ", ".join(f"rank {r}: {b:.0%}" if b is not None else f"rank {r}: ?" for r, b in enumerate(bubbles))
    evidence = (
        f"the pipeline bubble (ranks idle waiting for other stages) is {per_rank} of the step; "
        f"(P-1)/(V·m+P-1) = {expected:.0%} for P={pipeline_ranks} ranks, m={microbatches} micro-batches, "
        f"V={stages_per_rank} stages per rank."
    )
    fixes = [
        f"more micro-batches: PipelineStrategy(microbatches={2 * microbatches}) (bubble "
        f"{bubble_fraction(pipeline_ranks, 2 * microbatches, stages_per_rank):.0%}; needs a batch divisible by "
        f"it: raise the batch size or accumulate less)"
    ]
    if stages_per_rank == 1 and schedule != "interleaved_1f1b":
        fixes.append(
            f"interleave: schedule='interleaved_1f1b', stages={2 * pipeline_ranks} (bubble "
            f"{bubble_fraction(pipeline_ranks, microbatches, 2):.0%})"
        )
    if max(known) > expected + 0.15:
        fixes.append(
            "the measured bubble is well above the formula: balance the stages (blocks_per_stage=...; the "
            "slowest stage sets the pace) or the point-to-point sends dominate (larger micro-batches)"
        )
    # saving: the idle share itself, the most that the fixes above can take off the step
    return Finding("pipeline_bubble", "forward", evidence, "; ".join(fixes) + ".", max(known), saving=max(known))
