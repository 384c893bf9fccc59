"""Timer installers for BottleneckDoctor: each wraps one public Trainer/strategy/optimizer entry point for the
duration of ``fit`` and returns the function that undoes it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_accel.core.comm import CommRecorder, timed_comm_hook

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "install_checkpoint_timer",
    "install_comm_timer",
    "install_instance_wrapper",
    "install_optimizer_hooks",
    "wrap_strategy_comm_hook",
]


def install_instance_wrapper(
    obj: Any, name: str, before: Callable[[], Any], after: Callable[[Any], None]
) -> Callable[[], None]:
    """Wrap the bound method ``obj.name`` on the instance: ``token = before()``, the call, then ``after(token)``
    (also when the call raises: its exception propagates unchanged). Returns the function that restores it."""
    original = getattr(obj, name)
    had_instance_attr = name in vars(obj)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        token = before()
        try:
            return original(*args, **kwargs)
        finally:
            after(token)

    setattr(obj, name, wrapped)

    def restore() -> None:
        if had_instance_attr:
            setattr(obj, name, original)
        else:
            vars(obj).pop(name, None)

    return restore


def install_checkpoint_timer(
    trainer: pl.Trainer, begin: Callable[[bool], Any], end: Callable[[Any], None]
) -> list[Callable[[], None]]:
    """Time ``trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls: state collection + write; ``begin(True)``)
    and ``trainer.strategy.remove_checkpoint`` (deleting an old one, which takes as long as writing on some file
    systems; ``begin(False)``). A save that raises still ends its timing and raises on, for Lightning to handle:
    it is not the doctor's failure."""
    return [
        install_instance_wrapper(trainer, "save_checkpoint", lambda: begin(True), end),
        install_instance_wrapper(trainer.strategy, "remove_checkpoint", lambda: begin(False), end),
    ]


def install_optimizer_hooks(
    optimizers: list[Any], pre: Callable[..., None], post: Callable[..., None]
) -> list[Callable[[], None]]:
    """Register ``pre``/``post`` as step pre-/post-hooks on every optimizer that supports them."""
    undo = []
    for opt in optimizers:
        register_pre = getattr(opt, "register_step_pre_hook", None)
        register_post = getattr(opt, "register_step_post_hook", None)
        if register_pre is not None and register_post is not None:
            undo.append(register_pre(pre).remove)
            undo.append(register_post(post).remove)
    return undo


def _where_collectives_land(strategy: Any) -> str:
    """Which measured stages hold the collectives a strategy without DDP comm hooks runs."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return (
            "FSDP2's parameter all-gathers run in forward and backward and its gradient reduce-scatters in "
            "backward; tensor parallelism's all-reduces run inside forward and backward: their time is part of "
            "those stages"
        )
    if isinstance(strategy, DeepSpeedStrategy):
        return "DeepSpeed's gradient reduction is part of backward, ZeRO-3's parameter gathers of forward too"
    return "its all-reduce time is part of backward"


def install_comm_timer(trainer: pl.Trainer, cuda: bool, notes: list[str]) -> CommRecorder | None:
    """Plain ``DDPStrategy``: time DDP's default all-reduce through our own comm hook. Returns the recorder, or
    ``None`` with the reason in ``notes`` (DDP allows one comm hook; another strategy exposes none)."""
    model = trainer.strategy.model
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        notes.append(
            f"communication not timed: {type(trainer.strategy).__name__} does not expose DDP comm "
            f"hooks ({_where_collectives_land(trainer.strategy)})"
        )
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    recorder = CommRecorder(cuda=cuda)
    try:
        model.register_comm_hook(None, timed_comm_hook(default_hooks.allreduce_hook, recorder))
    except RuntimeError as err:  # a hook is registered already (DDPStrategy(ddp_comm_hook=...)): DDP allows one
        notes.append(
            f"communication not timed: the model already has a DDP comm hook ({err}); use a "
            "lightning-accel DDP strategy (ddp_bf16_compress, ...) whose hook the doctor can wrap"
        )
        return None
    return recorder


def wrap_strategy_comm_hook(strategy: Any) -> tuple[CommRecorder, Callable[[], None]] | None:
    """A lightning-accel DDP strategy (one with a ``comm_hook_wrappers`` list, read when it registers its comm hook
    in ``strategy.setup``): add a timing wrapper to the list. Returns the recorder and the function that takes the
    wrapper out again, or ``None`` for a strategy without the list."""
    wrappers = getattr(strategy, "comm_hook_wrappers", None)
    if not isinstance(wrappers, list):
        return None
    recorder = CommRecorder(cuda=strategy.root_device.type == "cuda")

    def wrap(hook: Any) -> Any:
        return timed_comm_hook(hook, recorder)

    def unwrap() -> None:
        current = getattr(strategy, "comm_hook_wrappers", [])
        if wrap in current:
            current.remove(wrap)

    wrappers.append(wrap)
    return recorder, unwrap
