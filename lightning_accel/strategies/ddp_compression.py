"""DDP with gradient compression: ``ddp_fp16_compress``, ``ddp_bf16_compress``, ``ddp_powersgd``, ``ddp_topk``, ``ddp_qsgd``.

:class:`DDPCompressionStrategy` is the Lightning wiring of its parts: the knobs (:mod:`.ddp_compression_config`), the
compressor and its checkpoint format (:mod:`.compressor_state`), the counters (:mod:`.comm_stats`) and DGC's
optimizer-dependent parts (:mod:`.topk_optimizers`). See docs/techniques/ddp-compression.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel.strategies._bucket_state import BucketStateMover
from lightning_accel.strategies.comm_stats import CommCounter, CommHook, CommStats
from lightning_accel.strategies.compressor_state import _CHECKPOINT_KEY, Compressor
from lightning_accel.strategies.ddp_compression_config import (
    DEFAULT_ADAPTIVE_WARMUP_STEPS,
    DEFAULT_DENSITY_WARMUP_STEPS,
    Compression,
    DDPCompressionConfig,
)
from lightning_accel.strategies.outstanding_work import FinishesOutstandingWork
from lightning_accel.strategies.topk_optimizers import configure_topk_for_optimizers, momentum_off_when_compressed

_compat.require_versions("the DDP compression strategies")

__all__ = [
    "DEFAULT_ADAPTIVE_WARMUP_STEPS",
    "DEFAULT_DENSITY_WARMUP_STEPS",
    "CommHook",
    "CommStats",
    "Compression",
    "DDPCompressionConfig",
    "DDPCompressionStrategy",
    "ddp_bf16_compress",
    "ddp_fp16_compress",
    "ddp_powersgd",
    "ddp_qsgd",
    "ddp_topk",
]


class _Kept:
    """An attribute of the strategy that one of its parts keeps: read and set through the strategy."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), self.name, value)


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
    ``all_gather``, which pays only where bytes dominate (see ``core/scaling.py``'s projection and the hooks' table
    in docs/techniques/ddp-compression.md).

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

    # the knobs live in :attr:`config`, the counters and the compressor in their parts; read and set them here
    compression: Compression = _Kept("config", "compression")  # type: ignore[assignment]
    momentum_correction: bool | None = _Kept("config", "momentum_correction")  # type: ignore[assignment]
    adaptive_warmup_steps: int = _Kept("config", "adaptive_warmup_steps")  # type: ignore[assignment]
    log_comm_stats: bool = _Kept("config", "log_comm_stats")  # type: ignore[assignment]
    #: this rank's cumulative :class:`CommStats`.
    comm_stats: CommStats = _Kept("_counter", "stats")  # type: ignore[assignment]
    #: the compressor's state object (PowerSGDState, TopKState or QSGDState); None for fp16/bf16
    compressor_state: Any = _Kept("_compressor", "state")

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
        knobs = locals()  # the arguments, read before any other local is made
        #: the validated knobs (:class:`~.ddp_compression_config.DDPCompressionConfig`)
        self.config = DDPCompressionConfig(**{f.name: knobs[f.name] for f in fields(DDPCompressionConfig)})
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if name in kwargs:
                raise ValueError(
                    f"DDPCompressionStrategy({name}=...): this strategy sets the comm hook itself; use "
                    "`comm_hook_wrappers` to wrap it, or plain DDPStrategy for a hook of your own"
                )
        super().__init__(
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            **kwargs,
        )
        self._compressor = Compressor(self.config)
        self._counter = CommCounter()
        #: id(optimizer) -> [(param group index, its momentum)] that momentum correction switches off per step
        self._momentum_groups: dict[int, list[tuple[int, float]]] = {}
        #: ``wrapper(hook) -> hook``, applied in order around the strategy's hook at registration.
        self.comm_hook_wrappers: list[Callable[[CommHook], CommHook]] = []

    @property
    def powersgd_state(self) -> Any:
        """torch's ``PowerSGDState`` of a ``ddp_powersgd`` run (None before ``setup`` and for the others)."""
        return self.compressor_state if self.compression == "powersgd" else None

    @property
    def string(self) -> str:
        """The strategy string this configuration is registered under."""
        return self.config.string

    @property
    def _powersgd_kwargs(self) -> dict[str, Any]:
        return self.config.powersgd_kwargs

    @property
    def _hook_kwargs(self) -> dict[str, Any]:
        return self.config.hook_kwargs

    @property
    def _mover(self) -> BucketStateMover | None:
        return self._compressor.mover

    @property
    def _param_index(self) -> dict[int, int]:
        return self._compressor.param_index

    # --- hook construction ---------------------------------------------------------------------------------
    def _base_hook(self) -> tuple[Any, CommHook]:
        return self._compressor.build()

    def _make_mover(self, parameters: list[torch.Tensor]) -> None:
        self._compressor.make_mover(parameters)

    def build_comm_hook(self) -> tuple[Any, CommHook]:
        """(state, hook) that ``setup`` registers: the hook, counted, then :attr:`comm_hook_wrappers` in order."""
        state, hook = self._base_hook()
        hook = self._counter.counting_hook(hook, self.compression, self._mover, self._param_index)
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
        self._counter.blocking_powersgd = torch.distributed.get_backend() == "gloo"
        self.model.register_comm_hook(state, hook)
        if self.compression == "powersgd":
            rank_zero_info(
                f"ddp_powersgd: rank {self.config.matrix_approximation_rank}, plain all-reduce "
                f"for the first {self.config.start_powerSGD_iter} steps "
                f"(now at step {state.iter})"
            )
        elif self.compression == "qsgd":
            self._log_hook_plan(state)

    def _log_hook_plan(self, state: Any) -> None:
        config = self.config
        knob = (
            f"density {config.hook_kwargs['density']}"
            if self.compression == "topk"
            else f"{config.levels} levels ({state.bits} bits per entry)"
        )
        feedback = "on" if config.use_error_feedback else "off"
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
        self._momentum_groups = {}
        self._momentum_groups = configure_topk_for_optimizers(
            self.compressor_state,
            optimizers,
            momentum_correction=self.momentum_correction,
            use_error_feedback=bool(self.config.use_error_feedback),
            start_iter=int(self._hook_kwargs["start_iter"]),
            adaptive_warmup_steps=self.adaptive_warmup_steps,
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
            self._counter.maybe_log(self.lightning_module)
        return output

    def _momentum_off_when_compressed(
        self, optimizer: Any, closure: Callable[[], Any], groups: list[tuple[int, float]]
    ) -> Callable[[], Any]:
        return momentum_off_when_compressed(self.compressor_state, optimizer, closure, groups)

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

    def compression_state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (see the class docstring): plain objects and CPU tensors (weights_only-safe).

        A collective under a running process group with several ranks: call it on every rank.
        """
        return self._compressor.state_dict(self.comm_stats)

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict` (this rank's entry); applied when ``setup`` builds the hook."""
        if self._compressor.load_state_dict(state, world_size=self.world_size, rank=self.global_rank):
            self._counter.restore(state["comm_stats"])


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
