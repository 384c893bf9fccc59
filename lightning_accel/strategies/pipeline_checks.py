"""What a pipeline-parallel run refuses, each with the value and the fix: arguments, Trainer settings and optimizers
it cannot honour, batches that do not divide, and a first-batch loss that is not the module's own.
See docs/techniques/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_accel.core.pipeline_plan import SCHEDULES
from lightning_accel.strategies.pipeline_state import to_cpu

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "FirstBatchCheck",
    "check_arguments",
    "check_divides",
    "check_optimizers",
    "check_trainer",
    "reference_precision",
]

DP_COMPRESSIONS = ("fp16", "bf16", "topk", "qsgd")
#: the first-batch check's tolerance on ``|pipeline - reference| / max(1, |reference|)``, by the dtype both losses
#: are computed in: fp32 (and fp64) differ only by the order of the micro-batches' sums; a half-precision loss is
#: rounded to its 8 (bf16) or 11 (fp16) significant bits and the pipeline and its reference (on the host) may run
#: different kernels, so a few units of that rounding (bf16: 2^-8 = 0.4 %, fp16: 2^-11) are allowed
_LOSS_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def check_arguments(
    *,
    schedule: str,
    microbatches: Any,
    stages: Any,
    data_parallel_size: Any,
    pipeline_size: Any,
    compression: Any,
    density: Any,
    levels: Any,
    balance: Any,
    balance_shape: Any,
) -> None:
    """Refuse ``PipelineStrategy``'s arguments that no run can use."""
    if schedule not in SCHEDULES:
        raise ValueError(f"PipelineStrategy(schedule={schedule!r}): use one of {', '.join(SCHEDULES)}")
    for name, value in (("microbatches", microbatches), ("stages", stages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"PipelineStrategy({name}={value!r}) must be an integer >= 1 (or None: automatic)")
    for name, value in (("data_parallel_size", data_parallel_size), ("pipeline_size", pipeline_size)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"PipelineStrategy({name}={value!r}) must be 'auto' or an integer >= 1")
    if compression is not None and compression not in DP_COMPRESSIONS:
        raise ValueError(
            f"PipelineStrategy(compression={compression!r}): use one of "
            f"{', '.join(map(repr, DP_COMPRESSIONS))} or None (plain all-reduce); PowerSGD is not "
            "offered in the data-parallel dimension"
        )
    if compression == "topk" and (
        isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1
    ):
        raise ValueError(f"PipelineStrategy(density={density!r}) must be a fraction in (0, 1], e.g. 0.01")
    if compression == "qsgd" and (isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127):
        raise ValueError(f"PipelineStrategy(levels={levels!r}) must be an integer in 1..127 (7 = 4 bits per entry)")
    if balance not in ("parameters", "time"):
        raise ValueError(f"PipelineStrategy(balance={balance!r}): use 'parameters' (the default) or 'time'")
    if balance_shape is not None and (
        not isinstance(balance_shape, (tuple, list))
        or len(balance_shape) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in balance_shape)
    ):
        raise ValueError(
            f"PipelineStrategy(balance_shape={balance_shape!r}) must be (batch, sequence length), two integers >= 1 "
            "(or None, the default: one micro-batch of the module's own first batch)"
        )


def check_trainer(trainer: pl.Trainer, precision_plugin: Any) -> None:
    """The Trainer settings a pipeline cannot honour (checked before the process group starts)."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "pipeline: precision with a gradient scaler (16-mixed) is not supported: the scaler "
            "would have to see the loss inside the schedule; use precision='bf16-mixed' or 32"
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm != "value":
        raise ValueError(
            f"pipeline: gradient_clip_val={trainer.gradient_clip_val} clips by the norm, which each "
            "stage would compute over its own parameters only; use gradient_clip_algorithm='value'"
        )


def check_optimizers(optimizers: list[Any]) -> None:
    for opt in optimizers:
        if isinstance(opt, torch.optim.LBFGS):
            raise ValueError(
                "pipeline: LBFGS re-evaluates the loss inside its step and searches lines on "
                "each stage's parameters separately; use a first-order optimizer"
            )


def check_divides(inputs: torch.Tensor, microbatches: int) -> None:
    if inputs.shape[0] % microbatches:
        raise ValueError(
            f"pipeline: a batch of {inputs.shape[0]} does not divide into microbatches="
            f"{microbatches}; use a batch size that is a multiple of {microbatches} "
            "(drop_last=True for a short last batch), or other microbatches"
        )


class FirstBatchCheck:
    """The first batch: the module's own ``training_step`` on the whole network against the pipeline's loss; whether
    it ran (:attr:`done`) and the numbers compared (:attr:`numbers`)."""

    def __init__(self) -> None:
        self.done = False
        #: the numbers compared: pipeline, reference, the dtype compared in and its tolerance
        self.numbers: dict[str, Any] | None = None

    def run(
        self,
        module: pl.LightningModule,
        args: tuple,
        kwargs: dict,
        *,
        compare: bool,
        pipeline_loss: Callable[[], float],
        whole: Callable[[], AbstractContextManager[Any]],
        device: torch.device,
        precision_plugin: Any,
    ) -> None:
        """Both losses in eval mode: ``pipeline_loss()`` (a schedule step, which also sets up the schedule), then, to
        ``compare``, ``training_step`` on the network with ``whole()``'s modules back, once on the host; refuse the
        run if they differ."""
        from lightning_accel._compat import suspended_dispatch_modes

        was = module.training
        module.eval()
        try:
            # not model FLOPs of the step: a FLOP counter around it (MFUMonitor's first batch) does not see the check
            with suspended_dispatch_modes():
                # a whole schedule step (its backward sets up the schedule's buffers, which must not happen under a
                # FLOP counter's module tracking: torch 2.13 refuses that autograd.grad), its gradients discarded
                piped = pipeline_loss()
                if compare:
                    own, dtype = self._reference(module, args, kwargs, whole, device, precision_plugin)
                    self.compare(module, piped, own, dtype)
        finally:
            module.train(was)
        self.done = True

    def _reference(
        self,
        module: pl.LightningModule,
        args: tuple,
        kwargs: dict,
        whole: Callable[[], AbstractContextManager[Any]],
        device: torch.device,
        precision_plugin: Any,
    ) -> tuple[float, torch.dtype]:
        """The module's own ``training_step`` loss on the whole network, and the dtype it was computed in."""
        try:
            with whole():
                try:
                    if device.type != "cpu":  # the whole network does not fit the device: it runs once on the host
                        module.to("cpu")
                    cpu_args = to_cpu((args, kwargs)) if device.type != "cpu" else (args, kwargs)
                    # the check is not a step: what training_step logs is not logged (Lightning refuses it here too)
                    module.log, module.log_dict = _no_log, _no_log  # type: ignore[method-assign]
                    # like with like: the reference computes in the pipeline's precision (its autocast, on the host)
                    autocast, dtype = reference_precision(precision_plugin, module)
                    with torch.no_grad(), autocast:
                        out = module.training_step(*cpu_args[0], **cpu_args[1])
                finally:
                    del module.log, module.log_dict
        finally:
            if device.type != "cpu":  # back on the device without the other stages' modules
                module.to(device)
        own = out["loss"] if isinstance(out, dict) else out
        if not isinstance(own, torch.Tensor):
            raise ValueError(
                "pipeline: training_step returned no loss tensor on the first batch; the pipeline's "
                "loss cannot be checked against it (PipelineStrategy(check_loss=False) skips the check)"
            )
        return float(own), dtype

    def compare(self, module: nn.Module, piped: float, own: float, dtype: torch.dtype) -> None:
        """Refuse the run unless the pipeline's first-batch loss ``piped`` is the module's own ``own``, both
        computed in ``dtype``, within that dtype's tolerance (:data:`_LOSS_RTOL`); the numbers go to
        :attr:`numbers`."""
        rtol = _LOSS_RTOL.get(dtype, _LOSS_RTOL[torch.float32])
        self.numbers = {"pipeline": piped, "reference": own, "dtype": str(dtype), "rtol": rtol}
        if not abs(own - piped) <= rtol * max(1.0, abs(own)):
            hooks = (
                "your pipeline_loss / pipeline_batch"
                if hasattr(module, "pipeline_loss")
                else (
                    "the token cross-entropy of the network's logits against the targets (batch (inputs, targets), or "
                    "ids shifted by one)"
                )
            )
            raise ValueError(
                f"pipeline: on the first batch the pipeline's loss ({piped:.6g}: {hooks}) differs from "
                f"{type(module).__name__}.training_step's ({own:.6g}) by more than {rtol:g} (relative, both "
                f"computed in {str(dtype).replace('torch.', '')}); define "
                "`pipeline_loss(self, logits, targets)` and/or `pipeline_batch(self, batch)` on the "
                "LightningModule so that they compute your loss"
            )


def reference_precision(precision_plugin: Any, module: nn.Module) -> tuple[Any, torch.dtype]:
    """The autocast the first-batch reference runs in (always on the host) and the dtype the comparison is in:
    under mixed precision (``bf16-mixed``, ``16-mixed``) an autocast of the pipeline's own dtype, so both losses
    come from the same arithmetic; otherwise the parameters' dtype (``32-true``, ``bf16-true``) and no autocast
    beyond what is already active."""
    from contextlib import nullcontext

    from lightning.pytorch.plugins.precision import MixedPrecision

    if isinstance(precision_plugin, MixedPrecision):
        dtype = torch.bfloat16 if precision_plugin.precision == "bf16-mixed" else torch.float16
        return torch.autocast("cpu", dtype=dtype), dtype
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return nullcontext(), dtype


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
