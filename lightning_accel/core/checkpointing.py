"""Activation checkpointing without Lightning: wrap chosen submodules with non-reentrant ``torch.utils.checkpoint``,
measure what it saves, and read the process's peak resident memory (Linux) to check it."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_accel import _compat

__all__ = [
    "CHECKPOINT_PREFIX",
    "apply_activation_checkpointing",
    "clean_module_name",
    "disable_kv_cache",
    "remove_activation_checkpointing",
    "saved_activation_bytes",
]

#: the attribute torch's ``CheckpointWrapper`` keeps the wrapped module under (it appears in parameter names)
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module"


def clean_module_name(name: str) -> str:
    """A qualified name without the wrapper segments torch adds (``_checkpoint_wrapped_module``, ``_orig_mod``)."""
    for segment in (CHECKPOINT_PREFIX, "_orig_mod"):
        name = name.replace(f".{segment}.", ".").replace(f".{segment}", "")
        if name == segment:
            return ""
        if name.startswith(segment + "."):
            name = name[len(segment) + 1 :]
    return name


def _is_wrapper(module: nn.Module) -> bool:
    return hasattr(module, CHECKPOINT_PREFIX)


def apply_activation_checkpointing(model: nn.Module, targets: Sequence[type | str]) -> list[str]:
    """Wrap the submodules of ``model`` matching ``targets`` in torch's non-reentrant ``CheckpointWrapper``.

    ``targets`` are module types (``Block``) and/or ``fnmatch`` patterns over qualified names (``"blocks.*"``,
    matched without wrapper segments). A module inside another match is left alone (its parent's recomputation
    covers it); the root module itself is never wrapped. ``state_dict`` keys are unchanged: the wrapper strips its
    ``_checkpoint_wrapped_module.`` segment on save and adds it on load; parameter *names* do carry the segment.

    Returns:
        The qualified names of the wrapped modules.

    Raises:
        ValueError: a target matches nothing; the message lists the module types (and some names) present.
    """

    named = [(clean_module_name(n), n, m) for n, m in model.named_modules() if n]
    hits: dict[int, int] = {i: 0 for i in range(len(targets))}
    chosen: list[tuple[str, str]] = []  # (clean name, raw name)
    for clean, raw, module in named:
        if _is_wrapper(module):
            continue  # matched through the module it wraps (below), so re-applying is idempotent
        matched = False
        for i, target in enumerate(targets):
            if (isinstance(target, type) and isinstance(module, target)) or (
                isinstance(target, str) and fnmatch.fnmatchcase(clean, target)
            ):
                hits[i] += 1
                matched = True
        owner = raw.removesuffix(CHECKPOINT_PREFIX).removesuffix(".")  # an already wrapped module: its wrapper
        if matched and owner:
            chosen.append((clean, owner))
    missing = [targets[i] for i, n in hits.items() if n == 0]
    if missing:
        types = sorted({type(m).__name__ for _, _, m in named if not _is_wrapper(m)})
        shown = ", ".join(t.__name__ if isinstance(t, type) else repr(t) for t in missing)
        names = list(dict.fromkeys(c for c, _, _ in named))[:10]
        raise ValueError(
            f"ActivationCheckpointing: {shown} matched no submodule of {type(model).__name__}. Module "
            f"types present: {', '.join(types)}; names include {names}"
        )
    outermost = [(c, r) for c, r in chosen if not any(r.startswith(o + ".") for _, o in chosen if o != r)]
    for _, raw in outermost:
        parent_name, _, child = raw.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        current = getattr(parent, child)
        if not _is_wrapper(current):
            setattr(parent, child, _compat.checkpoint_wrapper_non_reentrant(current))
    return [c for c, _ in outermost]


def disable_kv_cache(model: nn.Module) -> list[Any]:
    """Turn off the key/value cache of the Hugging Face models inside ``model``; returns the configs changed.

    A decoder that appends to its cache in forward appends again when checkpointing recomputes that forward, and
    torch's checkpoint then finds tensors of another sequence length ("Recomputed values ... have different
    metadata"). Hugging Face's own ``gradient_checkpointing_enable`` sets ``use_cache=False`` for training too.
    """
    changed: list[Any] = []
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if (
            _compat.hf_attn_implementation(module) is not None
            and getattr(config, "use_cache", False) is True
            and all(config is not c for c in changed)
        ):
            config.use_cache = False
            changed.append(config)
    return changed


def remove_activation_checkpointing(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Replace ``CheckpointWrapper``s in ``model`` (all, or those at the clean qualified ``names``) by the modules
    they wrap; returns how many were removed."""
    removed = 0
    wanted = set(names) if names is not None else None
    for name, module in list(model.named_modules()):
        if name and _is_wrapper(module) and (wanted is None or clean_module_name(name) in wanted):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, getattr(module, CHECKPOINT_PREFIX))
            removed += 1
    return removed


def saved_activation_bytes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes autograd would keep for backward if ``module(*args, **kwargs)`` ran without checkpointing.

    Runs the module once more (grad enabled) under ``torch.autograd.graph.saved_tensors_hooks`` and sums the
    sizes of the distinct storages it saves, leaving out the module's parameters and its inputs (checkpointing
    keeps those alive anyway). The run leaves no trace: RNG states and buffers (BatchNorm statistics) are restored
    and the graph is dropped. Its own activations exist only while it runs (one module's worth).
    """
    from lightning_accel.core.flops import _preserved_training_state

    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            exclude.add(value.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude and ptr != 0:
            seen[ptr] = storage.nbytes()
        return t

    cuda = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with (
        _preserved_training_state(module, cuda),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        out = module(*args, **kwargs)
    del out
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------- peak RSS (Linux)
