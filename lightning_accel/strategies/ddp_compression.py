"""DDP with gradient compression: fp16 / bf16 casting, PowerSGD, Top-K sparsification or QSGD before the exchange.

Strings (after ``import lightning_accel``): ``ddp_fp16_compress``, ``ddp_bf16_compress``, ``ddp_powersgd``,
``ddp_topk``, ``ddp_qsgd``. Each is :class:`DDPCompressionStrategy` with a DDP communication hook — torch's
(``torch.distributed.algorithms.ddp_comm_hooks``) or this package's (:mod:`.compression_hooks`) — registered by
this strategy on CPU (gloo) and CUDA (NCCL) alike: Lightning's ``DDPStrategy`` registers hooks only on CUDA devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel.strategies._bucket_state import BucketStateMover
from lightning_accel.strategies.compression_hooks import qsgd_variance_bound
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork

_compat.require_versions("the DDP compression strategies")

__all__ = [
    "CommStats",
    "DDPCompressionStrategy",
    "ddp_bf16_compress",
    "ddp_fp16_compress",
    "ddp_powersgd",
    "ddp_qsgd",
    "ddp_topk",
]

Compression = Literal["fp16", "bf16", "powersgd", "topk", "qsgd"]
_COMPRESSIONS = ("fp16", "bf16", "powersgd", "topk", "qsgd")
#: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, torch's DDP communication-hook signature.
CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]

_CHECKPOINT_KEY = "lightning_accel_ddp_compression"

#: ``ddp_topk``'s compressed steps per stage of DGC's density warm-up (25 % → 6.25 % → 1.5625 % → 1 %: 3 stages,
#: 192 steps at the default density). DGC ramps over its first 4 of 90 epochs; a step count does not depend on the
#: data set's size, and 3 × 64 steps give the error-feedback residual and the optimizer time to settle at each
#: density while staying a small share of a real run.
DEFAULT_DENSITY_WARMUP_STEPS = 64
#: ``ddp_topk``'s plain all-reduce steps before compressing under an Adam-family optimizer: the second moment
#: estimate (``β₂ = 0.999``: a time constant of 1000 steps) must first see dense gradients, or the entries that are
#: sent rarely get huge normalised steps (1-bit Adam's lesson: compress after the variance has stabilised).
DEFAULT_ADAPTIVE_WARMUP_STEPS = 100


def _is_adaptive(optimizer: Any) -> bool:
    """Adam-family (per-entry adaptive step sizes): torch's adaptive optimizers, or any with ``betas`` (Adam-like
    third-party ones: fused, 8-bit, LAMB)."""
    adaptive = tuple(
        getattr(torch.optim, name)
        for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam")
        if hasattr(torch.optim, name)
    )
    return isinstance(optimizer, adaptive) or "betas" in getattr(optimizer, "defaults", {})


@dataclass
class CommStats:
    """Gradient-communication statistics of one rank, counted by the strategy's hook (cumulative since ``fit``).

    All byte counts are of the payload this rank hands to the collective (the tensors' ``numel × element_size``),
    not of wire traffic: a ring all-reduce moves about ``2·(N-1)/N`` times the payload per rank, an all-gather
    (Top-K, QSGD) receives ``N-1`` times it.

    Attributes:
        steps: synchronising backward passes (one per optimizer step; accumulation micro-batches under
            ``no_sync`` do not communicate and do not count).
        calls: hook calls (one per gradient bucket per synchronising backward).
        bytes_before: bytes of the gradient buckets before compression (their dtype, usually fp32).
        bytes_sent: bytes handed to the collectives after compression.
        powersgd_steps: steps in which PowerSGD compressed (0 for the others; warm-up steps all-reduce plainly).
        compressed_steps: steps in which the compressor ran (any compression; fp16/bf16: every step).
    """

    steps: int = 0
    calls: int = 0
    bytes_before: int = 0
    bytes_sent: int = 0
    powersgd_steps: int = 0
    compressed_steps: int = 0

    @property
    def compression_rate(self) -> float:
        """``bytes_before / bytes_sent`` (1.0 = no compression; nan before the first all-reduce)."""
        return self.bytes_before / self.bytes_sent if self.bytes_sent else float("nan")

    def as_dict(self) -> dict[str, float]:
        """The counters and ``compression_rate`` as one flat dict (what ``BottleneckDoctor`` reads)."""
        return {**asdict(self), "compression_rate": self.compression_rate}


def _is_int(value: Any, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def _check_topk_recipe(
    warmup_steps: Any, warmup: Any, momentum_correction: Any, adaptive_warmup_steps: Any, error_feedback: bool
) -> None:
    """Argument checks of DGC's recipe (``ddp_topk``): each error names the value and the fix."""
    if not _is_int(warmup_steps, 0):
        raise ValueError(
            f"ddp_topk: density_warmup_steps={warmup_steps!r} must be an integer >= 0 (compressed steps per "
            f"warm-up stage, e.g. {DEFAULT_DENSITY_WARMUP_STEPS}; 0 turns the warm-up off)"
        )
    if warmup is not None:
        if isinstance(warmup, (str, bytes)) or not isinstance(warmup, Sequence):
            raise ValueError(
                f"ddp_topk: density_warmup={warmup!r} must be a list of densities, e.g. [0.25, 0.0625, 0.015625], "
                "or None (DGC's ramp down to the target density)"
            )
        for d in warmup:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
                raise ValueError(
                    f"ddp_topk: density_warmup={list(warmup)!r} holds {d!r}: every stage's density must be a "
                    "fraction in (0, 1], e.g. [0.25, 0.0625, 0.015625]"
                )
    if momentum_correction not in (None, True, False):
        raise ValueError(
            f"ddp_topk: momentum_correction={momentum_correction!r} must be None (automatic: on for SGD with "
            "momentum), True or False"
        )
    if momentum_correction and not error_feedback:
        raise ValueError(
            "ddp_topk: momentum_correction=True needs use_error_feedback=True (the velocity accumulates in the "
            "residual); drop use_error_feedback=False or set momentum_correction=None"
        )
    if not _is_int(adaptive_warmup_steps, 0):
        raise ValueError(
            f"ddp_topk: adaptive_warmup_steps={adaptive_warmup_steps!r} must be an integer >= 0 (plain all-reduce "
            f"steps before compressing under Adam-family optimizers, e.g. {DEFAULT_ADAPTIVE_WARMUP_STEPS})"
        )


class DDPCompressionStrategy(FinishesOutstandingWork, DDPStrategy):
    """Lightning DDP whose gradient exchange is compressed by a DDP communication hook.

    ===============  =================================  ===============================================
    ``compression``  hook                               traffic per step (payload vs fp32 gradients)
    ===============  =================================  ===============================================
    ``"fp16"``       ``default_hooks.fp16_compress_``   1/2; fp16 range: gradients above 65504 overflow
                     ``hook``
    ``"bf16"``       ``default_hooks.bf16_compress_``   1/2; fp32's range, 8-bit mantissa
                     ``hook``
    ``"powersgd"``   ``powerSGD_hook.powerSGD_hook``    ``(n + m)·rank / (n·m)`` per compressed matrix;
                     (Vogels et al. 2019)               plain all-reduce during warm-up
    ``"topk"``       :func:`.compression_hooks.`        ``2·density`` (values + int32 indices), by
                     ``topk_hook``                      all-gather; error feedback on by default
    ``"qsgd"``       :func:`.compression_hooks.`        ``bits/32`` (+ one fp32 norm per ``chunk_size``
                     ``qsgd_hook`` (Alistarh 2017)      entries), by all-gather; unbiased
    ===============  =================================  ===============================================

    Defaults differ from ``DDPStrategy``: ``find_unused_parameters=False`` (the default graph traversal costs time
    every step; set ``True`` only if some parameters really get no gradient), ``gradient_as_bucket_view=True``
    (gradients are views into DDP's buckets, saving one gradient-sized copy), ``static_graph`` optional (same
    used-parameter set every step lets DDP skip re-checking).

    PowerSGD defaults follow torch's ``PowerSGDState`` documentation: ``matrix_approximation_rank=1`` (start at 1,
    double until accuracy is satisfactory, typically 1-4), ``start_powerSGD_iter=1000`` (torch's default; torch
    suggests ~10 % of the total steps and no less than the LR warm-up), ``min_compression_rate=2``,
    ``use_error_feedback=True`` and ``warm_start=True`` (both recommended on). Error feedback keeps one fp32
    error tensor per bucket, i.e. gradient-sized extra memory, plus a transient copy while compressing;
    ``gradient_as_bucket_view=True`` removes DDP's own gradient copy, which offsets part of it. PowerSGD writes
    the decompressed gradients back into the bucket in place, so it is correct with bucket views.

    Top-K defaults: ``density=0.01`` (the seeds' 0.1-1 %), error feedback on (without it Top-K does not converge
    like SGD), ``start_iter=2``, and Deep Gradient Compression's recipe (Lin et al. 2018), without which Top-K's
    final loss trails DDP's by a growing gap:

    * **density warm-up** (``density_warmup_steps=64``): the first compressed steps send 25 %, then 6.25 %, then
      1.5625 % (each stage a quarter of the last, ``density_warmup_steps`` steps each), then the target density;
      ``density_warmup_steps=0`` turns it off, ``density_warmup=[...]`` sets the stages' densities. The density in
      use is ``compressor_state.current_density``; it follows the step counter, which checkpoints keep.
    * **momentum correction and factor masking**, with error feedback, when every optimizer is ``torch.optim.SGD``
      with one momentum ``m > 0`` (``momentum_correction=None``, automatic; ``True`` insists, ``False`` turns it
      off): the hook
      keeps a local velocity ``u ← m·u + g`` (Nesterov as torch's), accumulates ``v ← v + u``, sends the top-k
      of ``v`` and zeroes ``u`` and ``v`` at the sent entries. The averaged sparse ``v`` is the update, so on
      every compressed step the strategy sets the SGD groups' ``momentum`` to 0 between the backward and the
      optimizer's update and restores it right after (checkpoints keep ``m``); the warm-up's plain all-reduce steps
      use the optimizer's own momentum. ``dampening`` must be 0. Weight decay stays with the optimizer and is
      then applied without momentum. Without the correction Top-K would sparsify the gradient and let SGD's
      momentum act on the sparse average: entries sent late miss the momentum their gradient would have had.
    * **uncompressed warm-up for Adam-family optimizers** (Adam, AdamW, RMSprop, Adagrad, any with ``betas``):
      plain all-reduce for the first ``adaptive_warmup_steps=100`` steps (the larger of it and ``start_iter``),
      with a one-line warning: per-entry adaptive step sizes see each entry's gradient only when Top-K sends it,
      and can diverge or converge worse.

    Momentum correction and the Adam warm-up are set up in ``setup``, from the LightningModule's optimizers. QSGD defaults: ``levels=7`` (4 bits per entry with the sign), ``chunk_size=128``
    (one norm per 128 entries: 7.5x fewer bytes; variance bound ``min(d/s², √d/s)`` = 1.6 against 3.2 at the QSGD
    paper's 512, for 3 % more bytes), error feedback off (the quantiser is unbiased; with error feedback the
    bound must be < 1, e.g. ``levels=127``, or the residual grows), ``start_iter=0``. Both exchange by
    ``all_gather``, which pays only where bytes dominate (see ``core/scaling.py``'s projection and the table in
    :mod:`.compression_hooks`).

    Extension point (the contract ``BottleneckDoctor`` relies on): :attr:`comm_hook_wrappers` is a list of
    ``wrapper(hook) -> hook`` applied in order around the strategy's hook when ``setup`` registers it (callbacks'
    ``setup`` runs first, so a callback may append to it). DDP inspects the registered hook: its parameters must
    be named ``(state, bucket)`` and carry no annotations other than ``dist.GradBucket`` /
    ``torch.futures.Future[torch.Tensor]`` (as objects, not ``from __future__`` strings). :attr:`comm_stats`
    holds the :class:`CommStats` of this rank; no device synchronisation is needed to read it (sizes come from
    tensor shapes).

    Logged through the LightningModule every ``log_every_n_steps`` optimizer steps (``log_comm_stats=True``), as
    means over the steps since the last log, per rank (every rank sends the same amount):

    ==================================  ======  ======================================================
    key                                 unit    meaning
    ==================================  ======  ======================================================
    ``comm/bytes_before_per_step``      bytes   gradient bytes to exchange per step, uncompressed
    ``comm/bytes_sent_per_step``        bytes   bytes handed to the collectives per step, compressed
    ``comm/compression_rate``           ratio   before ÷ sent over the window (1 = none, 2 = fp16/bf16)
    ==================================  ======  ======================================================

    PowerSGD on gloo (CPU): torch's ``powerSGD_hook`` blocks inside its future callbacks, which gloo runs on its
    two worker threads; with several gradient buckets in flight that deadlocks. On gloo the strategy therefore
    completes each PowerSGD bucket before returning it to DDP (no overlap of that communication with backward); on
    NCCL the hook is asynchronous as usual. Top-K and QSGD never block in their callbacks.

    Gradient accumulation: Lightning runs non-final micro-batches under ``no_sync``, so the hook (and the
    communication) runs once per optimizer step.

    Checkpoints (``ModelCheckpoint`` and ``trainer.save_checkpoint`` alike): the compressor's state is training
    state, saved under the checkpoint key ``"lightning_accel_ddp_compression"``: the iteration counter (a resumed
    run does not repeat the warm-up), the random generators (PowerSGD's Q initialisation, QSGD's rounding), the
    cumulative :class:`CommStats` and, **of every rank**, the per-bucket tensors — PowerSGD's error feedback and
    warm-start P/Q memories, Top-K's and QSGD's residuals — split into per-parameter pieces
    (:mod:`._bucket_state`), because DDP's bucket layout differs between a fresh DDP model (reverse parameter
    order) and the rebuilt one the checkpoint was saved under. Saving gathers them to rank 0
    (``all_gather_object``, on every rank, as Lightning's checkpoint saving runs on every rank), so a checkpoint
    grows by about ``world_size ×`` the gradient size with error feedback. On resume each piece follows its
    parameter into whichever bucket holds it, through the first layout and DDP's rebuild. A run resumed at an epoch
    boundary on the same number of ranks is then the uninterrupted run: **bit-exact** for PowerSGD and Top-K
    (their arithmetic is per entry or per matrix, so the bucket order does not change a bit; measured in
    ``tests/strategies/test_compression_hooks_ddp.py``). Remaining differences, by design: QSGD's chunks (one norm
    per ``chunk_size`` entries) and its random draws follow the bucket order, which differs on the first resumed
    step (loss within 0.01 % in the test); a checkpoint written by a different number of ranks restarts the
    residuals from zero (a warning says so); a mid-epoch stop (``max_steps``, ``should_stop``) is not resumed
    exactly even by plain DDP (the loader restarts its epoch).

    Args:
        compression: ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"topk"`` or ``"qsgd"``.
        matrix_approximation_rank: PowerSGD rank (>= 1).
        start_powerSGD_iter: PowerSGD warm-up: plain all-reduce for this many steps (> 1 with error feedback or
            warm start).
        min_compression_rate: PowerSGD compresses a layer only if it shrinks at least this much.
        use_error_feedback: error feedback for PowerSGD / Top-K / QSGD (default on, on, off).
        warm_start: PowerSGD reuses P and Q between steps (recommended).
        orthogonalization_epsilon: PowerSGD epsilon in Gram-Schmidt (0 unless gradients can be all-zero columns).
        density: Top-K: fraction of each bucket's entries sent (0 < density <= 1), after the warm-up.
        density_warmup_steps: Top-K: compressed steps per density warm-up stage (default 64; 0: no warm-up).
        density_warmup: Top-K: the warm-up stages' densities (default: 0.25, 0.0625, ... above ``density``).
        momentum_correction: Top-K: DGC's momentum correction for momentum SGD (None: when the optimizer is SGD with
            momentum > 0; True: required, an error otherwise; False: off).
        adaptive_warmup_steps: Top-K: plain all-reduce steps before compressing under an Adam-family optimizer
            (default 100).
        levels: QSGD: quantisation levels per sign (1-127; 1, 7, 127 fill 2, 4, 8 bits).
        chunk_size: QSGD: entries sharing one norm (>= 1).
        start_iter: Top-K / QSGD warm-up: plain all-reduce for this many steps (>= 2 with error feedback;
            default 2 with error feedback, else 0).
        seed: QSGD: seed of the rounding generators (rank ``r`` uses ``seed + r``).
        find_unused_parameters: see above (default False).
        gradient_as_bucket_view: see above (default True).
        static_graph: see above (default False).
        log_comm_stats: log the ``comm/*`` keys.
        **kwargs: passed to ``DDPStrategy`` (and from there to ``DistributedDataParallel``), e.g.
            ``bucket_cap_mb``, ``process_group_backend``, ``timeout``.
    """

    def __init__(
        self,
        *,
        compression: Compression,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1000,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool | None = None,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        density: float = 0.01,
        density_warmup_steps: int = DEFAULT_DENSITY_WARMUP_STEPS,
        density_warmup: Sequence[float] | None = None,
        momentum_correction: bool | None = None,
        adaptive_warmup_steps: int = DEFAULT_ADAPTIVE_WARMUP_STEPS,
        levels: int = 7,
        chunk_size: int = 128,
        start_iter: int | None = None,
        seed: int = 0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        log_comm_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"DDPCompressionStrategy(compression={compression!r}): use one of "
                f"{', '.join(repr(c) for c in _COMPRESSIONS)}"
            )
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if name in kwargs:
                raise ValueError(
                    f"DDPCompressionStrategy({name}=...): this strategy sets the comm hook itself; use "
                    "`comm_hook_wrappers` to wrap it, or plain DDPStrategy for a hook of your own"
                )
        if use_error_feedback is None:
            use_error_feedback = compression != "qsgd"
        if compression == "powersgd":
            if not _is_int(matrix_approximation_rank, 1):
                raise ValueError(
                    f"ddp_powersgd: matrix_approximation_rank={matrix_approximation_rank!r} must be an "
                    "integer >= 1 (torch suggests 1, then 2, 4, ... until accuracy is satisfactory)"
                )
            if not _is_int(start_powerSGD_iter, 0):
                raise ValueError(f"ddp_powersgd: start_powerSGD_iter={start_powerSGD_iter!r} must be an integer >= 0")
            if (use_error_feedback or warm_start) and start_powerSGD_iter < 2:
                raise ValueError(
                    f"ddp_powersgd: start_powerSGD_iter={start_powerSGD_iter} must be >= 2 with error "
                    "feedback or warm start (DDP rebuilds its buckets after the first step); use >= 2"
                )
            if not isinstance(min_compression_rate, (int, float)) or min_compression_rate <= 0:
                raise ValueError(f"ddp_powersgd: min_compression_rate={min_compression_rate!r} must be > 0, e.g. 2")
        if compression in ("topk", "qsgd"):
            if start_iter is None:
                start_iter = 2 if use_error_feedback else 0
            if not _is_int(start_iter, 0):
                raise ValueError(f"ddp_{compression}: start_iter={start_iter!r} must be an integer >= 0")
            if use_error_feedback and start_iter < 2:
                raise ValueError(
                    f"ddp_{compression}: start_iter={start_iter} must be >= 2 with error feedback (DDP "
                    "rebuilds its buckets after the first step); use start_iter=2 or more"
                )
        if compression == "topk" and (
            isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1
        ):
            raise ValueError(f"ddp_topk: density={density!r} must be a fraction in (0, 1], e.g. 0.01 (1 % sent)")
        if compression == "topk":
            _check_topk_recipe(
                density_warmup_steps, density_warmup, momentum_correction, adaptive_warmup_steps, use_error_feedback
            )
        if compression == "qsgd":
            if not _is_int(levels, 1) or levels > 127:
                raise ValueError(f"ddp_qsgd: levels={levels!r} must be an integer in 1..127 (7 = 4 bits per entry)")
            if not _is_int(chunk_size, 1):
                raise ValueError(f"ddp_qsgd: chunk_size={chunk_size!r} must be an integer >= 1, e.g. 128")
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"ddp_qsgd: seed={seed!r} must be an integer")
            variance = qsgd_variance_bound(levels, chunk_size)
            if use_error_feedback and variance >= 1:
                # error feedback needs a contractive compressor: the residual grows by that factor every step
                raise ValueError(
                    f"ddp_qsgd: use_error_feedback=True with levels={levels}, chunk_size={chunk_size} "
                    f"diverges (variance bound min(d/s², √d/s) = {variance:.2f} >= 1); use levels=127 "
                    "or a smaller chunk_size, or error feedback off (QSGD is unbiased without it)"
                )
        super().__init__(
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            **kwargs,
        )
        self.compression: Compression = compression
        self._powersgd_kwargs = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": use_error_feedback,
            "warm_start": warm_start,
            "orthogonalization_epsilon": orthogonalization_epsilon,
        }
        self._hook_kwargs: dict[str, Any] = {"use_error_feedback": use_error_feedback, "start_iter": start_iter}
        if compression == "topk":
            self._hook_kwargs.update(
                density=float(density),
                density_warmup_steps=int(density_warmup_steps),
                density_warmup=None if density_warmup is None else tuple(float(d) for d in density_warmup),
            )
        elif compression == "qsgd":
            self._hook_kwargs.update(levels=levels, chunk_size=chunk_size, seed=seed)
        self.momentum_correction = momentum_correction
        self.adaptive_warmup_steps = adaptive_warmup_steps
        #: id(optimizer) -> [(param group index, its momentum)] that momentum correction switches off per step
        self._momentum_groups: dict[int, list[tuple[int, float]]] = {}
        self.log_comm_stats = log_comm_stats
        #: ``wrapper(hook) -> hook``, applied in order around the strategy's hook at registration.
        self.comm_hook_wrappers: list[Callable[[CommHook], CommHook]] = []
        #: this rank's cumulative :class:`CommStats`.
        self.comm_stats = CommStats()
        #: the compressor's state object (PowerSGDState, TopKState or QSGDState); None for fp16/bf16
        self.compressor_state: Any = None
        self._restored: dict[str, Any] | None = None
        self._mover: BucketStateMover | None = None  # per-bucket state through DDP's bucket layouts
        self._param_index: dict[int, int] = {}
        self._iters_since_setup = 0
        self._blocking_powersgd = False
        self._logged = CommStats()
        self._lock = threading.Lock()

    @property
    def powersgd_state(self) -> Any:
        """torch's ``PowerSGDState`` of a ``ddp_powersgd`` run (None before ``setup`` and for the others)."""
        return self.compressor_state if self.compression == "powersgd" else None

    @property
    def string(self) -> str:
        """The strategy string this configuration is registered under."""
        return f"ddp_{self.compression}{'_compress' if self.compression in ('fp16', 'bf16') else ''}"

    # --- hook construction ---------------------------------------------------------------------------------
    def _base_hook(self) -> tuple[Any, CommHook]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from lightning_accel.strategies import compression_hooks

        if self.compression == "fp16":
            return None, default_hooks.fp16_compress_hook
        if self.compression == "bf16":
            return None, default_hooks.bf16_compress_hook
        hook: CommHook
        if self.compression == "powersgd":
            state: Any = powerSGD_hook.PowerSGDState(process_group=None, **self._powersgd_kwargs)
            hook = powerSGD_hook.powerSGD_hook
        elif self.compression == "topk":
            state, hook = compression_hooks.TopKState(**self._hook_kwargs), compression_hooks.topk_hook
        else:
            state, hook = compression_hooks.QSGDState(**self._hook_kwargs), compression_hooks.qsgd_hook
        self._apply_restored(state)
        self.compressor_state = state
        return state, hook

    def _apply_restored(self, state: Any) -> None:
        """Put the restored counters and generators into a new state object (pieces go to the mover in setup)."""
        restored = self._restored
        if not restored:
            return
        state.iter = int(restored["iter"])
        if self.compression == "powersgd":
            import numpy as np

            name, keys, pos, has_gauss, cached = restored["rng"]
            state.rng.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            state.total_numel_before_compression = int(restored["numel_before"])
            state.total_numel_after_compression = int(restored["numel_after"])
        else:
            state.bytes_sent = int(restored.get("hook_bytes_sent", 0))
            if hasattr(state, "generator_state"):  # QSGD: applied when the generator is made on the device
                state.generator_state = restored.get("generator")

    def _bucket_dicts(self) -> tuple[str, ...]:
        """The state object's per-bucket dicts in use (error feedback, PowerSGD's warm-start memories)."""
        if self.compression == "powersgd":
            kw = self._powersgd_kwargs
            return (("error_dict",) if kw["use_error_feedback"] else ()) + (
                ("p_memory_dict", "q_memory_dict") if kw["warm_start"] else ()
            )
        if self.compression == "topk" and self._hook_kwargs["use_error_feedback"]:
            # the velocity of momentum correction too (empty unless setup turns the correction on)
            return ("error_dict", "momentum_dict")
        if self.compression == "qsgd" and self._hook_kwargs["use_error_feedback"]:
            return ("error_dict",)
        return ()

    def _make_mover(self, parameters: list[torch.Tensor]) -> None:
        names = self._bucket_dicts()
        self._param_index = {id(p): i for i, p in enumerate(parameters)}
        if not names:
            self._mover = None
            return
        kw = self._powersgd_kwargs
        powersgd = (
            (int(kw["matrix_approximation_rank"]), float(kw["min_compression_rate"]))
            if self.compression == "powersgd"
            else None
        )
        self._mover = BucketStateMover([p.shape for p in parameters], names, powersgd=powersgd)
        pieces = (self._restored or {}).get("pieces") or {}
        for name in names:
            self._mover.pieces[name] = {int(param): t for param, t in pieces.get(name, {}).items()}

    def _counting_hook(self, hook: CommHook) -> CommHook:
        """Wrap ``hook`` so it counts calls and bytes into :attr:`comm_stats` (sizes from shapes: no sync)."""
        compression = self.compression
        mover, param_index = self._mover, self._param_index

        # no annotations: DDP compares them (as objects) with dist.GradBucket/Future, and this module's are strings
        def counted(state, bucket):  # type: ignore[no-untyped-def]
            buffer = bucket.buffer()
            before = buffer.numel() * buffer.element_size()
            active = True
            if compression in ("fp16", "bf16"):
                fut = hook(state, bucket)
                sent = buffer.numel() * 2  # fp16 / bf16: 2 bytes per element
            else:
                if mover is not None:  # the state follows its parameters into this bucket layout
                    mover.enter(state, bucket.index(), [param_index[id(p)] for p in bucket.parameters()], buffer.device)
                # read per call: setup may move the start (Top-K's warm-up for Adam-family optimizers)
                start = state.start_powerSGD_iter if compression == "powersgd" else state.start_iter
                active = state.iter >= start
                if compression == "powersgd":
                    numel_after = state.total_numel_after_compression
                    fut = hook(state, bucket)
                    if active and self._blocking_powersgd:
                        # torch's powerSGD_hook calls .wait() inside its future callbacks; on gloo those run on
                        # gloo's two worker threads, so two buckets in flight can block both and deadlock. Finish
                        # each bucket before the next (no overlap with backward for PowerSGD on gloo).
                        fut.wait()
                    sent = (
                        (state.total_numel_after_compression - numel_after) * buffer.element_size()
                        if active
                        else before
                    )
                else:
                    sent_before = state.bytes_sent
                    fut = hook(state, bucket)
                    sent = state.bytes_sent - sent_before
            with self._lock:
                stats = self.comm_stats
                stats.calls += 1
                stats.bytes_before += before
                stats.bytes_sent += sent
                if bucket.is_last():  # DDP reduces bucket 0 last: one per synchronising backward
                    stats.steps += 1
                    stats.compressed_steps += int(active)
                    stats.powersgd_steps += int(active and compression == "powersgd")
                    self._iters_since_setup += 1
            return fut

        return counted

    def build_comm_hook(self) -> tuple[Any, CommHook]:
        """(state, hook) that ``setup`` registers: the hook, counted, then :attr:`comm_hook_wrappers` in order."""
        state, hook = self._base_hook()
        hook = self._counting_hook(hook)
        for wrapper in self.comm_hook_wrappers:
            hook = wrapper(hook)
        return state, hook

    # --- Lightning overrides ----------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size == 1:
            rank_zero_warn(
                f"{self.string} on a single device does nothing useful: there is no gradient all-reduce to "
                "compress. Use strategy='auto' on one device, or devices >= 2."
            )

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning 2.6.6 DDPStrategy._register_ddp_hooks registers hooks only when root_device is CUDA; the hooks
        # also run on gloo (CPU), so register ours on every device type.
        from torch.nn.parallel import DistributedDataParallel

        assert isinstance(self.model, DistributedDataParallel)
        self._make_mover(list(self.model.parameters()))
        state, hook = self.build_comm_hook()
        self._iters_since_setup = 0
        self._blocking_powersgd = torch.distributed.get_backend() == "gloo"
        self.model.register_comm_hook(state, hook)
        if self.compression == "powersgd":
            rank_zero_info(
                f"ddp_powersgd: rank {self._powersgd_kwargs['matrix_approximation_rank']}, plain all-reduce "
                f"for the first {self._powersgd_kwargs['start_powerSGD_iter']} steps "
                f"(now at step {state.iter})"
            )
        elif self.compression == "qsgd":
            self._log_hook_plan(state)

    def _log_hook_plan(self, state: Any) -> None:
        knob = (
            f"density {self._hook_kwargs['density']}"
            if self.compression == "topk"
            else f"{self._hook_kwargs['levels']} levels ({state.bits} bits per entry)"
        )
        feedback = "on" if self._hook_kwargs["use_error_feedback"] else "off"
        if self.compression == "topk" and state.density_warmup_steps and state.density_warmup:
            stages = " → ".join(f"{d:g}" for d in state.density_warmup)
            knob += f" after a warm-up {stages} ({state.density_warmup_steps} steps each)"
        rank_zero_info(
            f"{self.string}: {knob}, error feedback {feedback}, plain all-reduce for the first "
            f"{state.start_iter} steps (now at step {state.iter})"
        )

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.compression == "topk" and self.compressor_state is not None:
            # Top-K's plan depends on the optimizers (momentum correction, Adam's warm-up): logged once known
            self.configure_topk_for_optimizers(self.optimizers)
            self._log_hook_plan(self.compressor_state)

    def configure_topk_for_optimizers(self, optimizers: Sequence[Any]) -> None:
        """DGC's optimizer-dependent parts (``setup`` calls it once the optimizers exist; see the class doc):
        momentum correction for momentum SGD, the uncompressed warm-up (with its warning) for Adam-family ones."""
        state = self.compressor_state
        self._momentum_groups = {}
        state.momentum, state.nesterov = 0.0, False
        state.start_iter = int(self._hook_kwargs["start_iter"])
        adaptive = [type(o).__name__ for o in optimizers if _is_adaptive(o)]
        sgd = [(o, i, g) for o in optimizers if isinstance(o, torch.optim.SGD) for i, g in enumerate(o.param_groups)]
        all_momentum_sgd = bool(optimizers) and all(isinstance(o, torch.optim.SGD) for o in optimizers)
        momenta = sorted({float(g.get("momentum", 0.0)) for _, _, g in sgd})
        # without error feedback there is no residual to accumulate the velocity in: no correction (True is refused
        # at construction)
        correct = self.momentum_correction is not False and bool(self._hook_kwargs["use_error_feedback"])
        if correct and all_momentum_sgd and momenta != [0.0]:
            if len(momenta) > 1:
                raise ValueError(
                    f"ddp_topk: momentum correction needs one momentum for all parameters; the SGD param groups "
                    f"have momentum {momenta}: use one value, or momentum_correction=False"
                )
            dampening = sorted({float(g.get("dampening", 0.0)) for _, _, g in sgd})
            if dampening != [0.0]:
                raise ValueError(
                    f"ddp_topk: momentum correction with SGD dampening={dampening} is not DGC's momentum; use "
                    "dampening=0, or momentum_correction=False"
                )
            nesterov = {bool(g.get("nesterov", False)) for _, _, g in sgd}
            if len(nesterov) > 1:
                raise ValueError(
                    "ddp_topk: momentum correction needs nesterov the same in every SGD param group; make it so, or "
                    "use momentum_correction=False"
                )
            state.momentum, state.nesterov = momenta[0], nesterov.pop()
            for o, i, _g in sgd:
                self._momentum_groups.setdefault(id(o), []).append((i, momenta[0]))
            rank_zero_info(
                f"ddp_topk: momentum correction and factor masking for SGD momentum {momenta[0]}"
                f"{' (Nesterov)' if state.nesterov else ''}: the hook keeps the velocity; SGD steps without "
                "momentum on compressed steps"
            )
        elif self.momentum_correction:
            names = [type(o).__name__ for o in optimizers]
            raise ValueError(
                f"ddp_topk: momentum_correction=True needs torch.optim.SGD with momentum > 0 as every optimizer; "
                f"the optimizers are {names} (momenta {momenta}): use momentum_correction=None (automatic) or False"
            )
        if adaptive:
            state.start_iter = max(state.start_iter, int(self.adaptive_warmup_steps))
            rank_zero_warn(
                f"ddp_topk with {', '.join(adaptive)}: adaptive optimizers on sparsified gradients can diverge or "
                f"converge worse; plain all-reduce for the first {state.start_iter} steps (adaptive_warmup_steps="
                f"{self.adaptive_warmup_steps}), then Top-K",
                category=UserWarning,
            )

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        groups = self._momentum_groups.get(id(optimizer))
        if groups:
            closure = self._momentum_off_when_compressed(optimizer, closure, groups)
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            for i, momentum in groups or ():  # the optimizer keeps its own momentum outside the step (checkpoints)
                optimizer.param_groups[i]["momentum"] = momentum
        if self.log_comm_stats:
            self._maybe_log()
        return output

    def _momentum_off_when_compressed(
        self, optimizer: Any, closure: Callable[[], Any], groups: list[tuple[int, float]]
    ) -> Callable[[], Any]:
        """``closure`` followed by setting the momentum-corrected groups' momentum for the update that follows: 0
        when the hook compressed this backward (it already applied momentum), else the optimizer's own. Runs after
        the backward (inside ``optimizer.step`` with automatic optimization; after ``manual_backward`` otherwise)."""
        state = self.compressor_state

        def then_momentum() -> Any:
            out = closure()
            for i, momentum in groups:
                optimizer.param_groups[i]["momentum"] = 0.0 if state.last_compressed else momentum
            return out

        return then_momentum

    def _maybe_log(self) -> None:
        module = self.lightning_module
        trainer = _compat.module_trainer(module)
        if trainer is None or not trainer.training:
            return
        every = max(1, trainer.log_every_n_steps)
        # global_step is incremented after this call, so step N+1 is the one being finished
        if (trainer.global_step + 1) % every:
            return
        stats, last = self.comm_stats, self._logged
        steps = stats.steps - last.steps
        if steps <= 0:
            return
        before = (stats.bytes_before - last.bytes_before) / steps
        sent = (stats.bytes_sent - last.bytes_sent) / steps
        module.log("comm/bytes_before_per_step", before, on_step=True, on_epoch=False)
        module.log("comm/bytes_sent_per_step", sent, on_step=True, on_epoch=False)
        module.log("comm/compression_rate", before / sent if sent else float("nan"), on_step=True, on_epoch=False)
        self._logged = CommStats(**asdict(stats))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # every rank runs this (Lightning's checkpoint saving is collective); the per-rank state is gathered here
        checkpoint[_CHECKPOINT_KEY] = self.compression_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if _CHECKPOINT_KEY in checkpoint:
            self.load_compression_state_dict(checkpoint[_CHECKPOINT_KEY])
        return checkpoint

    def _local_state(self) -> dict[str, Any] | None:
        """This rank's compressor state: counters, generators, per-bucket tensors (on CPU) with their layouts."""
        state = self.compressor_state
        if state is None:
            return None
        out: dict[str, Any] = {"iter": int(state.iter)}
        if self.compression == "powersgd":
            name, keys, pos, has_gauss, cached = state.rng.get_state()
            out.update(
                rng=(name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
                numel_before=int(state.total_numel_before_compression),
                numel_after=int(state.total_numel_after_compression),
            )
        else:
            out["hook_bytes_sent"] = int(state.bytes_sent)
            if self.compression == "topk":  # for reading only: the step counter sets the density on resume
                out["density"] = float(state.current_density)
            generator = getattr(state, "generator", None)
            out["generator"] = (
                generator.get_state() if generator is not None else getattr(state, "generator_state", None)
            )
        # per parameter (position in model.parameters()), so a run with another bucket layout can take it
        out["pieces"] = self._mover.state_pieces(state) if self._mover is not None else {}
        return out

    def compression_state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (see the class docstring): plain objects and CPU tensors (weights_only-safe).

        A collective under a running process group with several ranks: call it on every rank.
        """
        out: dict[str, Any] = {"compression": self.compression, "comm_stats": asdict(self.comm_stats)}
        local = self._local_state()
        if local is None:
            return out
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, local)
        else:
            ranks = [local]
        out.update(world_size=len(ranks), ranks=ranks)
        if self.compression == "powersgd":  # the counters of earlier releases, kept readable
            out.update(
                powersgd_iter=local["iter"],
                powersgd_rng=local["rng"],
                powersgd_numel_before=local["numel_before"],
                powersgd_numel_after=local["numel_after"],
            )
        return out

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict` (this rank's entry); applied when ``setup`` builds the hook."""
        if state.get("compression") != self.compression:
            rank_zero_warn(
                f"checkpoint was written with compression={state.get('compression')!r}, this run uses "
                f"{self.compression!r}: communication statistics and compressor state are not restored"
            )
            return
        self.comm_stats = CommStats(**state["comm_stats"])
        self._logged = CommStats(**state["comm_stats"])
        restored: dict[str, Any] | None = None
        if "ranks" in state:
            ranks = state["ranks"]
            if len(ranks) == self.world_size:
                restored = dict(ranks[self.global_rank])
            else:
                # counters and generators are the same on every rank (PowerSGD) or per rank (QSGD's seeds): take
                # rank 0's counters; residuals belong to ranks that no longer exist
                restored = {**ranks[0], "pieces": {}}
                if "generator" in restored:
                    restored["generator"] = None
                rank_zero_warn(
                    f"{self.string}: checkpoint written by {len(ranks)} ranks, this run has "
                    f"{self.world_size}: error-feedback residuals restart from zero"
                )
        elif "powersgd_iter" in state:  # a checkpoint of an earlier release: counters only
            restored = {
                "iter": state["powersgd_iter"],
                "rng": state["powersgd_rng"],
                "numel_before": state["powersgd_numel_before"],
                "numel_after": state["powersgd_numel_after"],
            }
        self._restored = restored
        if restored is not None and self.compressor_state is not None:  # restored after setup: apply now
            self._apply_restored(self.compressor_state)
            if self._mover is not None:
                self._mover.split_all(self.compressor_state)
                for name in self._mover.dict_names:
                    self._mover.pieces[name] = {int(p): t for p, t in restored.get("pieces", {}).get(name, {}).items()}


def ddp_fp16_compress(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_fp16_compress"``: gradients cast to fp16 for the all-reduce (half the bytes)."""
    return DDPCompressionStrategy(compression="fp16", **kwargs)


def ddp_bf16_compress(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_bf16_compress"``: gradients cast to bf16 for the all-reduce (half the bytes, fp32's range)."""
    return DDPCompressionStrategy(compression="bf16", **kwargs)


def ddp_powersgd(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_powersgd"``: PowerSGD low-rank gradient compression after a plain all-reduce warm-up."""
    return DDPCompressionStrategy(compression="powersgd", **kwargs)


def ddp_topk(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_topk"``: Top-K sparsification (1 % of the entries) with error feedback and Deep Gradient
    Compression's recipe (density warm-up, momentum correction for momentum SGD, plain steps first for Adam), by
    all-gather."""
    return DDPCompressionStrategy(compression="topk", **kwargs)


def ddp_qsgd(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_qsgd"``: QSGD unbiased stochastic quantisation (7 levels, 4 bits per entry), by all-gather."""
    return DDPCompressionStrategy(compression="qsgd", **kwargs)
