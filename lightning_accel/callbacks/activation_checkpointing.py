"""ActivationCheckpointing: recompute chosen submodules in backward instead of storing their activations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._checks import check_int
from lightning_accel.core.checkpointing import (
    CHECKPOINT_PREFIX,
    apply_activation_checkpointing,
    disable_kv_cache,
    remove_activation_checkpointing,
    saved_activation_bytes,
)
from lightning_accel.core.flops import FlopCounter
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

_compat.require_versions("ActivationCheckpointing")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(Callback):
    """Wraps chosen submodules with non-reentrant ``torch.utils.checkpoint`` when ``fit`` sets up.

    The wrapped modules keep only their inputs during forward and run their forward again in backward: activation
    memory falls by what they would have stored, compute rises by at most one extra forward of them (the
    method's "roughly +20 % compute for a large cut in activation memory"; backward is about twice the
    forward, so checkpointing everything costs at most a third more FLOPs). Wrapping uses torch's
    ``CheckpointWrapper`` (``CheckpointImpl.NO_REENTRANT``), the same one FSDP and torchtitan use: gradients are
    identical to the plain model, RNG state (dropout) is replayed, it composes with autocast
    (``AutoMixedPrecision``), DDP and ``TorchCompile``. ``state_dict`` and checkpoint keys are unchanged; parameter
    *names* gain a ``._checkpoint_wrapped_module`` segment during ``fit`` (the collection's callbacks and
    ``fp32_modules`` patterns match names without it). The wrappers are removed again when ``fit`` ends. A
    Hugging Face model inside gets ``config.use_cache = False`` for the fit (restored after): a recomputed decoder
    forward would append to the key/value cache a second time, as Hugging Face's own gradient checkpointing knows.

    Targets: module types (``Block``) and/or ``fnmatch`` patterns over qualified names (``"model.blocks.*"``). A
    target that matches nothing raises ``ValueError`` listing the module types present.

    Measured once, on training batch ``measure_batch`` (default 1: batch 0 is where ``MFUMonitor`` counts FLOPs),
    unless ``TorchCompile`` is active (a measuring hook inside a compiled region would force recompiles):

    * memory saved: each wrapped module is run once more (RNG and buffers restored, graph dropped) under
      ``saved_tensors_hooks``; the distinct storages it would save for backward, minus its parameters and inputs,
      are what checkpointing no longer keeps. Backward rematerialises one module at a time, so the peak falls by
      the sum over modules minus the largest one; that is the figure reported. Per device, per micro-batch.
    * compute added: the FLOPs the wrapped modules recompute in backward, counted by ``FlopCounterMode`` (less
      than their forward: non-reentrant checkpointing stops recomputing once the tensors backward needs are
      back, so e.g. a block's last matmul is not redone), as a fraction of the step's FLOPs without
      checkpointing (measured on the same batch).

    ============================  ========  =================================================================
    key (logged once) / attr      unit      meaning (per device, one micro-batch)
    ============================  ========  =================================================================
    ``ckpt/activation_mb_saved``  MB        activation memory the wrapped modules no longer keep (1 MB = 1e6 B)
    ``ckpt/compute_added``        fraction  recomputed FLOPs ÷ FLOPs of forward + backward without checkpointing
    ``activation_bytes_saved``    bytes     attribute: the same memory figure (``None`` until measured)
    ``recompute_flops``           FLOPs     attribute: FLOPs recomputed per micro-batch (``None`` until measured)
    ``compute_added``             fraction  attribute (``None`` until measured)
    ``wrapped_names``             names     attribute: the wrapped modules
    ============================  ========  =================================================================

    Args:
        modules: module types and/or name patterns to checkpoint.
        measure: measure memory saved and compute added (costs one extra forward of the wrapped modules, once).
        measure_batch: the training batch (index within ``fit``) to measure on.
    """

    def __init__(self, *, modules: Sequence[type | str], measure: bool = True, measure_batch: int = 1) -> None:
        if isinstance(modules, (str, type)):
            modules = [modules]
        modules = list(modules)
        if not modules or any(
            not (isinstance(m, str) or (isinstance(m, type) and issubclass(m, nn.Module))) for m in modules
        ):
            raise ValueError(
                f"ActivationCheckpointing(modules={modules!r}): give module types and/or name "
                "patterns, e.g. modules=[Block] or modules=['model.blocks.*']"
            )
        check_int("ActivationCheckpointing", "measure_batch", measure_batch, minimum=0, unit="a batch index")
        self.modules = modules
        self.measure = measure
        self.measure_batch = measure_batch
        self.wrapped_names: list[str] = []
        self.activation_bytes_saved: int | None = None
        self.recompute_flops: int | None = None
        self.compute_added: float | None = None
        self._model: nn.Module | None = None
        self._hooks: list[Any] = []
        self._batches = 0
        self._cache_configs: list[Any] = []  # Hugging Face configs whose use_cache is off during fit
        self._measuring = False
        self._step_counter = FlopCounter()
        self._recompute_counter = FlopCounter()
        self._bytes: list[int] = []  # per wrapped module call: activation bytes it would have kept
        self._flops = 0  # FLOPs recomputed in backward
        self._extra_flops = 0  # FLOPs of the measuring forwards

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.wrapped_names = apply_activation_checkpointing(pl_module, self.modules)
        self._model = pl_module
        self._batches = 0
        self._cache_configs = disable_kv_cache(pl_module)
        rank_zero_info(
            f"ActivationCheckpointing: recomputing {len(self.wrapped_names)} modules in backward "
            f"({', '.join(self.wrapped_names[:6])}{', ...' if len(self.wrapped_names) > 6 else ''})"
            + (
                "; use_cache=False on the Hugging Face model during fit (a recomputed forward would "
                "append to the key/value cache again)"
                if self._cache_configs
                else ""
            )
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.measure or self._batches != self.measure_batch or self.recompute_flops is not None:
            return
        if any(getattr(cb, "compiled_names", None) for cb in trainer.callbacks):
            rank_zero_info("ActivationCheckpointing: not measuring memory/compute while TorchCompile is active")
            return
        self._measuring, self._bytes, self._extra_flops, self._flops = True, [], 0, 0
        for _, module in pl_module.named_modules():
            if hasattr(module, CHECKPOINT_PREFIX):
                inner = getattr(module, CHECKPOINT_PREFIX)
                self._hooks.append(module.register_forward_pre_hook(self._measure_memory, with_kwargs=True))
                self._hooks.append(inner.register_forward_pre_hook(self._recompute_start))
                self._hooks.append(inner.register_forward_hook(self._recompute_end, always_call=True))
        self._step_counter.start()

    def _measure_memory(self, wrapper: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or _in_backward():
            return
        counter = FlopCounter()
        counter.start()
        try:
            self._bytes.append(saved_activation_bytes(getattr(wrapper, CHECKPOINT_PREFIX), args, kwargs))
        finally:
            self._extra_flops += counter.stop()

    def _recompute_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if _in_backward() and not self._recompute_counter.running:
            self._recompute_counter.start()

    def _recompute_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _in_backward() and self._recompute_counter.running:
            # recomputation may stop early (torch.utils.checkpoint's early stop): this hook still runs
            self._flops += self._recompute_counter.stop()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        if not self._measuring:
            return
        self._finish_measuring()
        if self.compute_added is not None and self.activation_bytes_saved is not None:
            pl_module.log(
                "ckpt/activation_mb_saved",
                self.activation_bytes_saved / 1e6,
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
            pl_module.log("ckpt/compute_added", self.compute_added, on_step=True, on_epoch=False, batch_size=1)
            rank_zero_info(
                f"ActivationCheckpointing: {self.activation_bytes_saved / 1e6:,.1f} MB of activations "
                f"saved per micro-batch for +{self.compute_added:.1%} compute"
            )

    def _finish_measuring(self) -> None:
        self._measuring = False
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._recompute_counter.running:
            self._flops += self._recompute_counter.stop()
        total = self._step_counter.stop() if self._step_counter.running else 0
        # the step counted: forward + backward + recomputation + the measuring forwards
        base = total - self._flops - self._extra_flops
        # during backward one module's activations are rematerialised at a time: the peak falls by all but the
        # largest of them
        self.activation_bytes_saved = sum(self._bytes) - max(self._bytes, default=0)
        self.recompute_flops = self._flops
        self.compute_added = self._flops / base if base > 0 else None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._measuring:
            self._finish_measuring()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if stage == "fit" and self._model is not None:
            remove_activation_checkpointing(self._model, self.wrapped_names)
            for config in self._cache_configs:
                config.use_cache = True
            self._cache_configs = []
            self._model = None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (where checkpointed modules recompute)."""
    return _compat.in_backward()
