"""The Autopilot's measuring protocol: real training steps on the user's model, optimizer and data, outside the fit
loop, timed stage by stage with the doctor's own :class:`~lightning_accel.core.timing.StageTimer` and split with
:func:`~lightning_accel.core.breakdown.split_seconds`, then undone (:class:`TrainingState`).

A window is ``warmup_steps`` untimed optimizer steps (worker start-up, allocator, compilation) then ``steps``
timed ones; each optimizer step runs ``accumulate`` micro-batches as the fit loop would: the data wait, the
host→device copy (``strategy.batch_to_device``), the forward (``strategy.training_step``: under DDP through the
DDP wrapper, so the gradient all-reduce runs in backward as in training; ``no_sync`` for all but the last
micro-batch), the backward (through the precision plugin's GradScaler when it has one) and the optimizer step.
Lightning's callback hooks do not run, so other callbacks (the doctor, MFUMonitor) see none of these steps.
A step whose micro-batches crossed the end of the loader (a new epoch: new workers, a new shuffle) is dropped
from the window (Zeus does the same).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.callbacks._fit.step_runner import NullTimer, StepRunner, TrainingState, iterate_batches
from lightning_accel.core.autopilot import ProbeResult, batch_digest
from lightning_accel.core.batch import map_tensors, samples_in_batch
from lightning_accel.core.breakdown import MEASURED_STAGES, split_seconds
from lightning_accel.core.timing import StageTimer

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource

__all__ = ["RunConfig", "TrialRunner", "Window", "concat_batches"]


@dataclass
class RunConfig:
    """The settings a trial runs with that are not held by the loader source or the model itself."""

    accumulate: int = 1
    prefetch: bool = False
    prefetch_depth: int = 2


@dataclass
class Window:
    """One measured window on this rank."""

    samples: int
    seconds: float
    steps: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    warmup_seconds: float = 0.0
    #: micro-batches per optimizer step (``accumulate_grad_batches``) when it was measured
    micro_batches: int = 1

    @property
    def samples_per_sec(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.steps if self.steps else math.inf

    def shares(self) -> dict[str, float]:
        split = split_seconds(self.seconds, self.stage_seconds)
        total = sum(split.values()) or 1.0
        return {k: v / total for k, v in split.items()}


@dataclass
class _Tally:
    """What one optimizer step's micro-batches held: samples, and whether one began a new pass over the loader."""

    samples: int = 0
    crossed: bool = False


def concat_batches(batches: list[Any]) -> Any:
    """Micro-batches joined along the batch dimension (tensors, tuples, lists, dicts; other leaves from the first)."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches, dim=0) if first.ndim > 0 else first
    if isinstance(first, dict):
        return {k: concat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        joined = [concat_batches([b[i] for b in batches]) for i in range(len(first))]
        return type(first)(joined) if not hasattr(first, "_fields") else type(first)(*joined)
    return first


class _StageMarks:
    """A stage timer's interface that marks forward and backward in an attribution window (and times nothing)."""

    def __init__(self, window: Any) -> None:
        self.window = window

    def start(self, stage: str, *, host: bool = False) -> None:
        if stage in ("forward", "backward"):
            self.window.stage(stage)

    def stop(self, stage: str) -> None:
        if stage in ("forward", "backward"):
            self.window.stage(None)


class TrialRunner:
    """Runs measuring windows and numerics probes for the Autopilot (see the module docstring)."""

    def __init__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        source: TrainLoaderSource,
        config: RunConfig,
        state: TrainingState,
    ) -> None:
        self.trainer, self.module = trainer, pl_module
        self.source, self.config, self.state = source, config, state
        self.device = trainer.strategy.root_device
        self._runner = StepRunner(trainer, pl_module)
        self._prefetching: list[Any] = []  # PrefetchingLoaders of the current window, closed when it ends

    # ------------------------------------------------------------------ data
    def loader(self) -> Any:
        """The train loader as the current configuration builds it (prefetching wrapper included)."""
        from lightning_accel.core.prefetch import PrefetchingLoader

        loader = self.source.build()
        self.state.track_loader(loader)
        if self.config.prefetch:
            wrapped = PrefetchingLoader(
                loader, depth=self.config.prefetch_depth, device=self.device if self.device.type == "cuda" else None
            )
            self._prefetching.append(wrapped)
            return wrapped
        return loader

    def _close(self, batches: Iterator[Any] | None) -> None:
        """End a window's iteration: the batch generator, then every prefetch thread it started."""
        if batches is not None:
            batches.close()  # type: ignore[attr-defined]
        for loader in self._prefetching:
            loader.close()
        self._prefetching.clear()

    def _batches(self) -> Iterator[tuple[Any, bool]]:
        """Endless batches of the current loader; the flag is True for the first batch of each new pass."""
        new_pass = False
        while True:
            got = False
            for batch in iterate_batches(self.loader()):
                got = True
                yield batch, new_pass
                new_pass = False
            if not got:
                raise ValueError("the train dataloader yielded no batches")
            new_pass = True

    # ------------------------------------------------------------------ steps
    def _micro_batches(
        self, batches: Iterator[tuple[Any, bool]], timer: StageTimer | NullTimer, tally: _Tally
    ) -> Iterator[Any]:
        """``accumulate`` micro-batches on the device, timing the data wait and the host→device copy."""
        for _ in range(self.config.accumulate):
            timer.start("data", host=True)
            batch, new_pass = next(batches)
            timer.stop("data")
            tally.samples += samples_in_batch(batch)
            tally.crossed |= new_pass
            timer.start("transfer")
            batch = self.trainer.strategy.batch_to_device(batch)
            timer.stop("transfer")
            yield batch

    def _optimizer_step(self, batches: Iterator[tuple[Any, bool]], timer: StageTimer | None) -> tuple[int, bool]:
        """One optimizer step of ``accumulate`` micro-batches through the strategy (under DDP the gradients are
        all-reduced as in training); returns (samples, crossed an epoch boundary)."""
        t = timer if timer is not None else NullTimer()
        tally = _Tally()
        self._runner.optimizer_step(
            self._micro_batches(batches, t, tally), self.config.accumulate, through_strategy=True, timer=t
        )
        return tally.samples, tally.crossed

    def measure(self, warmup_steps: int, steps: int) -> Window:
        """One window with the current configuration, then the training state restored bit for bit."""
        timer = StageTimer(self.device)
        sync = self._runner.sync
        batches = None
        try:
            with self._runner.quiet():
                self.module.train()
                batches = self._batches()
                t0 = time.perf_counter()
                for _ in range(warmup_steps):
                    self._optimizer_step(batches, None)
                sync()
                warmup = time.perf_counter() - t0
                samples, seconds, kept = 0, 0.0, 0
                totals = dict.fromkeys(MEASURED_STAGES, 0.0)
                attempts = 0
                while kept < steps:
                    attempts += 1
                    if attempts > 2 * steps + 2:
                        raise ValueError(
                            "the train loader is too short for a measuring window: every step crossed "
                            "an epoch boundary; use more data or fewer accumulated batches"
                        )
                    timer.flush()
                    start = time.perf_counter()
                    got, crossed = self._optimizer_step(batches, timer)
                    sync()
                    elapsed = time.perf_counter() - start
                    stage = timer.flush()
                    if crossed:
                        continue
                    kept += 1
                    samples += got
                    seconds += elapsed
                    for k in MEASURED_STAGES:
                        totals[k] += stage.get(k, 0.0)
        finally:
            timer.cancel()
            self._close(batches)
            self.state.restore()
        return Window(samples=samples, seconds=seconds, steps=kept, stage_seconds=totals, warmup_seconds=warmup)

    def attribute(self, steps: int = 2) -> Any:
        """Profile one warm-up and ``steps`` optimizer steps with the current configuration, with the doctor's
        module and stage ranges, and read them into an :class:`~lightning_accel.core.attribution.OpTable`; the
        training state is restored afterwards."""
        from lightning_accel.callbacks.doctor.attribution import AttributionWindow

        window = AttributionWindow(self.module, steps=steps, device_type=self.device.type)
        batches = None
        try:
            with self._runner.quiet():
                self.module.train()
                batches = self._batches()
                window.open()
                marks = _StageMarks(window)
                for _ in range(1 + steps):
                    self._optimizer_step(batches, marks)
                    window.step_end()
                return window.close()
        finally:
            window.abort()
            self._close(batches)
            self.state.restore()

    # ------------------------------------------------------------------ numerics
    def probe_batches(self, steps: int) -> list[list[Any]]:
        """``steps`` optimizer steps' worth of micro-batches from the current loader (kept on the CPU), with the
        RNG restored afterwards so later loaders draw the same order."""
        out: list[list[Any]] = []
        batches = self._batches()
        try:
            for _ in range(steps):
                out.append(
                    [map_tensors(next(batches)[0], lambda t: t.detach().clone()) for _ in range(self.config.accumulate)]
                )
        finally:
            self._close(batches)
            self.state.restore()
        return out

    def probe(self, probe_steps: list[list[Any]], through_strategy: bool = False, digests: bool = True) -> ProbeResult:
        """Loss of each probe step at the starting weights, the gradient and optimizer update of the first, and
        (``digests``) the digests of the batches the current loader delivers in their place; the state is restored
        afterwards.

        The probe steps call the LightningModule directly (no DDP wrapper: no collective), so a rank that fails here
        cannot leave the others waiting — except with ``through_strategy`` (a change of the communication itself),
        where the forward goes through ``strategy.training_step`` and the gradients are all-reduced (``no_sync`` for
        all but the last micro-batch, as in the measuring windows)."""
        result = ProbeResult()
        micro = self.source.current().get("batch_size")
        original = probe_steps[0][0]
        factor = 1
        size = samples_in_batch(original)
        if micro and size and micro != size:
            factor = max(1, round(micro / size))
        try:
            with self._runner.quiet():
                # the batches this configuration's loader delivers (same RNG state as the reference's)
                if digests:
                    delivered = self.probe_batches(len(probe_steps))
                    result.digests = [batch_digest(concat_batches(step)) for step in delivered]
                self.module.train()
                strategy = self.trainer.strategy
                for index, micro_batches in enumerate(probe_steps):
                    grouped = [
                        concat_batches(micro_batches[i : i + factor]) for i in range(0, len(micro_batches), factor)
                    ]
                    step = self._runner.optimizer_step(
                        (strategy.batch_to_device(b) for b in grouped),
                        len(grouped),
                        through_strategy=through_strategy,
                        capture=index == 0,
                    )
                    loss_total = 0.0
                    for loss in step.losses:
                        loss_total += float(loss.float()) / len(grouped)
                    result.losses.append(loss_total)
                    if index == 0:
                        result.grad, result.update = step.grad, step.update
                    self.state.restore()
        finally:
            self.state.restore()
        return result
