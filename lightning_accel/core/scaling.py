"""Will it scale? An α–β model of data- and tensor-parallel communication, projecting step time and scaling
efficiency from one measured step to N = 2 … 1024 devices (framework-free: no torch, no Lightning).

The collectives' costs, each strategy's traffic and what hides it, and the model's limits:
``docs/measuring/scaling.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "INTERCONNECTS",
    "STRATEGIES",
    "Interconnect",
    "ScalingPoint",
    "ScalingWorkload",
    "allgather_seconds",
    "allreduce_seconds",
    "fit_interconnect",
    "get_interconnect",
    "powersgd_compression_ratio",
    "project_scaling",
    "reduce_scatter_seconds",
    "ring_allreduce_seconds",
    "scaling_efficiency",
    "tree_allreduce_seconds",
]


@dataclass(frozen=True)
class Interconnect:
    """A link for the α–β model.

    Attributes:
        name: label for tables.
        bandwidth: bytes/s per rank in one direction (a ring sends and receives at this rate at once).
        latency: seconds per message step (α).
    """

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(
                f"Interconnect({self.name!r}): bandwidth={self.bandwidth!r} must be a positive number "
                "of bytes/s, e.g. 50e9 for InfiniBand NDR"
            )
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"Interconnect({self.name!r}): latency={self.latency!r} must be >= 0 seconds, e.g. 5e-6")


#: Presets: bandwidth per GPU and direction from the datasheets; latencies are typical NCCL per-step figures
#: (order of magnitude, not datasheet values).
INTERCONNECTS: dict[str, Interconnect] = {
    # NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both directions together) -> 450 GB/s per direction
    "nvlink": Interconnect("nvlink", 450e9, 3e-6),
    # NDR InfiniBand 400 Gb/s per port, one ConnectX-7 port per GPU (DGX H100) -> 50 GB/s
    "infiniband_ndr": Interconnect("infiniband_ndr", 50e9, 5e-6),
    # 100 Gb/s Ethernet (RoCE / TCP), one NIC per GPU -> 12.5 GB/s
    "100gbe": Interconnect("100gbe", 12.5e9, 20e-6),
    # 25 Gb/s Ethernet -> 3.125 GB/s
    "25gbe": Interconnect("25gbe", 3.125e9, 30e-6),
}

#: Strategies :func:`project_scaling` models.
STRATEGIES = (
    "ddp",
    "ddp_fp16_compress",
    "ddp_bf16_compress",
    "ddp_powersgd",
    "ddp_topk",
    "ddp_qsgd",
    "zero1",
    "zero2",
    "zero3",
    "tp",
    "pp",
)


def get_interconnect(name: str | Interconnect) -> Interconnect:
    """A preset of :data:`INTERCONNECTS` by name (an :class:`Interconnect` is returned as is)."""
    if isinstance(name, Interconnect):
        return name
    key = str(name).lower().replace("-", "_").replace(" ", "_")
    aliases = {
        "ib": "infiniband_ndr",
        "ndr": "infiniband_ndr",
        "infiniband": "infiniband_ndr",
        "100g": "100gbe",
        "25g": "25gbe",
        "100_gbe": "100gbe",
        "25_gbe": "25gbe",
    }
    key = aliases.get(key, key)
    if key not in INTERCONNECTS:
        raise ValueError(
            f"unknown interconnect {name!r}: use one of {', '.join(INTERCONNECTS)}, or give bandwidth "
            "and latency (Interconnect(name, bandwidth_bytes_per_s, latency_s); CLI: --bandwidth-gbs "
            "and --latency-us)"
        )
    return INTERCONNECTS[key]


def _check_n(n: int, what: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what}={n!r}: the number of devices must be an integer >= 1")
    return n


def ring_allreduce_seconds(size_bytes: float, n: int, link: Interconnect) -> float:
    """Ring all-reduce of ``size_bytes`` over ``n`` ranks: ``2(n−1)α + 2(n−1)/n · S/B`` (0 for one rank)."""
    _check_n(n)
    if n == 1 or size_bytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * size_bytes / link.bandwidth


def tree_allreduce_seconds(size_bytes: float, n: int, link: Interconnect) -> float:
    """Double-binary-tree all-reduce (NCCL's tree): ``2⌈log₂ n⌉α + 2 · S/B`` (0 for one rank)."""
    _check_n(n)
    if n == 1 or size_bytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency + 2 * size_bytes / link.bandwidth


def allreduce_seconds(size_bytes: float, n: int, link: Interconnect) -> float:
    """All-reduce of ``size_bytes`` over ``n`` ranks: the faster of ring and tree (NCCL picks by size)."""
    return min(ring_allreduce_seconds(size_bytes, n, link), tree_allreduce_seconds(size_bytes, n, link))


def allgather_seconds(size_bytes: float, n: int, link: Interconnect) -> float:
    """Ring all-gather producing ``size_bytes`` on every rank: ``(n−1)α + (n−1)/n · S/B``."""
    _check_n(n)
    if n == 1 or size_bytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * size_bytes / link.bandwidth


def reduce_scatter_seconds(size_bytes: float, n: int, link: Interconnect) -> float:
    """Ring reduce-scatter of ``size_bytes`` (each rank keeps ``1/n``): the cost of :func:`allgather_seconds`."""
    return allgather_seconds(size_bytes, n, link)


def scaling_efficiency(throughput_1: float, throughput_n: float, n: int) -> float:
    """``throughput_n / (n × throughput_1)`` (1.0 = linear speed-up)."""
    _check_n(n)
    if not throughput_1 > 0:
        raise ValueError(f"scaling_efficiency: throughput_1={throughput_1!r} must be > 0")
    return throughput_n / (n * throughput_1)


def powersgd_compression_ratio(
    shapes: Iterable[Sequence[int]], *, rank: int = 1, min_compression_rate: float = 2.0
) -> float:
    """Uncompressed ÷ sent elements of torch's PowerSGD hook for parameters of these shapes (Vogels et al. 2019).

    As ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``: a tensor of ≥ 2 dims is viewed as an
    ``n × m`` matrix (``n = shape[0]``) and sent as ``P (n × r)`` and ``Q (m × r)`` if that shrinks it more than
    ``min_compression_rate`` times; vectors (biases, norms) and the rest are all-reduced uncompressed.
    """
    if rank < 1:
        raise ValueError(f"powersgd_compression_ratio(rank={rank!r}): use an integer >= 1")
    total = sent = 0
    for shape in shapes:
        numel = math.prod(shape)
        total += numel
        n = shape[0] if len(shape) else 1
        m = numel // n if n else 0
        compressed = min(n, m, rank) * (n + m)
        # torch's _should_compress: compressed_size * min_compression_rate < uncompressed_size (vectors never are)
        sent += compressed if compressed * min_compression_rate < numel else numel
    if total == 0:
        raise ValueError("powersgd_compression_ratio: no parameters given")
    return total / sent


@dataclass(frozen=True)
class ScalingWorkload:
    """One device's step, measured once, that the projection scales out.

    Attributes:
        compute_s: seconds of one optimizer step on one device with no communication (the 1-device step).
        params: parameter count Ψ.
        grad_bytes: bytes per gradient element in the all-reduce (4 fp32, 2 bf16/fp16).
        param_bytes: bytes per parameter element in ZeRO's all-gathers (4 fp32, 2 bf16).
        backward_fraction: share of ``compute_s`` spent in backward (communication can hide behind it); 2/3
            follows backward ≈ 2 × forward FLOPs (the 6Ψ-per-token rule: 2Ψ forward, 4Ψ backward).
        bucket_bytes: DDP gradient bucket size (``bucket_cap_mb``, torch default 25 MiB): sets the number of
            all-reduce calls (latency) and the last, always exposed, bucket.
        powersgd_ratio: uncompressed ÷ sent for ``ddp_powersgd`` (see :func:`powersgd_compression_ratio`).
        n_layers, hidden_size, tokens_per_step, activation_bytes: for ``tp``: transformer layers, model width,
            tokens per step of one model replica, bytes per activation element.
        units: ZeRO-3 / FSDP units, each gathered and reduce-scattered separately (0: ``n_layers``, or 1).
        topk_density: ``ddp_topk``'s fraction of entries sent (default 0.01, the strategy's).
        qsgd_bits, qsgd_chunk: ``ddp_qsgd``'s bits per entry and entries per fp32 norm (default 4 and 128).
    """

    compute_s: float
    params: int
    grad_bytes: int = 4
    param_bytes: int = 4
    backward_fraction: float = 2 / 3
    bucket_bytes: float = 25 * 2**20
    powersgd_ratio: float = 1.0
    n_layers: int = 0
    hidden_size: int = 0
    tokens_per_step: int = 0
    activation_bytes: int = 4
    units: int = 0
    topk_density: float = 0.01
    qsgd_bits: int = 4
    qsgd_chunk: int = 128

    def __post_init__(self) -> None:
        if not self.compute_s > 0:
            raise ValueError(
                f"ScalingWorkload(compute_s={self.compute_s!r}): give the measured 1-device step time in seconds (> 0)"
            )
        if not (isinstance(self.params, int) and self.params > 0):
            raise ValueError(f"ScalingWorkload(params={self.params!r}): give the parameter count (> 0)")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"ScalingWorkload(backward_fraction={self.backward_fraction!r}): a share in [0, 1]")
        if not self.bucket_bytes > 0 or not self.powersgd_ratio >= 1:
            raise ValueError(
                f"ScalingWorkload: bucket_bytes={self.bucket_bytes!r} must be > 0 and "
                f"powersgd_ratio={self.powersgd_ratio!r} >= 1"
            )

    @property
    def shard_units(self) -> int:
        """ZeRO-3 / FSDP units (one collective each per pass)."""
        return self.units or self.n_layers or 1

    @property
    def backward_s(self) -> float:
        return self.compute_s * self.backward_fraction

    @property
    def forward_s(self) -> float:
        return self.compute_s - self.backward_s


@dataclass(frozen=True)
class ScalingPoint:
    """The projection at one device count.

    Attributes:
        strategy, n, tp_size: what was projected (``tp_size`` 1 except for ``tp``).
        step_s: projected seconds per optimizer step.
        compute_s: compute seconds per step per device (``compute / tp_size``).
        comm_s: communication seconds per step per device (hidden or not).
        exposed_s: communication not hidden behind compute (``step − compute``).
        efficiency: ``compute_1 / (tp_size × step)`` = throughput_N ÷ (N × throughput_1).
    """

    strategy: str
    n: int
    tp_size: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    efficiency: float
    pp_size: int = 1
    bubble_s: float = 0.0
    p2p_s: float = 0.0

    @property
    def exposed_share(self) -> float:
        """Exposed communication as a share of the step."""
        return self.exposed_s / self.step_s

    @property
    def speedup(self) -> float:
        """Throughput relative to one device."""
        return self.efficiency * self.n


def _bucketed_allreduce(
    size: float,
    n: int,
    link: Interconnect,
    bucket: float,
    calls_per_bucket: int = 1,
) -> tuple[float, float]:
    """(total seconds, seconds of the last bucket) of ``size`` bytes all-reduced in buckets of ``bucket`` bytes,
    each sent as ``calls_per_bucket`` equal all-reduces."""
    if n == 1 or size <= 0:
        return 0.0, 0.0
    full, rest = int(size // bucket), size - (size // bucket) * bucket

    def one(b: float) -> float:
        return calls_per_bucket * allreduce_seconds(b / calls_per_bucket, n, link) if b > 0 else 0.0

    return full * one(bucket) + one(rest), one(min(bucket, size))


def _pp_point(
    w: ScalingWorkload, n: int, link: Interconnect, t: int, p: int, m: int, tp_link: Interconnect
) -> ScalingPoint:
    """PP x TP x DP (the ``pp`` row of the module table)."""
    if n % (t * p):
        raise ValueError(
            f"project_scaling: pp_size={p} x tp_size={t} does not divide n={n}; use device counts "
            f"that are multiples of {t * p}"
        )
    dp = n // (t * p)
    slot_compute = w.compute_s / (t * p * m)  # one micro-batch through one stage
    act = w.tokens_per_step / m * w.hidden_size * w.activation_bytes  # one micro-batch's activations
    tp_slot = 4 * (w.n_layers / p) * allreduce_seconds(act, t, tp_link) if t > 1 else 0.0
    p2p_slot = 2 * (link.latency + act / link.bandwidth) if p > 1 else 0.0
    slots = m + p - 1
    pipeline = slots * (slot_compute + tp_slot + p2p_slot)
    grads = w.params * w.grad_bytes / (t * p)
    dp_comm, last = _bucketed_allreduce(grads, dp, link, w.bucket_bytes)
    dp_exposed = 0.0 if dp == 1 else max(dp_comm - slot_compute * w.backward_fraction, last)
    ideal = w.compute_s / (t * p)
    step = pipeline + dp_exposed
    return ScalingPoint(
        strategy="pp",
        n=n,
        tp_size=t,
        step_s=step,
        compute_s=ideal,
        comm_s=slots * (tp_slot + p2p_slot) + dp_comm,
        exposed_s=step - ideal,
        efficiency=ideal / step,
        pp_size=p,
        bubble_s=(p - 1) * slot_compute,
        p2p_s=slots * p2p_slot,
    )


def _point(
    strategy: str, w: ScalingWorkload, n: int, link: Interconnect, tp_size: int, tp_link: Interconnect
) -> ScalingPoint:
    grads = w.params * w.grad_bytes
    params = w.params * w.param_bytes
    compute, t_bwd, t_fwd = w.compute_s, w.backward_s, w.forward_s
    t = 1
    if strategy in ("ddp", "ddp_fp16_compress", "ddp_bf16_compress", "ddp_powersgd"):
        size, calls = float(grads), 1
        if strategy in ("ddp_fp16_compress", "ddp_bf16_compress"):
            size = w.params * 2
        elif strategy == "ddp_powersgd":
            size, calls = grads / w.powersgd_ratio, 2
        comm, last = _bucketed_allreduce(size, n, link, w.bucket_bytes, calls)
        exposed = 0.0 if n == 1 else max(comm - t_bwd, last)
    elif strategy in ("ddp_topk", "ddp_qsgd"):
        # bytes each rank contributes per gradient byte; the all-gather delivers every rank's contribution
        per_grad_byte = (
            w.topk_density * 8 / w.grad_bytes
            if strategy == "ddp_topk"
            else (w.qsgd_bits / 8 + 4 / w.qsgd_chunk) / w.grad_bytes
        )
        buckets, rest = int(grads // w.bucket_bytes), grads % w.bucket_bytes
        one = allgather_seconds(n * w.bucket_bytes * per_grad_byte, n, link)
        comm = buckets * one + (allgather_seconds(n * rest * per_grad_byte, n, link) if rest else 0.0)
        last = one if buckets else comm
        exposed = 0.0 if n == 1 else max(comm - t_bwd, last)
    elif strategy in ("zero1", "zero2"):
        buckets = max(1, math.ceil(grads / w.bucket_bytes))
        rs = (buckets - 1) * (n - 1) * link.latency + reduce_scatter_seconds(grads, n, link)
        rs_last = reduce_scatter_seconds(min(w.bucket_bytes, grads), n, link)
        ag = allgather_seconds(params, n, link)
        comm = rs + ag
        exposed = 0.0 if n == 1 else max(rs - t_bwd, rs_last) + ag
    elif strategy == "zero3":
        u = w.shard_units
        extra = (u - 1) * (n - 1) * link.latency  # one collective per unit: u latencies, the same bytes
        ag = extra + allgather_seconds(params, n, link)
        rs = extra + reduce_scatter_seconds(grads, n, link)
        rs_last = reduce_scatter_seconds(grads / u, n, link)
        comm = 2 * ag + rs
        exposed = 0.0 if n == 1 else max(0.0, ag - t_fwd) + max(rs_last, ag + rs - t_bwd)
    elif strategy == "tp":
        t = tp_size
        if n % t:
            raise ValueError(
                f"project_scaling: tp_size={t} does not divide n={n}; use device counts that are multiples of {t}"
            )
        dp = n // t
        # Megatron-LM (Shoeybi et al. 2019, §3): 2 all-reduces forward + 2 backward per layer, of one replica's
        # activations (tokens × hidden), on the critical path
        act = w.tokens_per_step * w.hidden_size * w.activation_bytes
        tp_comm = 4 * w.n_layers * allreduce_seconds(act, t, tp_link)
        dp_comm, last = _bucketed_allreduce(grads / t, dp, link, w.bucket_bytes)
        comm = tp_comm + dp_comm
        exposed = tp_comm + (0.0 if dp == 1 else max(dp_comm - t_bwd / t, last))
    else:
        raise ValueError(f"project_scaling: unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    step = compute / t + exposed
    return ScalingPoint(
        strategy=strategy,
        n=n,
        tp_size=t,
        step_s=step,
        compute_s=compute / t,
        comm_s=comm,
        exposed_s=exposed,
        efficiency=compute / (t * step),
    )


def project_scaling(
    workload: ScalingWorkload,
    interconnect: str | Interconnect,
    *,
    n: Iterable[int] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    strategies: Iterable[str] = ("ddp", "ddp_bf16_compress", "zero2", "zero3"),
    tp_size: int = 8,
    tp_interconnect: str | Interconnect = "nvlink",
    pp_size: int = 4,
    microbatches: int | None = None,
) -> list[ScalingPoint]:
    """Project step time and efficiency of ``workload`` at each device count under each strategy.

    Args:
        workload: the measured 1-device step and the model's sizes.
        interconnect: link of the data-parallel traffic: a preset name (:data:`INTERCONNECTS`) or an
            :class:`Interconnect`. A ring that crosses nodes runs at the slowest link it crosses: give that one.
        n: device counts (each >= 1).
        strategies: any of :data:`STRATEGIES`.
        tp_size: tensor-parallel size for ``tp`` (inside a node; ``min(tp_size, n)`` is used, and ``tp`` needs
            ``n_layers``, ``hidden_size`` and ``tokens_per_step`` in the workload).
        tp_interconnect: link inside the tensor-parallel group (default NVLink).
        pp_size: pipeline stages for ``pp`` (``min(pp_size, n // T)`` is used; TP is ``min(tp_size, n)``).
        microbatches: micro-batches per step for ``pp`` (default ``4 × pp_size``).

    Returns:
        One :class:`ScalingPoint` per strategy and device count, strategies in the given order.
    """
    link, tp_link = get_interconnect(interconnect), get_interconnect(tp_interconnect)
    counts = [_check_n(x, "n") for x in n]
    names = list(strategies)
    for s in names:
        if s not in STRATEGIES:
            raise ValueError(f"project_scaling: unknown strategy {s!r}; use one of {', '.join(STRATEGIES)}")
    _check_n(tp_size, "tp_size")
    _check_n(pp_size, "pp_size")
    for s in ("tp", "pp"):
        if s in names and not (workload.n_layers > 0 and workload.hidden_size > 0 and workload.tokens_per_step > 0):
            raise ValueError(
                f"project_scaling: {s!r} needs the workload's n_layers, hidden_size and tokens_per_step "
                f"(got {workload.n_layers}, {workload.hidden_size}, {workload.tokens_per_step})"
            )
    out = []
    for s in names:
        for x in counts:
            if s == "pp":
                t = min(tp_size, x)
                p = max(1, min(pp_size, x // t, workload.n_layers))
                m = microbatches if microbatches is not None else 4 * p
                out.append(_pp_point(workload, x, link, t, p, _check_n(m, "microbatches"), tp_link))
            else:
                out.append(_point(s, workload, x, link, min(tp_size, x) if s == "tp" else 1, tp_link))
    return out


def fit_interconnect(
    sizes_bytes: Sequence[float], seconds: Sequence[float], n: int, *, name: str = "measured"
) -> Interconnect:
    """α and B from measured all-reduce times (least squares of ``t = 2(n−1)α + 2(n−1)/n · S/B``).

    Args:
        sizes_bytes: message sizes of the measurements (at least two different ones).
        seconds: measured all-reduce seconds for each size.
        n: ranks in the measurement (>= 2).
        name: label of the result.
    """
    _check_n(n)
    if n < 2 or len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise ValueError(
            "fit_interconnect: give >= 2 distinct sizes with one time each, measured on n >= 2 ranks "
            f"(got n={n}, {len(sizes_bytes)} sizes, {len(seconds)} times)"
        )
    xs = [2 * (n - 1) / n * s for s in sizes_bytes]
    k = len(xs)
    mx, my = sum(xs) / k, sum(seconds) / k
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        raise ValueError(f"fit_interconnect: times do not grow with size ({list(seconds)}); measure larger messages")
    return Interconnect(name, 1.0 / slope, max(0.0, intercept) / (2 * (n - 1)))
