"""The rewrite of hand-written attention: while a named block runs, a ``TorchFunctionMode`` follows
``matmul(q, kt) -> scale -> mask -> softmax -> matmul(p, v)`` on lazy placeholders and replaces it with one
``F.scaled_dot_product_attention`` call (see :func:`lightning_accel.attention.use_fused_attention`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_accel.attention._lazy import (
    _ADD,
    _DIV,
    _DROPOUT,
    _MATMUL,
    _METADATA,
    _MUL,
    _SOFTMAX,
    _STAGE_NAMES,
    _autocast_dtype,
    _cast_target,
    _is_number,
    _Lazy,
    _materialize_all,
    _plain,
    _softmax_out_dtype,
)
from lightning_accel.attention._tree import _flatten

if TYPE_CHECKING:
    from lightning_accel.attention.changes import FusedAttentionChanges

__all__ = ["ATTENTION_FIX"]

#: The fix named when a rewrite cannot fire (also what ``BottleneckDoctor``'s attention finding should say).
ATTENTION_FIX = (
    "call F.scaled_dot_product_attention in the block itself (Hugging Face: "
    "attn_implementation='sdpa'), or keep the pattern softmax(q @ k^T * c + mask) @ v in one block"
)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    return {
        "__matmul__": "@",
        "__mul__": "*",
        "__rmul__": "*",
        "__truediv__": "/",
        "__add__": "+",
        "__radd__": "+",
        "__getitem__": "indexing",
    }.get(name, name)


def _describe_use(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lazy: _Lazy) -> str:
    """Why this use of a placeholder ends the pattern, in words (for the warning)."""
    name = _op_name(func)
    what = _STAGE_NAMES[lazy._stage]
    if func in _DROPOUT:
        params = dict(zip(("p", "training", "inplace") if func is F.dropout else ("p", "train"), args[1:]))
        params.update(kwargs)
        return (
            f"dropout(p={params.get('p', 0.5)}) in training mode on {what} (the original ops keep their random "
            "draws; eval mode or p=0 fuses)"
        )
    if func in _SOFTMAX:
        return f"softmax over a dimension other than the last, or with extra arguments, on {what}"
    if func is torch.Tensor.masked_fill:
        return f"masked_fill with a value other than -inf or the dtype's lowest value on {what}"
    if func in _MATMUL and lazy._stage == "probs":
        return f"{name} of {what} with a value tensor of another shape, dtype or device"
    return f"{name} on {what} (only * / by a number, + mask, masked_fill, softmax, casts and dropout follow)"


class _AttentionRewrite(TorchFunctionMode):
    """Active while a listed block runs: turns the attention pattern into one SDPA call (see use_fused_attention)."""

    def __init__(self, on_fused: Callable[[], None]) -> None:
        super().__init__()
        self.on_fused = on_fused
        self.fused = 0
        self.broken: str | None = None  # the first op that ended a pattern, in words
        # 0-dim tensors made by torch.full([], value) in this forward (Hugging Face's scale and mask value): their
        # value is known without reading a GPU tensor back (no device sync)
        self._scalars: dict[int, tuple[torch.Tensor, float]] = {}

    def _scalar(self, value: Any) -> float | None:
        """A Python number, a 0-dim tensor made here by torch.full, or a 0-dim CPU tensor, as a float."""
        if _is_number(value):
            return float(value)
        if _plain(value) and value.ndim == 0 and value.is_floating_point():
            known = self._scalars.get(id(value))
            if known is not None and known[0] is value:
                return known[1]
            if value.device.type == "cpu":
                return float(value.item())
        return None

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        lazies = [a for a in _flatten((args, kwargs)) if isinstance(a, _Lazy)]
        if not lazies:
            if func in _MATMUL and not kwargs and len(args) == 2:
                lazy = self._scores(func, args)
                if lazy is not None:
                    return lazy
            elif func is torch.full and len(args) == 2 and len(args[0]) == 0 and _is_number(args[1]):
                out = func(*args, **kwargs)
                self._scalars[id(out)] = (out, float(args[1]))
                return out
            elif func in _SOFTMAX and args and _plain(args[0]) and self.broken is None:
                self._break(
                    "softmax ran on a tensor that is not matmul(q, k^T) of two same-dtype tensors "
                    "(the scores came from an op the rewrite does not follow, e.g. einsum or baddbmm)"
                )
            return func(*args, **kwargs)
        if func in _METADATA:
            return func(*args, **kwargs)
        if len(lazies) == 1:
            out = self._step(func, args, kwargs, lazies[0])
            if out is not None:
                return out
        if any(lazy._value is None for lazy in lazies):
            self._break(_describe_use(func, args, kwargs, lazies[0]))
        return func(*_materialize_all(args), **_materialize_all(kwargs))

    @staticmethod
    def _scores(func: Any, args: tuple[Any, ...]) -> _Lazy | None:
        q, kt = args
        if not (
            _plain(q)
            and _plain(kt)
            and q.is_floating_point()
            and q.dtype == kt.dtype
            and q.device == kt.device
            and q.ndim >= 3
            and kt.ndim == q.ndim
            and q.shape[:-2] == kt.shape[:-2]
            and q.shape[-1] == kt.shape[-2]
        ):
            return None
        shape = torch.Size((*q.shape[:-1], kt.shape[-1]))
        dtype = _autocast_dtype(q.device) or q.dtype  # autocast runs matmul in its dtype whatever the inputs
        lazy = _Lazy(shape, q, torch.is_grad_enabled() and (q.requires_grad or kt.requires_grad), dtype)
        lazy._op, lazy._q, lazy._kt = (func, args, {}), q, kt
        return lazy

    def _step(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], lazy: _Lazy) -> Any:
        if lazy._value is not None:  # computed already for another use: continue on the real tensor
            return None
        stage = lazy._stage
        if stage == "scores" and len(args) == 2 and not kwargs:
            a, b = args
            factor = self._scalar(b if a is lazy else a)
            if func in _MUL and factor is not None:
                child = lazy.derive("scores", func, args, kwargs)
                child._scale = lazy._scale * factor
                return child
            if func in _DIV and a is lazy and factor is not None and factor != 0:
                child = lazy.derive("scores", func, args, kwargs)
                child._scale = lazy._scale / factor
                return child
        target = _cast_target(func, args, kwargs)
        if target is not None and args[0] is lazy and target == lazy.dtype:
            return lazy  # .to(its own dtype): nothing to do
        if stage in ("scores", "masked") and func in _ADD and len(args) == 2 and not kwargs:
            mask = args[1] if args[0] is lazy else args[0]
            if (
                _plain(mask)
                and mask.is_floating_point()
                and mask.device == lazy.device
                and torch.broadcast_shapes(mask.shape, lazy.shape) == lazy.shape
            ):
                child = lazy.derive("masked", func, args, kwargs, torch.promote_types(lazy.dtype, mask.dtype))
                child._masks = (*lazy._masks, mask)
                return child
        if (
            stage in ("scores", "masked")
            and func is torch.Tensor.masked_fill
            and args[0] is lazy
            and len(args) == 3
            and not kwargs
        ):
            child = self._masked(lazy, func, args, kwargs, masked=args[1], value=args[2])
            if child is not None:
                return child
        if (
            stage in ("scores", "masked")
            and func is torch.where
            and len(args) == 3
            and args[1] is lazy
            and not kwargs
            and _plain(args[0])
            and args[0].dtype == torch.bool
        ):
            # torch.where(keep, scores, value) == scores.masked_fill(~keep, value) (GPT-2's causal mask)
            child = self._masked(lazy, func, args, kwargs, masked=~args[0], value=args[2])
            if child is not None:
                return child
        if stage in ("scores", "masked") and func in _SOFTMAX and args[0] is lazy:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            extra = {k: v for k, v in kwargs.items() if k not in ("dim", "_stacklevel", "dtype")}
            dtype = kwargs.get("dtype", args[3] if func is F.softmax and len(args) > 3 else None)
            if dim in (-1, lazy.ndim - 1) and not extra and len(args) <= 2:
                return lazy.derive("probs", func, args, kwargs, dtype or _softmax_out_dtype(lazy))
        if stage == "probs":
            target = _cast_target(func, args, kwargs)
            if target is not None and args[0] is lazy and target.is_floating_point:
                return lazy.derive("probs", func, args, kwargs, target)  # .to(v.dtype) after an fp32 softmax
        if stage == "probs" and func in _DROPOUT and args[0] is lazy:
            params = dict(zip(("p", "training", "inplace") if func is F.dropout else ("p", "train"), args[1:]))
            params.update(kwargs)
            p = params.get("p", 0.5)
            training = params.get("training", params.get("train", True))
            if not params.get("inplace", False) and (p == 0 or not training):
                return lazy  # identity
        if stage == "probs" and func in _MATMUL and len(args) == 2 and args[0] is lazy and not kwargs:
            return self._fuse(lazy, args[1])
        return None

    def _masked(
        self, lazy: _Lazy, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], masked: Any, value: Any
    ) -> _Lazy | None:
        """Scores with ``masked`` positions set to ``value``, when that is a mask SDPA can take."""
        fill = self._scalar(value)
        if not (
            _plain(masked)
            and masked.dtype == torch.bool
            and fill is not None
            and torch.broadcast_shapes(masked.shape, lazy.shape) == lazy.shape
        ):
            return None
        if fill == -math.inf:
            child = lazy.derive("masked", func, args, kwargs)
            child._masks = (*lazy._masks, ~masked)  # SDPA's boolean mask: True takes part
            return child
        if fill == torch.finfo(lazy.dtype).min:
            # the lowest finite value (Hugging Face's mask value): as an additive mask, s + min rounds to min for
            # any score |s| << |min|, so the result is the same, fully masked rows included
            child = lazy.derive("masked", func, args, kwargs)
            additive = torch.zeros(masked.shape, dtype=lazy.dtype, device=lazy.device)
            child._masks = (*lazy._masks, additive.masked_fill(masked, fill))
            return child
        return None

    def _fuse(self, lazy: _Lazy, v: Any) -> torch.Tensor | None:
        q, kt = lazy._q, lazy._kt
        assert q is not None and kt is not None
        if not (
            _plain(v)
            and v.is_floating_point()
            and v.device == q.device
            and v.ndim == q.ndim
            and v.shape[:-2] == q.shape[:-2]
            and v.shape[-2] == kt.shape[-1]
        ):
            return None
        autocast = _autocast_dtype(q.device)
        if autocast is None and not (lazy.dtype == v.dtype == q.dtype):
            return None  # the original raises (or promotes in a way the kernel does not): let it run as written
        dtype = autocast or q.dtype
        k = kt.transpose(-2, -1)
        q, k, v = (t if t.dtype == dtype else t.to(dtype) for t in (q, k, v))
        mask = _combine_masks(lazy._masks, dtype)
        lazy._fused = True
        self.fused += 1
        self.on_fused()
        if q.ndim == 3:  # (batch*heads, L, E): the fused kernels want (batch, heads, L, E)
            if mask is not None and mask.ndim == 3:
                mask = mask.unsqueeze(1)
            return F.scaled_dot_product_attention(
                q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), attn_mask=mask, dropout_p=0.0, scale=lazy._scale
            ).squeeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=lazy._scale)


def _combine_masks(masks: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """One SDPA mask from the bool (True takes part) and additive float masks met on the way, in ``dtype``."""
    if not masks:
        return None
    if len(masks) == 1 and (masks[0].dtype == torch.bool or masks[0].dtype == dtype):
        return masks[0]
    total: torch.Tensor | None = None
    for mask in masks:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
        elif mask.dtype != dtype:
            # float32's lowest value (Hugging Face's padding mask) overflows to -inf in bf16/fp16, and a fully
            # masked row (a padded query) would turn NaN where the original gave a finite uniform row
            mask = mask.clamp(min=torch.finfo(dtype).min).to(dtype)
        total = mask if total is None else total + mask
    return total


def _install_block_rewrite(name: str, module: nn.Module, result: FusedAttentionChanges, *, warn: bool = True) -> None:
    """Hooks on ``module`` that run its forward under the rewrite, counting fused calls into ``result``."""
    result.fused_calls[name] = 0
    modes: list[_AttentionRewrite] = []
    warned = [False]

    def on_fused() -> None:
        result.fused_calls[name] += 1

    def pre_hook(mod: nn.Module, args: Any) -> None:
        mode = _AttentionRewrite(on_fused)
        mode.__enter__()
        modes.append(mode)

    def post_hook(mod: nn.Module, args: Any, output: Any) -> Any:
        if not modes:
            return output
        mode = modes.pop()
        mode.__exit__(None, None, None)
        if mode.fused == 0 and result.fused_calls[name] == 0 and not warned[0]:
            warned[0] = True
            reason = mode.broken or "no matmul(q, k^T) -> softmax -> matmul(p, v) ran in the block"
            result.not_fired[name] = reason
            if warn:
                warnings.warn(
                    f"use_fused_attention: the rewrite of {name or 'the model'!r} ({type(mod).__name__}) "
                    f"did not fire in its forward: {reason}. The block runs unchanged; fix: "
                    f"{ATTENTION_FIX}.",
                    UserWarning,
                    stacklevel=2,
                )
        # a placeholder that the fused call did not consume is computed here: nothing half-done leaves the block
        return _materialize_all(output, keep_fused=True)

    result._handles.append(module.register_forward_pre_hook(pre_hook))
    result._handles.append(module.register_forward_hook(post_hook, always_call=True))
