"""torch's private names: the registry entries and the accessors that reach them.

Everything here needs torch only, so the framework-free ``core/`` may use it. Each entry of
:data:`PRIVATE_NAMES` says why no public API does the job; the policy: ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # public class, private module

from lightning_accel._compat.registry import TORCH_CHECKED, PrivateName

_T = f"torch 2.6-{TORCH_CHECKED}"


def _step_lr() -> Any:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, 1)


def _dtensor_fields() -> Any:
    """An object with DTensor's declared instance fields (``_local_tensor`` is set in ``__new__``, not on the class;
    building a real DTensor needs a process group)."""
    import types

    from torch.distributed.tensor import DTensor

    return types.SimpleNamespace(**dict.fromkeys(DTensor.__annotations__))


PRIVATE_NAMES: tuple[PrivateName, ...] = (
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
        ("strategies/pipeline_checks.py:FirstBatchCheck.run",),
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
        ("core/precision.py:_island_forward",),
        why="torch has no public pytree module (torch.utils._pytree is what torch itself uses)",
    ),
    PrivateName(
        "torch.autocast",
        "_enabled",
        _T,
        ("core/precision.py:supported_autocast_dtypes",),
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
        ("callbacks/batch_size_tuner.py:BatchSizeTuner._rescale_lr",),
        instance=_step_lr,
        why="get_last_lr() reads it; there is no public setter after learning rates are rescaled by hand",
    ),
    PrivateName(
        "torch.distributed.tensor.DTensor",
        "_local_tensor",
        _T,
        ("core/sharded_flops.py:_local",),
        instance=_dtensor_fields,
        why="to_local() dispatches an op; the FLOP counter must read the shard without one",
    ),
)


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


def process_groups_of_this_rank() -> list[Any]:
    """Every process group this rank belongs to, in creation order (the same order on every rank: groups are
    created collectively), the default group first."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def set_scheduler_last_lr(scheduler: Any, lrs: Iterable[float]) -> None:
    """Make ``scheduler.get_last_lr()`` report ``lrs`` (after the learning rates were rescaled by hand)."""
    if hasattr(scheduler, "_last_lr"):
        scheduler._last_lr = list(lrs)


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


def dtensor_local(x: Any) -> torch.Tensor:
    """The shard of a DTensor this rank computes on, without dispatching an op (``to_local()`` would)."""
    return x._local_tensor
