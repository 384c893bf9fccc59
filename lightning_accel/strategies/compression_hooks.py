"""Top-K sparsification and QSGD quantisation as DDP communication hooks (torch only; gloo and NCCL).

Both exchange by ``all_gather``. Their state (:class:`TopKState`, :class:`QSGDState`) is training state, which
``DDPCompressionStrategy`` checkpoints. See docs/techniques/ddp-compression.md ("The Top-K and QSGD hooks").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "QSGDState",
    "TopKState",
    "qsgd_bits",
    "qsgd_hook",
    "qsgd_variance_bound",
    "scheduled_density",
    "topk_accumulate",
    "topk_hook",
    "topk_select",
    "warmup_densities",
]


class _CompressorState:
    """What both hooks share: process group, warm-up, iteration counter, error residuals, payload counter."""

    def __init__(self, *, process_group: Any = None, start_iter: int, use_error_feedback: bool) -> None:
        self.process_group = process_group
        self.start_iter = start_iter
        self.use_error_feedback = use_error_feedback
        #: synchronising backward passes so far (incremented on DDP's last bucket, bucket 0, as PowerSGD does)
        self.iter = 0
        #: bucket index -> this rank's residual (the part of its gradient not sent yet)
        self.error_dict: dict[int, torch.Tensor] = {}
        #: bytes this rank handed to the collectives (its own payload), cumulative
        self.bytes_sent = 0

    def maybe_increase_iter(self, bucket: Any) -> None:
        if bucket.is_last():
            self.iter += 1

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD


def _allreduce_plain(state: _CompressorState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    group = state._group()
    world = dist.get_world_size(group)
    state.bytes_sent += buffer.numel() * buffer.element_size()
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    state.maybe_increase_iter(bucket)

    def average(f: torch.futures.Future[Any]) -> torch.Tensor:
        return f.value()[0].div_(world)

    return fut.then(average)


def _with_error(state: _CompressorState, bucket: Any) -> torch.Tensor:
    """The bucket's gradient plus the residual of the previous step (fp32, a new tensor)."""
    grad = bucket.buffer().to(torch.float32, copy=True)
    if state.use_error_feedback:
        residual = state.error_dict.get(bucket.index())
        if residual is not None:
            grad.add_(residual)
    return grad


def _all_gather(state: _CompressorState, payload: torch.Tensor) -> torch.futures.Future[Any]:
    group = state._group()
    world = dist.get_world_size(group)
    out = [torch.empty_like(payload) for _ in range(world)]
    state.bytes_sent += payload.numel() * payload.element_size()
    return dist.all_gather(out, payload, group=group, async_op=True).get_future()


# --- Top-K ---------------------------------------------------------------------------------------------------
#: DGC's density warm-up (Lin et al. 2018): each stage sends a quarter of the previous stage's density (25 %, 6.25 %,
#: 1.5625 %, ...) until the target is reached; stages at or below the target are skipped.
DGC_WARMUP_FACTOR = 0.25


def warmup_densities(density: float, factor: float = DGC_WARMUP_FACTOR) -> tuple[float, ...]:
    """The warm-up stages' densities above the target ``density``: ``factor``, ``factor²``, ... (DGC's ramp).

    ``warmup_densities(0.01) == (0.25, 0.0625, 0.015625)``; a target of 0.25 or more needs no warm-up: ``()``.
    """
    if not 0 < factor < 1:
        raise ValueError(f"Top-K density warm-up factor={factor!r} must be in (0, 1), e.g. 0.25 (DGC's)")
    out: list[float] = []
    d = factor
    while d > density:
        out.append(d)
        d *= factor
    return tuple(out)


def scheduled_density(
    density: float, compressed_steps: int, steps_per_stage: int, stages: tuple[float, ...] | None = None
) -> float:
    """The density of the compressed step ``compressed_steps`` (0 = the first one) under the warm-up.

    Stage ``i`` covers compressed steps ``[i·steps_per_stage, (i+1)·steps_per_stage)`` and sends ``stages[i]``
    (default :func:`warmup_densities`); after the last stage, and with ``steps_per_stage == 0``, ``density``.
    """
    if steps_per_stage <= 0:
        return density
    stages = warmup_densities(density) if stages is None else stages
    stage = max(0, compressed_steps) // steps_per_stage
    return stages[stage] if stage < len(stages) else density


class TopKState(_CompressorState):
    """State of :func:`topk_hook`.

    Args:
        density: the target fraction of each bucket's entries sent (0 < density <= 1), e.g. 0.01.
        use_error_feedback: keep the unsent entries and add them to the next step's gradient.
        start_iter: plain all-reduce for this many steps first (>= 2 with error feedback).
        process_group: the group to reduce over (None: the default group).
        density_warmup_steps: compressed steps per stage of the density warm-up (0, this object's default: no
            warm-up, the target density from the first compressed step; ``ddp_topk`` defaults to DGC's ramp).
        density_warmup: the stages' densities (None: :func:`warmup_densities` of the target, 25 %, 6.25 %, ...).
        momentum: DGC's momentum correction with this momentum (0: off). The hook then keeps a local velocity
            ``u`` per bucket, accumulates ``v += u`` (the error-feedback residual), sends the top-k of ``v`` and
            zeroes both ``u`` and ``v`` at the sent entries (factor masking); the optimizer must then step without
            momentum on the compressed steps (``ddp_topk`` sets that up).
        nesterov: Nesterov momentum in the correction (``v += g + m·u``, as ``torch.optim.SGD(nesterov=True)``).

    Attributes:
        current_density: the density the next compressed step sends (follows :attr:`iter` through the warm-up).
        last_compressed: whether the last synchronising backward was compressed (read by ``ddp_topk`` to switch
            the optimizer's momentum off for exactly those steps).
    """

    def __init__(
        self,
        *,
        density: float,
        use_error_feedback: bool = True,
        start_iter: int = 2,
        process_group: Any = None,
        density_warmup_steps: int = 0,
        density_warmup: tuple[float, ...] | list[float] | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(process_group=process_group, start_iter=start_iter, use_error_feedback=use_error_feedback)
        if momentum and not use_error_feedback:
            raise ValueError(
                f"TopKState(momentum={momentum!r}) needs use_error_feedback=True: momentum correction accumulates "
                "the velocity in the error-feedback residual; turn error feedback on or use momentum=0"
            )
        self.density = density
        self.density_warmup_steps = density_warmup_steps
        self.density_warmup = tuple(density_warmup) if density_warmup is not None else warmup_densities(density)
        self.momentum = float(momentum)
        self.nesterov = nesterov
        #: bucket index -> this rank's local velocity ``u`` (momentum correction only)
        self.momentum_dict: dict[int, torch.Tensor] = {}
        self.last_compressed = False

    @property
    def current_density(self) -> float:
        """The density of the next compressed step: the warm-up stage of ``iter - start_iter``, else the target."""
        return scheduled_density(
            self.density, self.iter - self.start_iter, self.density_warmup_steps, self.density_warmup
        )


def topk_accumulate(state: TopKState, index: int, grad: torch.Tensor) -> torch.Tensor:
    """What Top-K selects from for bucket ``index``: ``grad`` (fp32, consumed) plus the state it carries.

    Without momentum correction: ``grad + residual`` (error feedback) or ``grad``. With it (DGC):
    ``u ← m·u + g`` (Nesterov: ``u ← m·(u + g)``, selecting from ``v + u + g``), ``v ← v + u``; the velocity ``u``
    is stored in ``state.momentum_dict`` and the returned ``v`` becomes the residual after :func:`topk_select`.
    """
    if state.momentum:
        u = state.momentum_dict.get(index)
        if u is None:
            u = torch.zeros_like(grad)
        if state.nesterov:
            u.add_(grad).mul_(state.momentum)
            step = u + grad
        else:
            step = u.mul_(state.momentum).add_(grad)
        state.momentum_dict[index] = u
        residual = state.error_dict.get(index)
        # a new tensor either way: v must not alias u (the masking zeroes both, but they accumulate differently)
        return step.clone() if residual is None else residual + step
    if state.use_error_feedback:
        residual = state.error_dict.get(index)
        if residual is not None:
            grad.add_(residual)
    return grad


def topk_select(state: TopKState, index: int, acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the ``k`` largest magnitudes of ``acc``; the rest stays as the residual, and with
    momentum correction the velocity is masked at the sent entries too (DGC's factor masking: a sent entry's
    momentum must not keep pushing an update that has already been applied)."""
    # sorted=False: the set is what matters; topk over |g| is deterministic on one device for one input
    indices = acc.abs().topk(k, sorted=False).indices
    values = acc[indices]
    if state.use_error_feedback:
        acc[indices] = 0.0
        state.error_dict[index] = acc
    if state.momentum:
        state.momentum_dict[index][indices] = 0.0
    return values, indices


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: send each bucket's ``ceil(density·n)`` largest-magnitude entries (values + int32 indices).

    ``density`` is :attr:`TopKState.current_density` (the warm-up's stage, then the target). The received entries
    of all ranks are summed into a dense gradient and divided by the world size (entries another rank sent but this
    one did not count with their value; the rest are zero), then written into the bucket in place (correct with
    ``gradient_as_bucket_view``). With momentum correction the result is the averaged sparse velocity update,
    which the optimizer applies without momentum.
    """
    if state.iter < state.start_iter:
        if bucket.is_last():
            state.last_compressed = False
        return _allreduce_plain(state, bucket)
    buffer = bucket.buffer()
    n = buffer.numel()
    k = max(1, min(n, math.ceil(state.current_density * n)))
    acc = topk_accumulate(state, bucket.index(), buffer.to(torch.float32, copy=True))
    values, indices = topk_select(state, bucket.index(), acc, k)
    # one message: fp32 values' bits and int32 indices side by side
    payload = torch.cat([values.view(torch.int32), indices.to(torch.int32)])
    fut = _all_gather(state, payload)
    if bucket.is_last():
        state.last_compressed = True
    state.maybe_increase_iter(bucket)
    world = dist.get_world_size(state._group())

    def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
        gathered = torch.stack(f.value()[0] if isinstance(f.value()[0], list) else f.value())
        dense = torch.zeros(n, dtype=torch.float32, device=buffer.device)
        dense.index_add_(0, gathered[:, k:].reshape(-1).long(), gathered[:, :k].reshape(-1).view(torch.float32))
        buffer.copy_(dense.div_(world))
        return buffer

    return fut.then(decompress)


# --- QSGD -----------------------------------------------------------------------------------------------------
def qsgd_bits(levels: int) -> int:
    """Bits per entry for ``levels`` quantisation levels plus a sign, rounded up to 2, 4 or 8 (they pack bytes)."""
    need = math.ceil(math.log2(levels + 1)) + 1
    for bits in (2, 4, 8):
        if need <= bits:
            return bits
    raise ValueError(f"QSGD levels={levels!r}: at most 127 (8 bits per entry with the sign)")


def qsgd_variance_bound(levels: int, chunk_size: int) -> float:
    """QSGD's bound on ``E‖Q(g) − g‖² / ‖g‖²`` for ``s`` levels and chunks of ``d``: ``min(d/s², √d/s)``."""
    return min(chunk_size / levels**2, math.sqrt(chunk_size) / levels)


class QSGDState(_CompressorState):
    """State of :func:`qsgd_hook`.

    Args:
        levels: quantisation levels ``s`` per sign (1 <= s <= 127); 1 = ternary, 7 = 4 bits, 127 = 8 bits.
        chunk_size: entries sharing one norm (QSGD's bucket size ``d``; smaller = less variance, more norms).
        use_error_feedback: add the quantisation error to the next step's gradient (off: QSGD is unbiased).
        start_iter: plain all-reduce for this many steps first (>= 2 with error feedback).
        seed: seed of the rounding generator; rank ``r`` uses ``seed + r`` so ranks round independently.
        process_group: the group to reduce over (None: the default group).
    """

    def __init__(
        self,
        *,
        levels: int,
        chunk_size: int = 128,
        use_error_feedback: bool = False,
        start_iter: int = 0,
        seed: int = 0,
        process_group: Any = None,
    ) -> None:
        super().__init__(process_group=process_group, start_iter=start_iter, use_error_feedback=use_error_feedback)
        self.levels = levels
        self.bits = qsgd_bits(levels)
        self.chunk_size = chunk_size
        self.seed = seed
        self.generator: torch.Generator | None = None  # made on first use, on the gradients' device
        #: a saved ``generator.get_state()`` to continue from (a resumed run), applied when the generator is made
        self.generator_state: torch.Tensor | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.generator_state is not None:
                self.generator.set_state(self.generator_state)
            else:
                rank = dist.get_rank(self._group()) if dist.is_initialized() else 0
                self.generator.manual_seed(self.seed + rank)
        return self.generator


def _qsgd_payload_bytes(n: int, bits: int, chunk: int) -> int:
    return math.ceil(n * bits / 8) + 4 * math.ceil(n / chunk)


def qsgd_encode(grad: torch.Tensor, state: QSGDState) -> torch.Tensor:
    """Quantise a flat fp32 tensor into one uint8 payload: the chunk norms (fp32 bytes), then the packed codes."""
    n, chunk, s, bits = grad.numel(), state.chunk_size, state.levels, state.bits
    chunks = math.ceil(n / chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.float32, device=grad.device)
    padded[:n] = grad
    padded = padded.view(chunks, chunk)
    norms = padded.norm(dim=1, keepdim=True)
    scaled = padded.abs() / norms.clamp_min(torch.finfo(torch.float32).tiny) * s
    noise = torch.rand(scaled.shape, generator=state._rng(grad.device), device=grad.device)
    level = torch.floor(scaled + noise).clamp_(max=s)  # P(level = floor + 1) = frac: unbiased
    # code: level in the low bits, sign in the top bit of a `bits`-wide field
    code = (level.to(torch.int32) | ((padded < 0).to(torch.int32) << (bits - 1))).view(-1)[:n]
    per_byte = 8 // bits
    code = torch.cat([code, code.new_zeros((-n) % per_byte)]).view(-1, per_byte)
    packed = torch.zeros(code.shape[0], dtype=torch.int32, device=grad.device)
    for j in range(per_byte):
        packed |= code[:, j] << (j * bits)
    return torch.cat([norms.view(-1).view(torch.uint8), packed.to(torch.uint8)])


def qsgd_decode(payload: torch.Tensor, n: int, state: QSGDState) -> torch.Tensor:
    """Inverse of :func:`qsgd_encode` (up to the quantisation): a flat fp32 tensor of ``n`` entries."""
    chunk, s, bits = state.chunk_size, state.levels, state.bits
    chunks = math.ceil(n / chunk)
    norms = payload[: 4 * chunks].view(torch.float32)
    packed = payload[4 * chunks :].to(torch.int32)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    code = torch.stack([(packed >> (j * bits)) & mask for j in range(per_byte)], dim=1).view(-1)[:n]
    sign_bit = 1 << (bits - 1)
    level = (code & (sign_bit - 1)).to(torch.float32)
    value = torch.where((code & sign_bit) != 0, -level, level)
    value = torch.cat([value, value.new_zeros(chunks * chunk - n)]).view(chunks, chunk)
    return (value * norms.view(-1, 1) / s).view(-1)[:n]


def qsgd_hook(state: QSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: QSGD-quantise each bucket, all-gather the packed codes, average the decoded gradients."""
    if state.iter < state.start_iter:
        return _allreduce_plain(state, bucket)
    buffer = bucket.buffer()
    n = buffer.numel()
    grad = _with_error(state, bucket)
    payload = qsgd_encode(grad, state)
    if state.use_error_feedback:
        state.error_dict[bucket.index()] = grad.sub_(qsgd_decode(payload, n, state))
    fut = _all_gather(state, payload)
    state.maybe_increase_iter(bucket)
    world = dist.get_world_size(state._group())

    def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
        gathered = f.value()[0] if isinstance(f.value()[0], list) else f.value()
        total = torch.zeros(n, dtype=torch.float32, device=buffer.device)
        for part in gathered:
            total.add_(qsgd_decode(part, n, state))
        buffer.copy_(total.div_(world))
        return buffer

    return fut.then(decompress)
