"""DDP with gradient compression: fp16 / bf16 casting or PowerSGD low-rank compression before the all-reduce.

Strings (after ``import lightning_accel``): ``ddp_fp16_compress``, ``ddp_bf16_compress``, ``ddp_powersgd``. Each
is :class:`DDPCompressionStrategy` with torch's DDP communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks``), registered by this strategy on CPU (gloo) and CUDA (NCCL)
alike — Lightning's ``DDPStrategy`` registers hooks only on CUDA devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _compat

_compat.require_versions("the DDP compression strategies")

__all__ = ["CommStats", "DDPCompressionStrategy", "ddp_bf16_compress", "ddp_fp16_compress", "ddp_powersgd"]

Compression = Literal["fp16", "bf16", "powersgd"]
#: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, torch's DDP communication-hook signature.
CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]

_CHECKPOINT_KEY = "lightning_accel_ddp_compression"
# DDP rebuilds its gradient buckets after the first iteration of a new DDP model; state that PowerSGD memorises per
# bucket (error feedback, warm-start P/Q) must not be created before that (torch's PowerSGDState demands
# start_powerSGD_iter > 1 for the same reason). A resumed run gets a new DDP model, so it all-reduces plainly for this
# many backward passes before PowerSGD resumes.
_DDP_BUCKET_REBUILD_ITERS = 2


@dataclass
class CommStats:
    """Gradient-communication statistics of one rank, counted by the strategy's hook (cumulative since ``fit``).

    All byte counts are of the payload this rank hands to ``all_reduce`` (the tensors' ``numel × element_size``),
    not of wire traffic: a ring all-reduce moves about ``2·(N-1)/N`` times the payload per rank.

    Attributes:
        steps: synchronising backward passes (one per optimizer step; accumulation micro-batches under
            ``no_sync`` do not communicate and do not count).
        calls: hook calls (one per gradient bucket per synchronising backward).
        bytes_before: bytes of the gradient buckets before compression (their dtype, usually fp32).
        bytes_sent: bytes all-reduced after compression.
        powersgd_steps: steps in which PowerSGD compressed (0 for fp16/bf16; warm-up steps all-reduce plainly).
    """

    steps: int = 0
    calls: int = 0
    bytes_before: int = 0
    bytes_sent: int = 0
    powersgd_steps: int = 0

    @property
    def compression_rate(self) -> float:
        """``bytes_before / bytes_sent`` (1.0 = no compression; nan before the first all-reduce)."""
        return self.bytes_before / self.bytes_sent if self.bytes_sent else float("nan")

    def as_dict(self) -> dict[str, float]:
        """The counters and ``compression_rate`` as one flat dict (what ``BottleneckDoctor`` reads)."""
        return {**asdict(self), "compression_rate": self.compression_rate}


class DDPCompressionStrategy(DDPStrategy):
    """Lightning DDP whose gradient all-reduce is compressed by one of torch's DDP communication hooks.

    ===============  =================================  ===============================================
    ``compression``  torch hook                         traffic per step (payload vs fp32 gradients)
    ===============  =================================  ===============================================
    ``"fp16"``       ``default_hooks.fp16_compress_``   1/2; fp16 range: gradients above 65504 overflow
                     ``hook``
    ``"bf16"``       ``default_hooks.bf16_compress_``   1/2; fp32's range, 8-bit mantissa
                     ``hook``
    ``"powersgd"``   ``powerSGD_hook.powerSGD_hook``    ``(n + m)·rank / (n·m)`` per compressed matrix;
                     (Vogels et al. 2019)               plain all-reduce during warm-up
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
    ``comm/bytes_before_per_step``      bytes   gradient bytes to all-reduce per step, uncompressed
    ``comm/bytes_sent_per_step``        bytes   bytes handed to all-reduce per step, after compression
    ``comm/compression_rate``           ratio   before ÷ sent over the window (1 = none, 2 = fp16/bf16)
    ==================================  ======  ======================================================

    PowerSGD on gloo (CPU): torch's ``powerSGD_hook`` blocks inside its future callbacks, which gloo runs on its
    two worker threads; with several gradient buckets in flight that deadlocks. On gloo the strategy therefore
    completes each PowerSGD bucket before returning it to DDP (no overlap of that communication with backward); on
    NCCL the hook is asynchronous as usual.

    Gradient accumulation: Lightning runs non-final micro-batches under ``no_sync``, so the hook (and the
    communication) runs once per optimizer step.

    Checkpoints: with ``ddp_powersgd`` the strategy saves, under the checkpoint key
    ``"lightning_accel_ddp_compression"``, PowerSGD's iteration counter (so a resumed run does not repeat the
    warm-up), its random generator state (Q initialisation stays identical on all ranks) and the cumulative
    :class:`CommStats`. Not saved: the error-feedback tensors and warm-start P/Q matrices — they are per rank and
    per bucket (rank 0's checkpoint could not hold the others') and gradient-sized; a resumed run restarts them
    from zero / random, as PowerSGD does on its first compressed step, after ``2`` plain all-reduce steps that let
    DDP rebuild its buckets.

    Args:
        compression: ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        matrix_approximation_rank: PowerSGD rank (>= 1).
        start_powerSGD_iter: PowerSGD warm-up: plain all-reduce for this many steps (> 1 with error feedback or
            warm start).
        min_compression_rate: PowerSGD compresses a layer only if it shrinks at least this much.
        use_error_feedback: PowerSGD error feedback (recommended).
        warm_start: PowerSGD reuses P and Q between steps (recommended).
        orthogonalization_epsilon: PowerSGD epsilon in Gram-Schmidt (0 unless gradients can be all-zero columns).
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
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        log_comm_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        if compression not in ("fp16", "bf16", "powersgd"):
            raise ValueError(f"DDPCompressionStrategy(compression={compression!r}): use 'fp16', 'bf16' or 'powersgd'")
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if name in kwargs:
                raise ValueError(f"DDPCompressionStrategy({name}=...): this strategy sets the comm hook itself; use "
                                 "`comm_hook_wrappers` to wrap it, or plain DDPStrategy for a hook of your own")
        if compression == "powersgd":
            if isinstance(matrix_approximation_rank, bool) or not isinstance(matrix_approximation_rank, int) \
                    or matrix_approximation_rank < 1:
                raise ValueError(f"ddp_powersgd: matrix_approximation_rank={matrix_approximation_rank!r} must be an "
                                 "integer >= 1 (torch suggests 1, then 2, 4, ... until accuracy is satisfactory)")
            if isinstance(start_powerSGD_iter, bool) or not isinstance(start_powerSGD_iter, int) \
                    or start_powerSGD_iter < 0:
                raise ValueError(f"ddp_powersgd: start_powerSGD_iter={start_powerSGD_iter!r} must be an integer >= 0")
            if (use_error_feedback or warm_start) and start_powerSGD_iter < 2:
                raise ValueError(f"ddp_powersgd: start_powerSGD_iter={start_powerSGD_iter} must be >= 2 with error "
                                 "feedback or warm start (DDP rebuilds its buckets after the first step); use >= 2")
            if not isinstance(min_compression_rate, (int, float)) or min_compression_rate <= 0:
                raise ValueError(f"ddp_powersgd: min_compression_rate={min_compression_rate!r} must be > 0, e.g. 2")
        super().__init__(find_unused_parameters=find_unused_parameters,
                         gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph, **kwargs)
        self.compression: Compression = compression
        self._powersgd_kwargs = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": use_error_feedback,
            "warm_start": warm_start,
            "orthogonalization_epsilon": orthogonalization_epsilon,
        }
        self.log_comm_stats = log_comm_stats
        #: ``wrapper(hook) -> hook``, applied in order around the strategy's hook at registration.
        self.comm_hook_wrappers: list[Callable[[CommHook], CommHook]] = []
        #: this rank's cumulative :class:`CommStats`.
        self.comm_stats = CommStats()
        self.powersgd_state: Any = None
        self._restored: dict[str, Any] | None = None
        self._iters_since_setup = 0
        self._blocking_powersgd = False
        self._logged = CommStats()
        self._lock = threading.Lock()

    # --- hook construction ---------------------------------------------------------------------------------
    def _base_hook(self) -> tuple[Any, CommHook]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.compression == "fp16":
            return None, default_hooks.fp16_compress_hook
        if self.compression == "bf16":
            return None, default_hooks.bf16_compress_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, **self._powersgd_kwargs)
        if self._restored:
            state.iter = int(self._restored["powersgd_iter"])
            state.rng.set_state(self._restored["powersgd_rng"])
            state.total_numel_before_compression = int(self._restored["powersgd_numel_before"])
            state.total_numel_after_compression = int(self._restored["powersgd_numel_after"])
        self.powersgd_state = state
        return state, powerSGD_hook.powerSGD_hook

    def _counting_hook(self, hook: CommHook) -> CommHook:
        """Wrap ``hook`` so it counts calls and bytes into :attr:`comm_stats` (sizes from shapes: no sync)."""
        compression = self.compression

        # no annotations: DDP compares them (as objects) with dist.GradBucket/Future, and this module's are strings
        def counted(state, bucket):  # type: ignore[no-untyped-def]
            buffer = bucket.buffer()
            before = buffer.numel() * buffer.element_size()
            powersgd_active = False
            if compression == "powersgd":
                if state.iter >= state.start_powerSGD_iter and self._iters_since_setup < _DDP_BUCKET_REBUILD_ITERS:
                    # resumed run: plain all-reduce until DDP has rebuilt its buckets (see _DDP_BUCKET_REBUILD_ITERS)
                    fut = _compat.allreduce_future(state.process_group or torch.distributed.group.WORLD, buffer)
                    state.maybe_increase_iter(bucket)
                    sent = before
                else:
                    powersgd_active = state.iter >= state.start_powerSGD_iter
                    numel_after = state.total_numel_after_compression
                    fut = hook(state, bucket)
                    if powersgd_active and self._blocking_powersgd:
                        # torch's powerSGD_hook calls .wait() inside its future callbacks; on gloo those run on
                        # gloo's two worker threads, so two buckets in flight can block both and deadlock. Finish
                        # each bucket before the next (no overlap with backward for PowerSGD on gloo).
                        fut.wait()
                    sent = ((state.total_numel_after_compression - numel_after) * buffer.element_size()
                            if powersgd_active else before)
            else:
                fut = hook(state, bucket)
                sent = buffer.numel() * 2  # fp16 / bf16: 2 bytes per element
            with self._lock:
                stats = self.comm_stats
                stats.calls += 1
                stats.bytes_before += before
                stats.bytes_sent += sent
                if bucket.is_last():  # DDP reduces bucket 0 last: one per synchronising backward
                    stats.steps += 1
                    stats.powersgd_steps += int(powersgd_active)
                    self._iters_since_setup += 1
            return fut

        return counted

    def build_comm_hook(self) -> tuple[Any, CommHook]:
        """(state, hook) that ``setup`` registers: torch's hook, counted, then :attr:`comm_hook_wrappers` in order."""
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
            rank_zero_warn(f"ddp_{self.compression}{'' if self.compression == 'powersgd' else '_compress'} on a "
                           "single device does nothing useful: there is no gradient all-reduce to compress. Use "
                           "strategy='auto' on one device, or devices >= 2.")

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning 2.6.6 DDPStrategy._register_ddp_hooks registers hooks only when root_device is CUDA; torch's
        # hooks also run on gloo (CPU), so register ours on every device type.
        from torch.nn.parallel import DistributedDataParallel

        assert isinstance(self.model, DistributedDataParallel)
        state, hook = self.build_comm_hook()
        self._iters_since_setup = 0
        self._blocking_powersgd = torch.distributed.get_backend() == "gloo"
        self.model.register_comm_hook(state, hook)
        if self.compression == "powersgd":
            rank_zero_info(f"ddp_powersgd: rank {self._powersgd_kwargs['matrix_approximation_rank']}, plain all-reduce "
                           f"for the first {self._powersgd_kwargs['start_powerSGD_iter']} steps "
                           f"(now at step {self.powersgd_state.iter})")

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_comm_stats:
            self._maybe_log()
        return output

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
        checkpoint[_CHECKPOINT_KEY] = self.compression_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if _CHECKPOINT_KEY in checkpoint:
            self.load_compression_state_dict(checkpoint[_CHECKPOINT_KEY])
        return checkpoint

    def compression_state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (see the class docstring): plain Python objects, loadable with weights_only."""
        out: dict[str, Any] = {"compression": self.compression, "comm_stats": asdict(self.comm_stats)}
        state = self.powersgd_state
        if state is not None:
            name, keys, pos, has_gauss, cached = state.rng.get_state()
            out.update(powersgd_iter=int(state.iter),
                       powersgd_rng=(name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
                       powersgd_numel_before=int(state.total_numel_before_compression),
                       powersgd_numel_after=int(state.total_numel_after_compression))
        return out

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict`; applied to PowerSGD when ``setup`` builds its hook."""
        if state.get("compression") != self.compression:
            rank_zero_warn(f"checkpoint was written with compression={state.get('compression')!r}, this run uses "
                           f"{self.compression!r}: communication statistics and PowerSGD state are not restored")
            return
        self.comm_stats = CommStats(**state["comm_stats"])
        self._logged = CommStats(**state["comm_stats"])
        if "powersgd_iter" in state:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["powersgd_rng"]
            self._restored = {**state, "powersgd_rng": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                                        cached)}
            if self.powersgd_state is not None:  # already set up (restore after setup): apply now
                self.powersgd_state.iter = int(state["powersgd_iter"])
                self.powersgd_state.rng.set_state(self._restored["powersgd_rng"])


def ddp_fp16_compress(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_fp16_compress"``: gradients cast to fp16 for the all-reduce (half the bytes)."""
    return DDPCompressionStrategy(compression="fp16", **kwargs)


def ddp_bf16_compress(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_bf16_compress"``: gradients cast to bf16 for the all-reduce (half the bytes, fp32's range)."""
    return DDPCompressionStrategy(compression="bf16", **kwargs)


def ddp_powersgd(**kwargs: Any) -> DDPCompressionStrategy:
    """``strategy="ddp_powersgd"``: PowerSGD low-rank gradient compression after a plain all-reduce warm-up."""
    return DDPCompressionStrategy(compression="powersgd", **kwargs)
