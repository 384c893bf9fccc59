"""``nn.MultiheadAttention`` on the fused path: find the modules whose attention weights are never used (one probe
forward) and run them with ``need_weights=False``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_accel import _compat
from lightning_accel.attention._tree import _flatten


def _no_weights_pre_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # MultiheadAttention.forward(query, key, value, key_padding_mask=None, need_weights=True, ...)
    if len(args) > 4:
        args = (*args[:4], False, *args[5:])
    else:
        kwargs = {**kwargs, "need_weights": False}
    return args, kwargs


class _WeightsProbe(torch.Tensor):
    """Attention weights handed back during the probe forward: any torch use of them marks them as used."""

    _probe_flag: list[bool]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for arg in _flatten((args, kwargs or {})):
            if isinstance(arg, _WeightsProbe):
                arg._probe_flag[0] = True
        with _compat.disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))


def _call(model: nn.Module, example_inputs: Any) -> Any:
    if isinstance(example_inputs, dict):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple):
        return model(*example_inputs)
    return model(example_inputs)


def _mha_weights_used(model: nn.Module, mhas: dict[str, nn.MultiheadAttention], example_inputs: Any) -> dict[str, bool]:
    """One example forward; per MHA module called with weights: whether the weights were used (or kept)."""
    probes: dict[str, list[weakref.ref]] = {name: [] for name in mhas}
    flags: dict[str, list[bool]] = {name: [False] for name in mhas}  # outlive the probes
    used: dict[str, bool] = {}

    def make_hook(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            out, weights = output
            if weights is None:  # called with need_weights=False already
                return output
            probe = weights.as_subclass(_WeightsProbe)
            probe._probe_flag = flags[name]
            probes[name].append(weakref.ref(probe))
            return out, probe

        return hook

    handles = [module.register_forward_hook(make_hook(name)) for name, module in mhas.items()]
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            output = _call(model, example_inputs)
            del output
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():  # the probe must not move BatchNorm statistics & co.
            for name, buf in model.named_buffers():
                if name in buffers and buf.shape == buffers[name].shape:
                    buf.copy_(buffers[name])
    gc.collect()
    for name, refs in probes.items():
        if not refs:
            continue  # not called in the example forward, or never with weights
        # used by a torch op, or still referenced after the forward (stored, returned): treat as used
        used[name] = flags[name][0] or any(ref() is not None for ref in refs)
    return used
