"""Every private torch, Lightning and transformers name lightning-accel touches, one module per library.

Public API is used wherever it exists; what is left goes through the accessors of ``torch``, ``lightning`` and
``transformers`` here, each module holding its entries of :data:`PRIVATE_NAMES` (also the private methods the
strategies and the precision plugin *override*: an override of a renamed method would silently never run).
``tests/test_compat.py`` checks every entry; ``.ci/compat`` runs the fast tests on the floors (:data:`TORCH_MIN`,
:data:`LIGHTNING_MIN`). Importing this package imports torch only: Lightning and transformers are imported inside
the accessors that need them, so the framework-free ``core/`` may use it. The policy: ``docs/architecture.md``.
"""

from __future__ import annotations

from lightning_accel._compat.lightning import PRIVATE_NAMES as _LIGHTNING_NAMES
from lightning_accel._compat.lightning import (
    after_closure,
    callbacks_being_configured,
    checkpoint_every_n_train_steps,
    dataloader_init_arguments,
    fit_loop_data_source,
    init_deepspeed_distributed,
    logger_connector_log_metrics,
    materialize_distributed_module,
    module_trainer,
    optimizer_handles_unscaling,
    optimizers_to_device,
    reinstantiate_dataloader,
    reset_fit_loop_loader,
    stage_data_source,
    val_loop_data_source,
)
from lightning_accel._compat.registry import (
    LIGHTNING_CHECKED,
    LIGHTNING_MIN,
    TORCH_CHECKED,
    TORCH_MIN,
    PrivateName,
    require_versions,
    resolve,
    supported_range,
)
from lightning_accel._compat.torch import PRIVATE_NAMES as _TORCH_NAMES
from lightning_accel._compat.torch import (
    TorchDispatchMode,
    autocast_enabled,
    call_impl,
    checkpoint_wrapper_non_reentrant,
    compiled_call,
    current_dispatch_mode,
    disable_torch_function_subclass,
    dtensor_local,
    dynamo_exception,
    foreach_norm,
    fused_optimizer_devices,
    grad_scaler_found_inf,
    in_backward,
    is_compile_wrapper,
    make_wrapper_subclass,
    op_packet_name,
    process_groups_of_this_rank,
    profiler_event_dtypes,
    profiler_recording,
    set_compiled_call,
    set_scheduler_last_lr,
    suspended_dispatch_modes,
    tree_map,
)
from lightning_accel._compat.transformers import PRIVATE_NAMES as _TRANSFORMERS_NAMES
from lightning_accel._compat.transformers import (
    hf_attn_implementation,
    hf_causal_mask,
    hf_supports_sdpa,
    hf_tp_plan,
)

#: Every entry of every module of the package (``tests/test_compat.py`` checks that none is left out).
PRIVATE_NAMES: tuple[PrivateName, ...] = _TORCH_NAMES + _LIGHTNING_NAMES + _TRANSFORMERS_NAMES

__all__ = [
    "LIGHTNING_CHECKED",
    "LIGHTNING_MIN",
    "PRIVATE_NAMES",
    "TORCH_CHECKED",
    "TORCH_MIN",
    "PrivateName",
    "TorchDispatchMode",
    "after_closure",
    "autocast_enabled",
    "call_impl",
    "callbacks_being_configured",
    "checkpoint_every_n_train_steps",
    "checkpoint_wrapper_non_reentrant",
    "compiled_call",
    "current_dispatch_mode",
    "dataloader_init_arguments",
    "disable_torch_function_subclass",
    "dtensor_local",
    "dynamo_exception",
    "fit_loop_data_source",
    "foreach_norm",
    "fused_optimizer_devices",
    "grad_scaler_found_inf",
    "hf_attn_implementation",
    "hf_causal_mask",
    "hf_supports_sdpa",
    "hf_tp_plan",
    "in_backward",
    "init_deepspeed_distributed",
    "is_compile_wrapper",
    "logger_connector_log_metrics",
    "make_wrapper_subclass",
    "materialize_distributed_module",
    "module_trainer",
    "op_packet_name",
    "optimizer_handles_unscaling",
    "optimizers_to_device",
    "process_groups_of_this_rank",
    "profiler_event_dtypes",
    "profiler_recording",
    "reinstantiate_dataloader",
    "require_versions",
    "reset_fit_loop_loader",
    "resolve",
    "set_compiled_call",
    "set_scheduler_last_lr",
    "stage_data_source",
    "supported_range",
    "suspended_dispatch_modes",
    "tree_map",
    "val_loop_data_source",
]
