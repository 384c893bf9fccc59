"""Running real training steps outside the fit loop, and undoing them exactly: shared by the tuners and the Autopilot.

:class:`StepRunner` runs the LightningModule's own steps on real batches; :class:`TrainingState` snapshots what such
a step touches, in host memory, and writes it back bit for bit. The fit loop is never entered, so loop progress,
``global_step`` and logged metrics are untouched. See docs/techniques/batch-size.md (What it keeps).
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_accel.core.batch import samples_in_batch

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_accel.core.timing import StageTimer

__all__ = [
    "NullTimer",
    "StepOutcome",
    "StepRunner",
    "TrainingState",
    "missing_attribute_error",
    "reload_train_dataloader",
]


def _clean(name: str) -> str:
    from lightning_accel.core.checkpointing import clean_module_name

    return clean_module_name(name)


#: optimizer param-group keys that choose how the step is computed, not what it computes
_IMPLEMENTATION_FLAGS = ("foreach", "fused")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.detach().to("cpu", copy=True), value.device)
    return copy.deepcopy(value)


def _from_cpu(saved: Any) -> Any:
    if (
        isinstance(saved, tuple)
        and len(saved) == 2
        and isinstance(saved[0], torch.Tensor)
        and isinstance(saved[1], torch.device)
    ):
        return saved[0].to(saved[1], copy=True)
    return copy.deepcopy(saved)


class TrainingState:
    """In-memory snapshot of everything a training step can change, restored bit for bit by :meth:`restore`.

    Parameters, buffers, gradients, optimizer and scheduler state, the precision plugin's scaler, the train/eval
    flags and every RNG, held off the accelerator so that the snapshot takes none of the memory being measured.
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        # keyed by names without wrapper segments, so a module wrapped (activation checkpointing) or unwrapped
        # between snapshot and restore still maps to its saved values
        self.params = {_clean(n): p.detach().to("cpu", copy=True) for n, p in pl_module.named_parameters()}
        self.grads = {
            _clean(n): None if p.grad is None else p.grad.detach().to("cpu", copy=True)
            for n, p in pl_module.named_parameters()
        }
        self.buffers = {_clean(n): b.detach().to("cpu", copy=True) for n, b in pl_module.named_buffers()}
        self.modes = {_clean(n): m.training for n, m in pl_module.named_modules()}
        self.optimizers = []
        for opt in trainer.optimizers:
            state = {p: {k: _to_cpu(v) for k, v in s.items()} for p, s in opt.state.items()}
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self.optimizers.append((opt, state, groups))
        self.schedulers = [
            (cfg.scheduler, copy.deepcopy(cfg.scheduler.state_dict())) for cfg in trainer.lr_scheduler_configs
        ]
        self.precision = copy.deepcopy(trainer.precision_plugin.state_dict())
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.rng = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None,
        }

    def track_loader(self, loader: Any) -> None:
        """Also restore the ``torch.Generator`` objects a dataloader draws its order from (its own, its sampler's,
        its batch sampler's sampler's): a generator kept on the module or datamodule and reused by every
        ``train_dataloader()`` call would otherwise be advanced by the tuners' iterations and change the order."""
        for gen in _loader_generators(loader):
            self.generators.setdefault(id(gen), (gen, gen.get_state()))

    def bytes_on(self, device: torch.device) -> int:
        """Bytes this snapshot holds on ``device`` (its tensors live on the CPU)."""
        if device.type != "cpu":
            return 0
        tensors = [*self.params.values(), *(g for g in self.grads.values() if g is not None), *self.buffers.values()]
        for _, state, _ in self.optimizers:
            for s in state.values():
                tensors += [v[0] for v in s.values() if isinstance(v, tuple) and isinstance(v[0], torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def restore(self) -> None:
        module = self.module
        for n, p in module.named_parameters():
            p.copy_(self.params[_clean(n)])
            g = self.grads[_clean(n)]
            p.grad = None if g is None else g.to(p.device, copy=True)
        for n, b in module.named_buffers():
            b.copy_(self.buffers[_clean(n)])
        for n, m in module.named_modules():
            m.training = self.modes.get(_clean(n), m.training)
        for opt, state, groups in self.optimizers:
            opt.state = defaultdict(dict, {p: {k: _from_cpu(v) for k, v in s.items()} for p, s in state.items()})
            for group, saved in zip(opt.param_groups, groups):
                # the implementation flags are not training state: a change of them (the Autopilot's foreach/fused
                # trial) must survive the restore between its windows
                group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in _IMPLEMENTATION_FLAGS})
        for scheduler, saved in self.schedulers:
            scheduler.load_state_dict(copy.deepcopy(saved))
        self.trainer.precision_plugin.load_state_dict(copy.deepcopy(self.precision))
        for gen, gen_state in self.generators.values():
            gen.set_state(gen_state)
        torch.set_rng_state(self.rng["torch"])
        np.random.set_state(self.rng["numpy"])
        random.setstate(self.rng["python"])
        if self.rng["cuda"] is not None:
            torch.cuda.set_rng_state_all(self.rng["cuda"])


# ------------------------------------------------------------------------------------------------ data plumbing
def _loader_generators(loader: Any) -> list[torch.Generator]:
    from lightning.pytorch.utilities import CombinedLoader

    loaders = CombinedLoader(loader, "max_size_cycle").flattened if not hasattr(loader, "batch_size") else [loader]
    found = []
    for dl in loaders:
        batch_sampler = getattr(dl, "batch_sampler", None)
        for obj in (dl, getattr(dl, "sampler", None), getattr(batch_sampler, "sampler", None)):
            gen = getattr(obj, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not f for f in found):
                found.append(gen)
    return found


def missing_attribute_error(
    trainer: pl.Trainer, pl_module: pl.LightningModule, who: str, name: str, hint: str
) -> ValueError:
    """The error for an attribute that ``lightning_hasattr`` did not find, naming every place it looked."""
    where = ["the LightningModule", "its hparams"]
    if trainer.datamodule is not None:
        where += [f"the datamodule ({type(trainer.datamodule).__name__})", "the datamodule's hparams"]
    return ValueError(
        f"{who}: no `{name}` attribute in {', '.join(where)} (looked in {type(pl_module).__name__}). {hint}"
    )


def reload_train_dataloader(trainer: pl.Trainer) -> None:
    """Make the fit loop rebuild its train dataloader at the start of the next epoch.

    Through :func:`lightning_accel._compat.reset_fit_loop_loader` (a private Lightning attribute).
    """
    from lightning_accel._compat import reset_fit_loop_loader

    reset_fit_loop_loader(trainer)


def iterate_batches(loader: Any) -> Iterator[Any]:
    """Batches of ``loader`` (a DataLoader or a collection of them) as the training step receives them."""
    from lightning.pytorch.utilities import CombinedLoader

    combined = CombinedLoader(loader, "max_size_cycle")
    for batch, _batch_idx, _dataloader_idx in combined:
        yield batch


# ------------------------------------------------------------------------------------------------ the step
class NullTimer:
    """A :class:`~lightning_accel.core.timing.StageTimer` stand-in that times nothing (untimed steps)."""

    def start(self, stage: str, *, host: bool = False) -> None:
        pass

    def stop(self, stage: str) -> None:
        pass


@dataclass
class StepOutcome:
    """What one :meth:`StepRunner.optimizer_step` observed.

    Attributes:
        losses: the loss of every micro-batch that returned one, as ``training_step`` returned it (detached, not
            divided by the accumulation, not scaled; still on the device: reading them is the caller's sync).
        stepped: whether the optimizer step ran (automatic optimization and at least one loss).
        grad: with ``capture``, every gradient before the optimizer step, flattened (float64, CPU; scaled by the
            GradScaler when there is one); ``None`` without gradients or without a step.
        update: with ``capture``, the parameter change of the optimizer step, flattened (float64, CPU).
    """

    losses: list[torch.Tensor] = field(default_factory=list)
    stepped: bool = False
    grad: torch.Tensor | None = None
    update: torch.Tensor | None = None


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, dict):
        return output.get("loss")
    return output


def _flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # a copy: float64 tensors on the CPU would otherwise come back as views of the parameters the step changes
    return [t.detach().to("cpu", torch.float64, copy=True).flatten() for t in tensors]


class StepRunner:
    """Runs the LightningModule's training step outside the fit loop: the one step loop of the tuners, the
    Autopilot's measuring windows and its numerics probe (docs/techniques/batch-size.md, What it keeps).

    A step is the LightningModule's own ``training_step``, the backward through the precision plugin's GradScaler
    when it has one, and the optimizer step (:meth:`optimizer_step`). Under DDP the tuners' steps call the
    LightningModule directly rather than the DDP wrapper: no gradient all-reduce runs, so a rank that runs out of
    memory cannot leave the others waiting in a collective.
    """

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        self.device = trainer.strategy.root_device

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Silence ``self.log`` and route ``manual_backward`` to a plain backward (no collective) while probing."""
        module = self.module
        module.__dict__["log"] = lambda *args, **kwargs: None
        module.__dict__["log_dict"] = lambda *args, **kwargs: None
        module.__dict__["manual_backward"] = lambda loss, *args, **kwargs: loss.backward(*args, **kwargs)
        try:
            yield
        finally:
            for name in ("log", "log_dict", "manual_backward"):
                module.__dict__.pop(name, None)

    def to_device(self, batch: Any) -> Any:
        return self.trainer.strategy.batch_to_device(batch)

    def _no_sync(self, skip: bool) -> Any:
        model = self.trainer.strategy.model
        if skip and self.trainer.world_size > 1 and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    def optimizer_step(
        self,
        micro_batches: Iterable[Any],
        accumulate: int = 1,
        *,
        through_strategy: bool = False,
        timer: StageTimer | NullTimer | None = None,
        capture: bool = False,
    ) -> StepOutcome:
        """One optimizer step of ``accumulate`` micro-batches, in the order of Lightning's automatic optimization
        (``lightning/pytorch/loops/optimization/automatic.py`` and ``plugins/precision/amp.py``): every micro-batch's
        forward and backward, then each optimizer's step through the precision plugin's GradScaler when it has one
        (``scaler.step``, then ``scaler.update``), then ``zero_grad(set_to_none=True)``.

        Args:
            micro_batches: the micro-batches, already on the device; read one at a time, so a generator may time
                its own data wait and host-to-device copy between the forwards.
            accumulate: how many micro-batches ``micro_batches`` yields; each loss is divided by it.
            through_strategy: forward through ``strategy.training_step`` (under DDP the wrapper: the backward
                all-reduces the gradients as in training, with ``no_sync`` for all but the last micro-batch).
                Otherwise the LightningModule's own ``training_step`` inside the precision plugin's
                ``train_step_context()``: no collective, so a rank that fails cannot leave the others waiting.
            timer: marks the ``forward``, ``backward`` and ``optimizer`` stages.
            capture: also keep the gradients before the optimizer step and the parameter change it made.

        Under manual optimization only ``training_step`` runs (it steps its optimizers itself). A micro-batch whose
        loss is ``None`` is skipped; when none had a loss no optimizer step runs (Lightning skips it too; the
        scaler's ``step`` would raise without the inf checks of a backward). Unlike the fit loop the gradients are
        zeroed after the step rather than before the first backward, and no callback hook, gradient clipping or
        scheduler step runs.
        """
        trainer, module = self.trainer, self.module
        strategy, precision = trainer.strategy, trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)
        t = timer if timer is not None else NullTimer()
        outcome = StepOutcome()
        for i, batch in enumerate(micro_batches):
            with self._no_sync(through_strategy and i < accumulate - 1):
                t.start("forward")
                if through_strategy:
                    out = strategy.training_step(batch, i)
                else:
                    with precision.train_step_context():
                        out = module.training_step(batch, i)
                t.stop("forward")
                if not module.automatic_optimization:
                    continue
                loss = _loss_of(out)
                if loss is None:  # the step asked to skip this batch
                    continue
                outcome.losses.append(loss.detach())
                t.start("backward")
                if accumulate > 1:
                    loss = loss / accumulate
                (scaler.scale(loss) if scaler is not None else loss).backward()
                t.stop("backward")
        if not module.automatic_optimization or not outcome.losses:
            return outcome
        params = [p for p in module.parameters() if p.requires_grad] if capture else []
        before = _flat(params)
        if capture:
            grads = _flat([p.grad for p in params if p.grad is not None])
            outcome.grad = torch.cat(grads) if grads else None
        t.start("optimizer")
        for opt in trainer.optimizers:
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
        if scaler is not None:
            scaler.update()
        for opt in trainer.optimizers:
            opt.zero_grad(set_to_none=True)
        t.stop("optimizer")
        outcome.stepped = True
        if params:
            outcome.update = torch.cat([a - b for a, b in zip(_flat(params), before)])
        return outcome

    def step(self, batch: Any) -> None:
        """One training step on a batch already on the device (see :meth:`optimizer_step`)."""
        self.optimizer_step((batch,))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_steps(
        self, batches: Iterator[Any], steps: int, meter: Any = None, expect_size: int | None = None
    ) -> tuple[int | None, float | None]:
        """Run ``steps`` steps on batches from ``batches``; returns ``(peak_bytes, median seconds per step)``.

        The first step is warm-up for timing (allocator, kernels, optimizer state creation); with one step only,
        its time is returned. Peak memory is the maximum over all steps, measured by ``meter`` when given.
        Data loading and the host-to-device copy are not timed.
        """
        peaks: list[int] = []
        times: list[float] = []
        for _ in range(steps):
            batch = next(batches)
            if expect_size is not None:
                got = samples_in_batch(batch)
                if got != expect_size:
                    raise ValueError(
                        f"train_dataloader() returned a batch of {got} samples after the batch size was "
                        f"set to {expect_size}: it must build its DataLoader from that attribute "
                        f"(e.g. DataLoader(..., batch_size=self.batch_size))"
                    )
            batch = self.to_device(batch)
            if meter is not None:
                meter.reset()
            self.sync()
            t0 = time.perf_counter()
            self.step(batch)
            self.sync()
            times.append(time.perf_counter() - t0)
            if meter is not None:
                peaks.append(meter.peak_bytes())
            del batch
        timed = times[1:] or times
        return (max(peaks) if peaks else None), (statistics.median(timed) if timed else None)
