"""DevicePrefetcher: overlap loading and the host→device copy of the next batch with the current step.

A thin callback over :class:`~lightning_accel.core.prefetch.PrefetchingLoader`: it wraps the strategy's
``process_dataloader`` for the length of a run, so it sees every train loader after Lightning's sampler injection.
Why that hook, and what Lightning sees of a wrapped loader: ``docs/techniques/prefetch.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_accel._checks import check_int
from lightning_accel.core.prefetch import PrefetchingLoader
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DevicePrefetcher"]

_MISSING = object()
_STAGES = {
    "train": (RunningStage.TRAINING,),
    "val": (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING),
    "test": (RunningStage.TESTING,),
    "predict": (RunningStage.PREDICTING,),
}


class DevicePrefetcher(Callback):
    """Fetches the next batches in a background thread and, on CUDA, copies them to the device on a side stream.

    ``Trainer(callbacks=[DevicePrefetcher()])``. On CPU it hides a slow ``collate_fn``/decode in the training
    process (useful with ``num_workers=0``) behind the step. On a CUDA device it also pins each host batch (unless
    the loader pinned it) and copies it with ``non_blocking=True`` on a side stream while the previous step
    computes; the compute stream waits on an event, not the host. Tensors already on the device (DALI) and
    non-tensor leaves pass through. See :mod:`lightning_accel.core.prefetch` for the exact guarantees.

    Args:
        depth: batches fetched ahead per loader (each costs its memory, on the device for CUDA).
        pin_memory: pin host tensors before the CUDA copy (default on; ignored on CPU).
        loaders: which loaders to wrap: any of ``"train"``, ``"val"``, ``"test"``, ``"predict"``. Default: train
            only, where the step time matters and the loop runs longest.

    Logged keys: none.
    """

    def __init__(self, *, depth: int = 2, pin_memory: bool | None = None, loaders: Iterable[str] = ("train",)) -> None:
        check_int("DevicePrefetcher", "depth", depth, unit="batches", example=2)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"DevicePrefetcher(pin_memory={pin_memory!r}): use True, False or None (default: True)")
        if isinstance(loaders, str):
            loaders = (loaders,)
        loaders = tuple(loaders)
        unknown = [name for name in loaders if name not in _STAGES]
        if unknown or not loaders:
            raise ValueError(
                f"DevicePrefetcher(loaders={loaders!r}): choose one or more of {sorted(_STAGES)}, "
                "e.g. loaders=('train',)"
            )
        self.depth = depth
        self.pin_memory = pin_memory
        self.loaders = loaders
        self._stages = {stage for name in loaders for stage in _STAGES[name]}
        self._strategy: Any = None
        self._previous: Any = _MISSING
        self._wrapped: list[PrefetchingLoader] = []

    @property
    def wrapped_loaders(self) -> list[PrefetchingLoader]:
        """The loaders wrapped in the current (or last) run."""
        return list(self._wrapped)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if self._strategy is strategy:
            return
        self._unpatch()
        device = strategy.root_device
        if device.type not in ("cpu", "cuda"):  # XLA/MPS/...: their own loaders or no async copy
            return
        original = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if trainer.state.stage not in self._stages or isinstance(dataloader, PrefetchingLoader):
                return dataloader
            wrapped = PrefetchingLoader(
                dataloader,
                depth=self.depth,
                device=device if device.type == "cuda" else None,
                pin_memory=self.pin_memory,
            )
            self._wrapped.append(wrapped)
            return wrapped

        # an instance attribute shadows the class's method; teardown puts back what was there before
        self._previous = vars(strategy).get("process_dataloader", _MISSING)
        strategy.process_dataloader = process_dataloader
        self._strategy = strategy
        self._wrapped = []

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        for loader in self._wrapped:
            loader.close()
        self._unpatch()

    def _unpatch(self) -> None:
        strategy, self._strategy = self._strategy, None
        if strategy is None:
            return
        if self._previous is _MISSING:
            vars(strategy).pop("process_dataloader", None)
        else:
            strategy.process_dataloader = self._previous
        self._previous = _MISSING
