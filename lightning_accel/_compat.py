"""Every private Lightning, torch and transformers name lightning-accel touches, in one place.

Public API is used wherever it exists; what is left goes through the accessors below, each saying the versions it
was checked against. :data:`PRIVATE_NAMES` lists every private name (also the private methods the strategies and
the precision plugin *override*: an override of a method that a new release renamed would silently never run), and
``tests/test_compat.py`` asserts each still exists in the installed versions. ``.ci/compat`` runs the fast tests
on the oldest supported versions (:data:`TORCH_MIN`, :data:`LIGHTNING_MIN`).

This module imports torch only; Lightning and transformers are imported inside the accessors that need them, so
the framework-free ``core/`` may use it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # public class in a private module; torch 2.0-2.13

__all__ = [
    "LIGHTNING_MIN",
    "PRIVATE_NAMES",
    "TORCH_MIN",
    "PrivateName",
    "TorchDispatchMode",
    "require_versions",
    "supported_range",
]

#: The oldest versions the package supports, and why they are the floor:
#: torch 2.6 — ``sdpa_kernel(..., set_priority=)`` (``sdpa_backends``); Lightning 2.6 —
#: ``Strategy.load_checkpoint(path, weights_only)`` (the DDP compression strategies' checkpoints).
TORCH_MIN = (2, 6)
LIGHTNING_MIN = (2, 6)
#: The newest versions the accessors were checked against.
TORCH_CHECKED = "2.13"
LIGHTNING_CHECKED = "2.6.6"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])


def supported_range() -> str:
    """The supported range, as ``pyproject.toml`` states it."""
    return (
        f"torch>={'.'.join(map(str, TORCH_MIN))} and lightning>={'.'.join(map(str, LIGHTNING_MIN))} "
        f"(checked up to torch {TORCH_CHECKED}, lightning {LIGHTNING_CHECKED})"
    )


def require_versions(component: str, *, lightning: bool = True) -> None:
    """Raise ``ImportError`` naming the supported range when the installed torch (or Lightning) is older.

    Called at import of each component that depends on a version-specific API.

    Args:
        component: what is being imported, for the message (``"TorchCompile"``).
        lightning: also check Lightning (components that import it).
    """
    found = [("torch", torch.__version__, TORCH_MIN)]
    if lightning:
        import lightning as L

        found.append(("lightning", L.__version__, LIGHTNING_MIN))
    old = [f"{name} {version}" for name, version, floor in found if _version_tuple(version) < floor]
    if old:
        raise ImportError(
            f"{component} needs {supported_range()}; found {', '.join(old)}. Upgrade: "
            f"pip install 'torch>={'.'.join(map(str, TORCH_MIN))}' "
            f"'lightning>={'.'.join(map(str, LIGHTNING_MIN))}'"
        )


# ---------------------------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One private name: where it lives, the versions checked, who uses it and how.

    Attributes:
        owner: dotted path of the module or class that holds ``name`` (``"torch.Tensor"``).
        name: the private attribute.
        checked: the versions it was read against.
        used_in: files (``path:function``) that reach it through this module, or override it.
        kind: ``"access"`` (read/called through an accessor here) or ``"override"`` (a subclass replaces it).
        instance: for attributes set in ``__init__``: a function building an object that must have it.
        why: why no public API does the job (``tests/test_compat.py`` requires one for every entry).
    """

    owner: str
    name: str
    checked: str
    used_in: tuple[str, ...]
    kind: str = "access"
    instance: Callable[[], Any] | None = None
    why: str = ""


def _fit_loop() -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit_loop


def _step_lr() -> Any:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, 1)


def _grad_scaler() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "GradScaler is enabled, but CUDA is not available" on CPU machines
        return torch.amp.GradScaler("cpu")


def _hf_config() -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig()


def _model_checkpoint() -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint()


def _dtensor_fields() -> Any:
    """An object with DTensor's declared instance fields (``_local_tensor`` is set in ``__new__``, not on the class;
    building a real DTensor needs a process group)."""
    import types

    from torch.distributed.tensor import DTensor

    return types.SimpleNamespace(**dict.fromkeys(DTensor.__annotations__))


_T = f"torch 2.6-{TORCH_CHECKED}"
_L = f"lightning 2.6.0-{LIGHTNING_CHECKED}"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # --- torch
    PrivateName(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        _T,
        ("attention/recorder.py:SDPABackendRecorder",),
        why="a public class torch exports only from this private module (its docs import it from here)",
    ),
    PrivateName(
        "torch.utils._python_dispatch",
        "_get_current_dispatch_mode",
        _T,
        ("callbacks/torch_compile.py:_dispatch_mode_active",),
        why="torch has no public query for the active dispatch mode",
    ),
    PrivateName(
        "torch.utils._python_dispatch",
        "_disable_current_modes",
        _T,
        ("strategies/pipeline.py:PipelineStrategy._check_first_batch",),
        why="the first-batch check runs the whole model outside any active dispatch mode (a FLOP counter "
        "or a compile trace); torch has no public way to suspend the active modes",
    ),
    PrivateName(
        "torch.Tensor",
        "_make_wrapper_subclass",
        _T,
        ("attention/_lazy.py:_Lazy",),
        why="the only constructor of a storage-less tensor subclass (torch's subclass docs use it)",
    ),
    PrivateName(
        "torch._C",
        "DisableTorchFunctionSubclass",
        _T,
        ("attention/_lazy.py:_Lazy", "attention/mha.py:_WeightsProbe"),
        why="what Tensor.__torch_function__ itself uses; no public way to turn subclass dispatch off",
    ),
    PrivateName(
        "torch._ops.OpOverload",
        "_overloadpacket",
        _T,
        ("attention/recorder.py:_FusedOpCounter",),
        instance=lambda: torch.ops.aten.add.Tensor,
        why="an OpOverload's packet name has no public getter (str(op) adds the overload and namespace)",
    ),
    PrivateName(
        "torch._C",
        "_current_graph_task_id",
        _T,
        ("callbacks/activation_checkpointing.py:_in_backward",),
        why="no public API says whether autograd is running a backward pass in this thread",
    ),
    PrivateName(
        "torch",
        "_foreach_norm",
        _T,
        ("callbacks/non_finite_guard.py:on_before_optimizer_step",),
        why="per-tensor norms in a few kernels; the public norms are one kernel per tensor, or one total",
    ),
    PrivateName(
        "torch._dynamo.exc",
        "TorchDynamoException",
        _T,
        ("callbacks/torch_compile.py:_guarded",),
        why="dynamo's error base class is not exported publicly",
    ),
    PrivateName(
        "torch.autograd.profiler",
        "_is_profiler_enabled",
        _T,
        ("callbacks/doctor/attribution.py:profiling",),
        why="no public API says whether a torch.profiler is recording in this process (two cannot run at once)",
    ),
    PrivateName(
        "torch._dynamo.eval_frame",
        "OptimizedModule",
        _T,
        ("callbacks/doctor/attribution.py:compiled_module",),
        why="the class torch.compile wraps a module in is not exported publicly",
    ),
    PrivateName(
        "torch.nn.Module",
        "_call_impl",
        _T,
        ("callbacks/torch_compile.py:_user_frame",),
        why="the eager call with hooks, bypassing a compiled call: no public name",
    ),
    PrivateName(
        "torch.nn.Module",
        "_compiled_call_impl",
        _T,
        ("callbacks/torch_compile.py:setup", "callbacks/autopilot/fixes/compile.py:Compile"),
        why="nn.Module.compile installs the compiled call here and has no public way to remove it",
    ),
    PrivateName(
        "torch.utils._foreach_utils",
        "_get_fused_kernels_supported_devices",
        _T,
        ("callbacks/autopilot/fixes/optimizer.py:OptimizerImplementation", "core/smells.py:_candidate"),
        why="torch.optim has no public list of the devices with fused kernels",
    ),
    PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        _T,
        ("core/checkpointing.py:apply_activation_checkpointing",),
        why="FSDP's non-reentrant activation-checkpoint wrapper lives only in this private package",
    ),
    PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "CheckpointImpl",
        _T,
        ("core/checkpointing.py:apply_activation_checkpointing",),
        why="the enum that selects checkpoint_wrapper's non-reentrant implementation",
    ),
    PrivateName(
        "torch.utils._pytree",
        "tree_map",
        _T,
        ("core/precision.py:fp32_island",),
        why="torch has no public pytree module (torch.utils._pytree is what torch itself uses)",
    ),
    PrivateName(
        "torch.autocast",
        "_enabled",
        _T,
        ("core/precision.py:autocast_dtypes",),
        instance=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        why="torch.autocast disables itself (warning) for unsupported dtypes and says so only here",
    ),
    PrivateName(
        "torch.amp.GradScaler",
        "_found_inf_per_device",
        _T,
        ("precision/auto_mixed_precision.py:_count_skip",),
        why="GradScaler has no public per-step found-inf flag (a skipped step is otherwise invisible)",
    ),
    PrivateName(
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
        "_allreduce_fut",
        _T,
        ("strategies/ddp_compression.py:_counting_hook",),
        why="torch's plain all-reduce future, the base of its default DDP hook; not exported",
    ),
    PrivateName(
        "torch.distributed.distributed_c10d",
        "_world",
        _T,
        ("strategies/outstanding_work.py:finish_outstanding_work",),
        why="torch keeps its registry of process groups private: no public call lists the groups of a rank",
    ),
    PrivateName(
        "torch.optim.lr_scheduler.LRScheduler",
        "_last_lr",
        _T,
        ("callbacks/batch_size_tuner.py:_scale_lr",),
        instance=_step_lr,
        why="get_last_lr() reads it; there is no public setter after learning rates are rescaled by hand",
    ),
    # --- Lightning
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
            "strategies/pipeline.py:PipelineStrategy._sample_batch",
        ),
        instance=_fit_loop,
        why="where the fit's train data comes from (module, datamodule, fit() argument): no public accessor",
    ),
    PrivateName(
        "lightning.pytorch.loops.evaluation_loop._EvaluationLoop",
        "_data_source",
        _L,
        ("strategies/pipeline.py:PipelineStrategy._sample_batch",),
        instance=lambda: _fit_loop().trainer.validate_loop,
        why="where a validate / test run's data comes from (module, datamodule, argument): no public accessor",
    ),
    PrivateName(
        "lightning.pytorch.loops.prediction_loop._PredictionLoop",
        "_data_source",
        _L,
        ("strategies/pipeline.py:PipelineStrategy._sample_batch",),
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
        "torch.distributed.tensor.DTensor",
        "_local_tensor",
        _T,
        ("core/sharded_flops.py:_local",),
        instance=_dtensor_fields,
        why="to_local() dispatches an op; the FLOP counter must read the shard without one",
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
        ("callbacks/doctor/facts.py:run_facts",),
        instance=_model_checkpoint,
        why="ModelCheckpoint has no public getter for its configured interval",
    ),
    # --- transformers (optional: checked only when installed)
    PrivateName(
        "transformers.PretrainedConfig",
        "_attn_implementation",
        "transformers 5.0-5.24",
        ("attention/fused.py:use_fused_attention", "core/smells.py:_hf_eager"),
        instance=_hf_config,
        why="what transformers' attention dispatch reads; the config has no public getter",
    ),
    PrivateName(
        "transformers.PreTrainedModel",
        "_tp_plan",
        "transformers 5.0-5.24",
        ("strategies/parallel_plan.py:_hf_plan",),
        why="older transformers expose the tensor-parallel plan only as this class attribute",
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
    PrivateName(
        "transformers.PreTrainedModel",
        "_supports_sdpa",
        "transformers 5.0-5.24",
        ("attention/hf_switch.py:_hf_models", "core/checkpointing.py:disable_kv_cache"),
        why="the class flag that tells a PreTrainedModel from its layers (same config)",
    ),
)


def resolve(entry: PrivateName) -> Any:
    """The object that must carry ``entry.name`` (imported, or built by ``entry.instance``)."""
    if entry.instance is not None:
        return entry.instance()
    import importlib

    parts = entry.owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {entry.owner}")


# ---------------------------------------------------------------------------------------------------------------
# torch accessors
# ---------------------------------------------------------------------------------------------------------------


def current_dispatch_mode() -> Any:
    """The innermost active ``TorchDispatchMode`` of this thread, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def suspended_dispatch_modes() -> Any:
    """Context manager: every active ``TorchDispatchMode`` of this thread off (a FLOP counter does not count what
    runs inside), restored on exit."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def disable_torch_function_subclass() -> Any:
    """Context manager: tensor subclasses' ``__torch_function__`` off (what ``Tensor.__torch_function__`` uses)."""
    return torch._C.DisableTorchFunctionSubclass()


def make_wrapper_subclass(cls: type, shape: torch.Size, **kwargs: Any) -> torch.Tensor:
    """A tensor of subclass ``cls`` with metadata only (no storage): the wrapper-subclass constructor."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def op_packet_name(func: Any) -> str:
    """``aten.add.Tensor`` -> ``"add"``: the overload packet's name of an op seen by a dispatch mode."""
    return func._overloadpacket.__name__


def in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread."""
    return torch._C._current_graph_task_id() != -1


def foreach_norm(tensors: list[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """One fused norm per tensor (``torch._foreach_norm``: a few kernels instead of one per tensor)."""
    return list(torch._foreach_norm(tensors, ord))


def dynamo_exception() -> type[BaseException]:
    """The base class of torch.compile's (dynamo's) errors."""
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def call_impl(module: nn.Module) -> Callable[..., Any]:
    """``module``'s eager call (hooks included), bypassing a compiled call installed on it."""
    return module._call_impl


def set_compiled_call(module: nn.Module, call: Callable[..., Any] | None) -> None:
    """Make ``module(...)`` run ``call`` (what ``nn.Module.compile`` installs); ``None`` returns it to eager."""
    module._compiled_call_impl = call


def checkpoint_wrapper_non_reentrant(module: nn.Module) -> nn.Module:
    """``module`` wrapped in torch's non-reentrant activation-checkpoint wrapper (FSDP's ``checkpoint_wrapper``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """torch's pytree ``tree_map`` (lists, tuples, dicts, namedtuples)."""
    from torch.utils._pytree import tree_map as _tree_map

    return _tree_map(fn, tree)


def autocast_enabled(ctx: torch.autocast) -> bool:
    """Whether an ``autocast`` object kept itself on (torch disables it, warning, for unsupported dtypes)."""
    return bool(getattr(ctx, "_enabled", True))


def grad_scaler_found_inf(scaler: Any, optimizer: Any) -> list[torch.Tensor]:
    """The GradScaler's per-device found-inf flags for ``optimizer`` this step ([] when not recorded)."""
    found = getattr(scaler, "_found_inf_per_device", None)
    try:
        return list(found(optimizer).values()) if found is not None else []
    except (KeyError, AttributeError):
        return []


def allreduce_future(process_group: Any, tensor: torch.Tensor) -> Any:
    """torch's plain DDP all-reduce (averaging) as a future, the base of its default comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._allreduce_fut(process_group, tensor)


def process_groups_of_this_rank() -> list[Any]:
    """Every process group this rank belongs to, in creation order (the same order on every rank: groups are
    created collectively), the default group first."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def set_scheduler_last_lr(scheduler: Any, lrs: Iterable[float]) -> None:
    """Make ``scheduler.get_last_lr()`` report ``lrs`` (after the learning rates were rescaled by hand)."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = list(lrs)


# ---------------------------------------------------------------------------------------------------------------
# Lightning accessors
# ---------------------------------------------------------------------------------------------------------------


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


def profiler_event_dtypes(profiler: Any, events: Sequence[Any]) -> None:
    """Give each CPU operation of a stopped ``torch.profiler.profile`` its inputs' dtypes as ``input_dtypes``.

    A newer torch's ``FunctionEvent`` carries them; an older one (torch 2.11 and before) drops them on the way from
    the profiler's own ``KinetoEvent`` (which has had ``dtypes()`` since torch 1.9) to ``events()``: they are read
    back here, matched by the id ``events()`` gives each operation (its correlation id). Without them the doctor's
    dtype rules (``fp32_matmul``, ``nchw_convolution``) would find nothing on exactly the GPUs they are for.
    """
    if not events or getattr(events[0], "input_dtypes", None) is not None:
        return
    results = getattr(getattr(profiler, "profiler", profiler), "kineto_results", None)
    if results is None:
        return
    from torch.autograd import DeviceType

    dtypes = {e.correlation_id(): list(e.dtypes()) for e in results.events() if e.device_type() == DeviceType.CPU}
    for event in events:
        found = dtypes.get(event.id)
        if found and getattr(event, "device_type", None) == DeviceType.CPU:
            event.input_dtypes = found


def profiler_recording() -> bool:
    """Whether a ``torch.profiler`` (or the autograd profiler) records in this process."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def is_compile_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (False on a torch without dynamo)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return False
    return isinstance(module, OptimizedModule)


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled call installed on ``module`` (``nn.Module.compile`` / ``TorchCompile``), or None."""
    return getattr(module, "_compiled_call_impl", None)


def fused_optimizer_devices() -> list[str]:
    """Device types with fused ``torch.optim`` kernels (``fused=True``)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """Lightning's materialisation of a meta-device module after a parallel plan (``ModelParallelStrategy.setup``)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move every optimizer's state to ``device`` (Lightning's helper)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def dtensor_local(x: Any) -> torch.Tensor:
    """The shard of a DTensor this rank computes on, without dispatching an op (``to_local()`` would)."""
    return x._local_tensor


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """A ``transformers`` model's tensor-parallel plan: ``model.tp_plan`` where the version has it, else the class's
    ``_tp_plan``; ``{}`` for other modules."""
    return dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})


def hf_supports_sdpa(module: nn.Module) -> bool:
    """Whether a ``transformers`` model class declares SDPA support (its ``_supports_sdpa`` class flag)."""
    return bool(getattr(module, "_supports_sdpa", False))


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


# ---------------------------------------------------------------------------------------------------------------
# transformers accessors
# ---------------------------------------------------------------------------------------------------------------


def hf_attn_implementation(module: nn.Module) -> str | None:
    """A ``transformers`` model's attention implementation (``"eager"``, ``"sdpa"``, ...); None for other modules.

    ``config._attn_implementation`` is what the library's attention dispatch reads; ``_supports_sdpa`` (a class
    flag of every ``PreTrainedModel``) tells a model from its layers, which hold the same config. Checked against
    transformers 5.0-5.24.
    """
    config = getattr(module, "config", None)
    # a PreTrainedModel (not one of its layers, which also hold the config): it has the SDPA support flag
    if config is None or not (hasattr(module, "set_attn_implementation") or hasattr(module, "_supports_sdpa")):
        return None
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None


def hf_causal_mask(config: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The causal attention mask a Hugging Face decoder builds for ``hidden`` (no padding, no cache), as its own
    forward does: ``transformers.masking_utils.create_causal_mask``, whose signature changed inside 5.x
    (5.0: ``input_embeds``, ``cache_position``, ``past_key_values``; 5.24: ``inputs_embeds``, ``cache``). Checked
    against transformers 5.0.0 and 5.24."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    if "inputs_embeds" in params:
        return create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
    cache_position = torch.arange(hidden.shape[1], device=hidden.device)
    return create_causal_mask(
        config=config,
        input_embeds=hidden,
        attention_mask=None,
        cache_position=cache_position,
        past_key_values=None,
        position_ids=position_ids,
    )


def val_loop_data_source(trainer: Any) -> Any:
    """Where the fit's validation dataloader comes from (``_DataLoaderSource``: datamodule, LightningModule, or
    ``fit(val_dataloaders=)``); checked against Lightning 2.6: ``fit_loop.epoch_loop.val_loop._data_source``."""
    return trainer.fit_loop.epoch_loop.val_loop._data_source
