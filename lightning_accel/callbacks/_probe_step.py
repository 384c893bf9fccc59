"""Running real training steps outside the fit loop, and undoing them exactly: shared by the tuners.

Lightning's ``BatchSizeFinder`` runs its trials through the fit loop and undoes them by saving a checkpoint to
``default_root_dir`` and restoring it (``lightning/pytorch/tuner/batch_size_scaling.py``): a full write of the model
and optimizer to disk per search, loop progress reset by hand, and no RNG restore. Here a trial is one call of the
LightningModule's own ``training_step`` + backward + optimizer step on a real batch, and :class:`TrainingState`
snapshots everything such a step touches (parameters, buffers, gradients, optimizer and scheduler state, the
precision plugin's scaler, the train/eval flags, every RNG) in memory — off the accelerator, so the snapshot does not
take the memory being measured — and writes it back bit for bit. The fit loop is never entered, so loop progress,
``global_step`` and logged metrics are untouched.

Under DDP the step calls the LightningModule directly rather than the DDP wrapper: no gradient all-reduce runs, so a
rank that runs out of memory cannot leave the others waiting in a collective. The DDP gradient buckets were
allocated when the model was wrapped and are part of the measured memory all the same.
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_accel.core.batch import samples_in_batch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StepRunner", "TrainingState", "missing_attribute_error", "reload_train_dataloader"]


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
    if isinstance(saved, tuple) and len(saved) == 2 and isinstance(saved[0], torch.Tensor) \
            and isinstance(saved[1], torch.device):
        return saved[0].to(saved[1], copy=True)
    return copy.deepcopy(saved)


class TrainingState:
    """In-memory snapshot of everything a training step can change, restored bit for bit by :meth:`restore`."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, pl_module
        # keyed by names without wrapper segments, so a module wrapped (activation checkpointing) or unwrapped
        # between snapshot and restore still maps to its saved values
        self.params = {_clean(n): p.detach().to("cpu", copy=True) for n, p in pl_module.named_parameters()}
        self.grads = {_clean(n): None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                      for n, p in pl_module.named_parameters()}
        self.buffers = {_clean(n): b.detach().to("cpu", copy=True) for n, b in pl_module.named_buffers()}
        self.modes = {_clean(n): m.training for n, m in pl_module.named_modules()}
        self.optimizers = []
        for opt in trainer.optimizers:
            state = {p: {k: _to_cpu(v) for k, v in s.items()} for p, s in opt.state.items()}
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self.optimizers.append((opt, state, groups))
        self.schedulers = [(cfg.scheduler, copy.deepcopy(cfg.scheduler.state_dict()))
                           for cfg in trainer.lr_scheduler_configs]
        self.precision = copy.deepcopy(trainer.precision_plugin.state_dict())
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.rng = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized()
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


def missing_attribute_error(trainer: pl.Trainer, pl_module: pl.LightningModule, who: str, name: str,
                            hint: str) -> ValueError:
    """The error for an attribute that ``lightning_hasattr`` did not find, naming every place it looked."""
    where = ["the LightningModule", "its hparams"]
    if trainer.datamodule is not None:
        where += [f"the datamodule ({type(trainer.datamodule).__name__})", "the datamodule's hparams"]
    return ValueError(f"{who}: no `{name}` attribute in {', '.join(where)} (looked in {type(pl_module).__name__}). "
                      f"{hint}")


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
class StepRunner:
    """Runs the LightningModule's training step outside the fit loop (see the module docstring)."""

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

    def step(self, batch: Any) -> None:
        """One training step on a batch already on the device: forward, backward, optimizer step, zero grad."""
        module = self.module
        with self.trainer.precision_plugin.train_step_context():
            out = module.training_step(batch, 0)
        if not module.automatic_optimization:
            return
        loss = out["loss"] if isinstance(out, dict) else out
        if loss is None:  # the step asked to skip this batch
            return
        loss.backward()
        for opt in self.trainer.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_steps(self, batches: Iterator[Any], steps: int, meter: Any = None, expect_size: int | None = None
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
                    raise ValueError(f"train_dataloader() returned a batch of {got} samples after the batch size was "
                                     f"set to {expect_size}: it must build its DataLoader from that attribute "
                                     f"(e.g. DataLoader(..., batch_size=self.batch_size))")
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
