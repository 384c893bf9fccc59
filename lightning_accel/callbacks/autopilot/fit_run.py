"""The fit the Autopilot works on: whether it can work on it, the :class:`~lightning_accel.callbacks.autopilot.fixes.Run`
its fixes see and change, and how many optimizer steps the fit will run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes import Run
from lightning_accel.callbacks.autopilot.windows import RunConfig, TrialRunner

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["fit_steps", "install", "make_run", "run_identity", "unsupported"]


def unsupported(trainer: pl.Trainer) -> str | None:
    """Why the Autopilot cannot search this fit, or ``None``."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(trainer.strategy, DeepSpeedStrategy):
        return (
            "under DeepSpeed the engine owns backward and the optimizer step, which the Autopilot's trial "
            "steps cannot run and undo"
        )
    if len(trainer.optimizers) == 0:
        return "the LightningModule has no optimizer"
    return None


def make_run(trainer: pl.Trainer, pl_module: pl.LightningModule, source: Any, *, warmup_steps: int) -> Run:
    """The fit as the fixes see it: its trial runner over a snapshot of the training state."""
    from lightning_accel.callbacks._fit.step_runner import TrainingState

    state = TrainingState(trainer, pl_module)
    config = RunConfig(accumulate=int(trainer.accumulate_grad_batches))
    runner = TrialRunner(trainer, pl_module, source, config, state)
    run = Run(trainer, pl_module, source, config, runner)
    run.steps_left = fit_steps(trainer, source)
    run.extras["warmup_steps"] = warmup_steps
    return run


def run_identity(run: Run) -> dict[str, Any]:
    """What a plan records of the run it was measured on and is checked against before a replay
    (:func:`~lightning_accel.core.autopilot.plan_misfit`): the model's fingerprint, the device type, the number of
    devices and the global batch (samples per optimizer step over all devices, ``None`` when the loader's batch
    size is unknown). Taken before any fix is applied."""
    from lightning_accel.core.autopilot import model_fingerprint

    batch_size = run.source.current().get("batch_size")
    world_size = int(run.trainer.world_size)
    return {
        "fingerprint": model_fingerprint(run.module),
        "device": run.device.type,
        "world_size": world_size,
        "global_batch": int(batch_size) * run.config.accumulate * world_size if batch_size else None,
    }


def fit_steps(trainer: pl.Trainer, source: Any) -> int | None:
    """Optimizer steps the fit will run (``max_steps``, else epochs × batches ÷ accumulation), ``None`` if unbounded
    or unknown."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    epochs = trainer.max_epochs
    if epochs is None or epochs < 0:
        return None
    from lightning_accel.callbacks._fit.trainer_state import steps_per_epoch

    try:
        batches = source.batches()
    except TypeError:
        return None
    return max(1, epochs * steps_per_epoch(trainer, batches, trainer.accumulate_grad_batches))


def install(run: Run) -> tuple[Any, str | None]:
    """The configuration the search ended with, for the real training: the loader's settings, the accumulation, a
    ``DevicePrefetcher`` when prefetch was kept (returned: the caller tears it down), and the kept loader settings
    for the validation DataLoader too when it delivers the same batches with them (how often the user validates is
    never changed). Returns the prefetcher and a note for the report."""
    trainer = run.trainer
    run.source.install()
    trainer.accumulate_grad_batches = run.config.accumulate
    prefetcher = None
    if run.config.prefetch:
        from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

        prefetcher = DevicePrefetcher(depth=run.config.prefetch_depth)
        prefetcher.setup(trainer, run.module, "fit")
    from lightning_accel.callbacks._fit.loader_source import VALIDATION_KEYS, apply_to_validation_loader

    source = run.source
    changed = {k: v for k, v in source.current().items() if k in VALIDATION_KEYS and source.initial.get(k) != v}
    if not changed:
        return prefetcher, None
    try:
        note = apply_to_validation_loader(trainer, changed)
    except Exception as err:  # noqa: BLE001 - validation stays as the user built it
        from lightning_accel.callbacks.autopilot.backend import short_error

        note = f"validation DataLoader left alone: {type(err).__name__}: {short_error(err)}"
    return prefetcher, note
