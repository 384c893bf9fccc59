"""Convolution weights to ``channels_last`` (:class:`ChannelsLast`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.callbacks.autopilot.fixes.base import Intervention
from lightning_accel.core.compute_causes import nchw_convolutions

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["ChannelsLast"]


class ChannelsLast(Intervention):
    """The 2-D convolutions' weights to ``channels_last`` (NHWC), as ``model.to(memory_format=torch.channels_last)``
    does for them: on tensor cores, half-precision convolutions run NHWC kernels, and an NCHW weight costs a
    transpose around each call. The inputs may stay NCHW (the first convolution converts them).

    Offered on CUDA only (a CPU's convolutions gain little and it is not what the finding measures), and in one
    process only: DDP's gradient buckets take the parameters' strides when the model is wrapped, so under DDP the
    conversion belongs before ``trainer.fit`` (the plan's Python line). The undo returns exactly the tensors it
    converted to the default format; weights already in ``channels_last`` are not touched either way."""

    name = "channels_last"
    # the same convolution in another layout can sum in another order
    kind = "reorder"
    knobs = ("memory_format",)

    def unavailable(self, run: Run) -> str | None:
        if run.device.type != "cuda":
            return f"channels_last pays on a GPU's tensor cores; this run is on {run.device.type}"
        if run.trainer.world_size > 1:
            return (
                "under DDP convert before the fit (model.to(memory_format=torch.channels_last)): the gradient "
                "buckets take the parameters' strides when DDP wraps the model"
            )
        if not (self.params.get("modules") or nchw_convolutions(run.module)):
            return "no 2-D convolution with an NCHW weight in the model"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        modules = dict(run.module.named_modules())
        names = list(self.params.get("modules") or nchw_convolutions(run.module))
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(
                f"ChannelsLast(modules={missing!r}): no such module in the model; omit modules= to convert every NCHW convolution"
            )
        self.params = {"modules": names}
        for name in names:
            for tensor in (*modules[name].parameters(recurse=False), *modules[name].buffers(recurse=False)):
                if tensor.dim() != 4 or tensor.is_contiguous(memory_format=torch.channels_last):
                    continue
                # .data keeps the Parameter object, so the optimizer's references and state stay valid
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
                undo.push(lambda t=tensor: setattr(t, "data", t.data.contiguous()))

    def describe(self, run: Run) -> str:
        n = len(self.params.get("modules") or ())
        return f"channels_last ({n} convolution{'s' if n != 1 else ''})" if n else "channels_last"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return [], ["model = model.to(memory_format=torch.channels_last)  # before trainer.fit"]
