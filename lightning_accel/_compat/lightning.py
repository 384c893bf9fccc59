"""Lightning's private names: the registry entries (also the private methods the strategies and the precision
plugin override) and the accessors that reach them.

Lightning is imported inside the functions that need it, so importing this module does not import it (the
framework-free ``core/`` imports the package). The policy: ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_accel._compat.registry import LIGHTNING_CHECKED, PrivateName

_L = f"lightning 2.6.0-{LIGHTNING_CHECKED}"


def _fit_loop() -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit_loop


def _model_checkpoint() -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint()


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "lightning.fabric.plugins.precision.amp",
        "_optimizer_handles_unscaling",
        _L,
        ("precision/auto_mixed_precision.py:optimizer_step",),
        why="Lightning's own rule for fused optimizers that unscale themselves; not exported",
    ),
    PrivateName(
        "lightning.pytorch.plugins.precision.MixedPrecision",
        "_after_closure",
        _L,
        ("precision/auto_mixed_precision.py:optimizer_step",),
        why="the plugin's post-closure step (on_before_optimizer_step, clipping); no public hook runs it",
    ),
    PrivateName(
        "lightning.pytorch.loops.fit_loop._FitLoop",
        "_data_source",
        _L,
        (
            "callbacks/_fit/loader_source.py:TrainLoaderSource",
            "callbacks/_fit/loader_source.py:fit_data_holder",
            "strategies/pipeline_split.py:sample_batch",
        ),
        instance=_fit_loop,
        why="where the fit's train data comes from (module, datamodule, fit() argument): no public accessor",
    ),
    PrivateName(
        "lightning.pytorch.loops.evaluation_loop._EvaluationLoop",
        "_data_source",
        _L,
        ("strategies/pipeline_split.py:sample_batch",),
        instance=lambda: _fit_loop().trainer.validate_loop,
        why="where a validate / test run's data comes from (module, datamodule, argument): no public accessor",
    ),
    PrivateName(
        "lightning.pytorch.loops.prediction_loop._PredictionLoop",
        "_data_source",
        _L,
        ("strategies/pipeline_split.py:sample_batch",),
        instance=lambda: _fit_loop().trainer.predict_loop,
        why="where a predict run's data comes from (module, datamodule, argument): no public accessor",
    ),
    PrivateName(
        "lightning.pytorch.utilities.data",
        "_get_dataloader_init_args_and_kwargs",
        _L,
        ("callbacks/_fit/loader_source.py:rebuild_dataloader",),
        why="Lightning's re-creation of a DataLoader from its constructor arguments; not exported",
    ),
    PrivateName(
        "lightning.fabric.utilities.data",
        "_reinstantiate_wrapped_cls",
        _L,
        ("callbacks/_fit/loader_source.py:rebuild_dataloader",),
        why="the other half of Lightning's DataLoader re-creation (attribute records replayed)",
    ),
    PrivateName(
        "lightning.pytorch.loops.fit_loop._FitLoop",
        "_combined_loader",
        _L,
        ("callbacks/_fit/step_runner.py:reload_train_dataloader",),
        instance=_fit_loop,
        why="the fit loop rebuilds its train loader only once this is cleared (no on-demand public reload)",
    ),
    PrivateName(
        "lightning.pytorch.strategies.DDPStrategy",
        "_register_ddp_hooks",
        _L,
        ("strategies/ddp_compression.py:DDPCompressionStrategy",),
        kind="override",
        why="DDPStrategy's one method that registers comm hooks; overridden to register ours",
    ),
    PrivateName(
        "lightning.pytorch.strategies.DeepSpeedStrategy",
        "_setup_model_and_optimizer",
        _L,
        ("strategies/deepspeed_presets.py:DeepSpeedZeroStrategy",),
        kind="override",
        why="DeepSpeedStrategy's engine construction; overridden to pass the preset's config",
    ),
    PrivateName(
        "lightning.pytorch.strategies.DeepSpeedStrategy",
        "_initialize_deepspeed_inference",
        _L,
        ("strategies/deepspeed_presets.py:DeepSpeedZeroStrategy",),
        kind="override",
        why="DeepSpeedStrategy's inference engine construction; overridden like training",
    ),
    PrivateName(
        "lightning.pytorch.strategies.DeepSpeedStrategy",
        "_init_deepspeed_distributed",
        _L,
        ("strategies/deepspeed_presets.py:setup_distributed",),
        why="DeepSpeedStrategy's process-group start with Lightning's settings; no public entry",
    ),
    PrivateName(
        "lightning.fabric.utilities.init",
        "_materialize_distributed_module",
        _L,
        ("strategies/model_parallel.py:AutoParallelStrategy.setup",),
        why="ModelParallelStrategy's materialisation of a meta-device module; not exported",
    ),
    PrivateName(
        "lightning.fabric.utilities.optimizer",
        "_optimizers_to_device",
        _L,
        ("strategies/model_parallel.py:AutoParallelStrategy.setup",),
        why="Lightning's move of optimizer state to a device; not exported",
    ),
    PrivateName(
        "lightning.pytorch.Trainer",
        "_logger_connector",
        _L,
        ("callbacks/_fit/window_metrics.py:log_window",),
        instance=lambda: _fit_loop().trainer,
        why=(
            "its log_metrics logs to every logger at Lightning's step counter with epoch added, as self.log "
            "does; no public API does (Lightning's ThroughputMonitor calls the same method)"
        ),
    ),
    PrivateName(
        "lightning.pytorch.callbacks.RichProgressBar",
        "_get_train_description",
        _L,
        ("demo/progress.py:StepsProgressBar",),
        kind="override",
        why="the one place the Rich bar writes its 'Epoch x/y' text; overridden so a max_steps run does not read "
        "'Epoch 0/-2' (no public hook sets the description)",
    ),
    PrivateName(
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "_every_n_train_steps",
        _L,
        ("callbacks/doctor/facts.py:fit_settings",),
        instance=_model_checkpoint,
        why="ModelCheckpoint has no public getter for its configured interval",
    ),
    PrivateName(
        "lightning.pytorch.trainer.connectors.callback_connector",
        "_CallbackConnector",
        _L,
        ("attach.py:callbacks_factory",),
        why="Lightning calls the callbacks_factory entry points with no argument from "
        "_CallbackConnector.on_trainer_init; the callbacks the user passed are found on that frame, so an "
        "attached callback never duplicates one of theirs",
    ),
    PrivateName(
        "lightning.pytorch.trainer.connectors.callback_connector._CallbackConnector",
        "on_trainer_init",
        _L,
        ("attach.py:callbacks_factory",),
        why="the frame callbacks_being_configured looks for (see _CallbackConnector)",
    ),
)


def optimizer_handles_unscaling(optimizer: Any) -> bool:
    """Whether the optimizer unscales gradients itself (fused Adam with a GradScaler), as Lightning decides."""
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return bool(_optimizer_handles_unscaling(optimizer))


def after_closure(plugin: Any, model: Any, optimizer: Any) -> None:
    """``MixedPrecision._after_closure``: calls ``on_before_optimizer_step`` and gradient clipping."""
    plugin._after_closure(model, optimizer)


def module_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None: the public ``module.trainer``, which raises
    ``RuntimeError`` when there is none (and is a Fabric shim, not a Trainer, under Fabric)."""
    import lightning.pytorch as pl

    try:
        trainer = getattr(module, "trainer", None)
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None
    return trainer if isinstance(trainer, pl.Trainer) else None


def callbacks_being_configured() -> list[Any] | None:
    """The callbacks of the Trainer whose construction is calling the callbacks factories, or ``None`` when it is
    not found: Lightning (and ``pytorch_lightning``) 2.6 calls each factory with no argument from
    ``_CallbackConnector.on_trainer_init``, after the user's callbacks are on ``trainer.callbacks``."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "on_trainer_init" and type(frame.f_locals.get("self")).__name__ == (
            "_CallbackConnector"
        ):
            callbacks = getattr(getattr(frame.f_locals["self"], "trainer", None), "callbacks", None)
            return list(callbacks) if isinstance(callbacks, list) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def fit_loop_data_source(trainer: Any) -> Any:
    """Where the train dataloader comes from (datamodule, LightningModule, or ``fit(train_dataloaders=)``)."""
    return trainer.fit_loop._data_source


def stage_data_source(trainer: Any) -> Any:
    """Where the data of the run the Trainer is setting up comes from (``_DataLoaderSource``): the train loader
    for ``fit``, else the validate / test / predict loop's; checked against Lightning 2.6."""
    fn = getattr(trainer.state.fn, "value", None)
    loop = {
        "fit": trainer.fit_loop,
        "validate": trainer.validate_loop,
        "test": trainer.test_loop,
        "predict": trainer.predict_loop,
    }.get(fn)
    return None if loop is None else loop._data_source


def reset_fit_loop_loader(trainer: Any) -> None:
    """Make the fit loop rebuild its train dataloader at the start of the next epoch (``setup_data`` returns
    early while ``_combined_loader`` is set; ``on_advance_start`` calls it every epoch)."""
    trainer.fit_loop._combined_loader = None


def dataloader_init_arguments(loader: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments that re-create ``loader`` with its own sampler, as Lightning computes them
    to inject a ``DistributedSampler`` (``lightning.pytorch.utilities.data``)."""
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs

    return _get_dataloader_init_args_and_kwargs(loader, loader.sampler, RunningStage.TRAINING)


def reinstantiate_dataloader(loader: Any, *args: Any, **kwargs: Any) -> Any:
    """``type(loader)(*args, **kwargs)`` the way Lightning re-creates wrapped loaders (its attribute records
    replayed, a clear error for subclasses that map two arguments to one)."""
    from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls

    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Lightning's materialisation of a meta-device module after a parallel plan (``ModelParallelStrategy.setup``)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move every optimizer's state to ``device`` (Lightning's helper)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def logger_connector_log_metrics(trainer: Any) -> Callable[[dict[str, Any]], None] | None:
    """The logger connector's ``log_metrics`` (every logger, at Lightning's step counter, ``epoch`` added, then
    ``logger.save()``): what ``self.log`` flushes through and Lightning's own ``ThroughputMonitor`` calls; None
    where this Lightning has another layout."""
    log_metrics = getattr(getattr(trainer, "_logger_connector", None), "log_metrics", None)
    return log_metrics if callable(log_metrics) else None


def checkpoint_every_n_train_steps(checkpoint: Any) -> int:
    """``ModelCheckpoint(every_n_train_steps=...)`` as configured (no public getter); 0 when unset."""
    return int(getattr(checkpoint, "_every_n_train_steps", 0) or 0)


def init_deepspeed_distributed(strategy: Any) -> None:
    """DeepSpeedStrategy's process-group start (``deepspeed.init_distributed`` with Lightning's settings)."""
    strategy._init_deepspeed_distributed()


def val_loop_data_source(trainer: Any) -> Any:
    """Where the fit's validation dataloader comes from (``_DataLoaderSource``: datamodule, LightningModule, or
    ``fit(val_dataloaders=)``); checked against Lightning 2.6: ``fit_loop.epoch_loop.val_loop._data_source``."""
    return trainer.fit_loop.epoch_loop.val_loop._data_source
