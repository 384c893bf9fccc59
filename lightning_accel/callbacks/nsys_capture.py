"""NsysCapture: an nsys capture range between two training steps, on chosen ranks (``cudaProfilerStart/Stop``).

Run the script under ``nsys`` with the capture range tied to the CUDA profiler API, and give the doctor its NVTX
stage ranges, so the timeline holds only the chosen steps with the stage that launched every kernel::

    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx -o timeline python train.py

    trainer = Trainer(callbacks=[BottleneckDoctor(nvtx=True), NsysCapture(start_step=20, stop_step=25)])

NeMo's ``NsysCallback`` is the precedent (same two calls, same choice of ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_accel._checks import check_int, is_int
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NsysCapture"]


class NsysCapture(Callback):
    """Calls ``cudaProfilerStart`` before optimizer step ``start_step`` and ``cudaProfilerStop`` after step
    ``stop_step - 1`` (``trainer.global_step`` numbering; with gradient accumulation the range spans every
    micro-batch of those steps), on the ranks in ``ranks``.

    Without CUDA there is nothing to capture: the callback warns once and does nothing. The range is closed at the
    end of training or on an exception if ``stop_step`` was not reached (calls stay balanced). It logs nothing.

    Args:
        start_step: first optimizer step captured (>= 0); leave a few for warm-up (compilation, allocator).
        stop_step: first step no longer captured (> ``start_step``).
        ranks: global ranks that capture (default rank 0 only; ``None`` = every rank).
        profiler: object with ``start()`` / ``stop()`` (default ``torch.cuda.profiler``; tests pass a mock).
    """

    def __init__(
        self, *, start_step: int = 10, stop_step: int = 15, ranks: Sequence[int] | None = (0,), profiler: Any = None
    ) -> None:
        check_int("NsysCapture", "start_step", start_step, minimum=0, example=10, unit="optimizer steps")
        if not is_int(stop_step) or stop_step <= start_step:
            raise ValueError(
                f"NsysCapture(stop_step={stop_step!r}): use a step after start_step={start_step}, e.g. {start_step + 5}"
            )
        if ranks is not None:
            if isinstance(ranks, (str, bytes)) or not all(is_int(r) and r >= 0 for r in ranks):
                raise ValueError(
                    f"NsysCapture(ranks={ranks!r}): give global ranks, e.g. (0,) or (0, 8), or None for every rank"
                )
            ranks = tuple(ranks)
        self.start_step = start_step
        self.stop_step = stop_step
        self.ranks = ranks
        self._profiler = profiler
        self._enabled = False
        self._capturing = False
        #: (start global step, stop global step) of the captures taken on this rank
        self.captured: list[tuple[int, int]] = []
        self._started_at = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._enabled = stage == "fit" and (self.ranks is None or trainer.global_rank in self.ranks)
        if self._enabled and self._profiler is None:
            if not torch.cuda.is_available():
                rank_zero_warn("NsysCapture: no CUDA device, nothing for nsys to capture; the callback does nothing")
                self._enabled = False
            else:
                self._profiler = torch.cuda.profiler

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._enabled and not self._capturing and self.start_step <= step < self.stop_step and not self.captured:
            self._profiler.start()
            self._capturing, self._started_at = True, step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._capturing and trainer.global_step >= self.stop_step:
            self._stop(trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._capturing:
            self._stop(trainer.global_step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._capturing:
            self._stop(trainer.global_step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)

    def _stop(self, step: int) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the captured steps' kernels belong to the capture
        self._profiler.stop()
        self._capturing = False
        self.captured.append((self._started_at, step))
