"""Lazy placeholders for the steps of ``softmax(q @ kt * c + mask) @ v``: each records how to compute itself and
computes the original ops only when something really uses it (the rewrite in :mod:`.rewrite` consumes them)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from lightning_accel import _compat
from lightning_accel.attention._tree import _flatten

_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_SOFTMAX = {torch.softmax, torch.Tensor.softmax, F.softmax}
_DROPOUT = {F.dropout, torch.dropout}
_CASTS = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
    torch.Tensor.double: torch.float64,
}
_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_cuda.__get__,  # type: ignore
    torch.Tensor.layout.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.__len__,
}
_STAGE_NAMES = {"scores": "the scores q @ k^T", "masked": "the masked scores", "probs": "the probabilities"}


class _Lazy(torch.Tensor):
    """A not-yet-computed step of ``softmax(q @ kt * c + mask) @ v``; computes the original ops when really used."""

    _stage: str  # "scores" (q @ kt, maybe scaled), "masked", "probs"

    @staticmethod
    def __new__(
        cls, shape: torch.Size, like: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None
    ) -> _Lazy:
        return _compat.make_wrapper_subclass(
            cls, shape, dtype=dtype or like.dtype, device=like.device, requires_grad=requires_grad
        )

    def __init__(
        self, shape: torch.Size, like: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None
    ) -> None:
        self._parent: _Lazy | None = None
        self._op: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None  # replays this step; _SELF = parent
        self._value: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._kt: torch.Tensor | None = None
        self._scale = 1.0
        self._masks: tuple[torch.Tensor, ...] = ()  # bool (True takes part) or additive float, combined at the end
        self._stage = "scores"
        self._fused = False  # consumed by a fused SDPA call: may leave the block lazy (e.g. returned attn weights)

    def derive(
        self, stage: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype | None = None
    ) -> _Lazy:
        child = _Lazy(self.shape, self, self.requires_grad, dtype or self.dtype)
        child._parent, child._op = self, (func, args, kwargs)
        child._q, child._kt, child._scale, child._masks, child._stage = (
            self._q,
            self._kt,
            self._scale,
            self._masks,
            stage,
        )
        return child

    def materialize(self) -> torch.Tensor:
        if self._value is None:
            func, args, kwargs = self._op  # type: ignore[misc]
            self._value = func(*_materialize_all(args), **_materialize_all(kwargs))
        return self._value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with _compat.disable_torch_function_subclass():
                return func(*args, **kwargs)
        # outside the rewriting mode (a placeholder that escaped) or an unmatched use: compute the original
        return func(*_materialize_all(args), **_materialize_all(kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(
            f"use_fused_attention: a lazy attention intermediate reached {func} without being "
            "computed; remove this module from blocks=[...] and report the pattern"
        )


def _materialize_all(obj: Any, keep_fused: bool = False) -> Any:
    """``obj`` with its placeholders computed (containers rebuilt only where one was found)."""
    if isinstance(obj, _Lazy):
        if keep_fused and obj._fused and obj._value is None:
            return obj  # e.g. attention weights returned next to the fused output: computed only if used
        return obj.materialize()
    if not any(isinstance(item, _Lazy) for item in _flatten(obj)):
        return obj  # the common case, and a ModelOutput or namedtuple keeps its type untouched
    if isinstance(obj, (list, tuple)):
        items = [_materialize_all(item, keep_fused) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # dict subclasses (Hugging Face's ModelOutput) keep their type and attributes
        for key, value in obj.items():
            out[key] = _materialize_all(value, keep_fused)
        return out
    return obj


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, _Lazy)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on ``device`` right now, ``None`` outside autocast."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


_SOFTMAX_DTYPE: dict[tuple[str, torch.dtype, torch.dtype], torch.dtype] = {}


def _softmax_out_dtype(lazy: _Lazy) -> torch.dtype:
    """softmax's output dtype under the current autocast (CUDA runs softmax in fp32, CPU in the input dtype)."""
    autocast = _autocast_dtype(lazy.device)
    if autocast is None:
        return lazy.dtype
    key = (lazy.device.type, lazy.dtype, autocast)
    if key not in _SOFTMAX_DTYPE:
        with _compat.disable_torch_function_subclass():
            _SOFTMAX_DTYPE[key] = torch.softmax(torch.zeros(1, dtype=lazy.dtype, device=lazy.device), -1).dtype
    return _SOFTMAX_DTYPE[key]


def _cast_target(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype of ``t.to(dtype)`` / ``t.to(dtype=...)`` / ``t.type(dtype)`` / ``t.float()`` & co., else None."""
    if func in _CASTS and len(args) == 1 and not kwargs:
        return _CASTS[func]
    if func is torch.Tensor.type and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[1]
    if func is torch.Tensor.to:
        if set(kwargs) - {"dtype", "non_blocking", "copy"} or kwargs.get("copy"):
            return None
        if len(args) == 2 and isinstance(args[1], torch.dtype) and "dtype" not in kwargs:
            return args[1]
        if len(args) == 1 and isinstance(kwargs.get("dtype"), torch.dtype):
            return kwargs["dtype"]
    return None
