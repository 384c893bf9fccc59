"""Choosing SDPA backends: which ones the device has, and a context manager that allows or forbids them by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["BACKENDS", "available_sdpa_backends", "sdpa_backends"]

BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def available_sdpa_backends(device: torch.device | str | None = None) -> tuple[str, ...]:
    """SDPA backends the device can run at all (inputs may still rule a fused one out, e.g. fp32 on flash).

    CPU: ``math`` and ``flash`` (``aten._scaled_dot_product_flash_attention_for_cpu``). CUDA, by compute capability
    as PyTorch's ``sdp_utils.cpp`` checks it: ``flash`` needs a FlashAttention build and sm80+; ``efficient``
    (xFormers' memory-efficient kernel) sm50+; ``cudnn`` cuDNN >= 9 and sm80+. ``math`` runs everywhere.

    Args:
        device: default: the current CUDA device if CUDA is available, else CPU.
    """
    device = _resolve_device(device)
    if device.type == "cpu":
        return ("flash", "math")
    if device.type != "cuda":
        return ("math",)
    major, minor = torch.cuda.get_device_capability(device)
    capability = (major, minor)
    found = []
    if torch.backends.cuda.is_flash_attention_available() and (capability >= (8, 0) or torch.version.hip):
        found.append("flash")
    if capability >= (5, 0) or torch.version.hip:
        found.append("efficient")
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn_version is not None and cudnn_version >= 90000 and capability >= (8, 0):
        found.append("cudnn")
    found.append("math")
    return tuple(found)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class sdpa_backends(contextlib.ContextDecorator):
    """Allow only some SDPA backends (in order of preference), or forbid some, inside a ``with`` block.

    ``with sdpa_backends("flash", "efficient"):`` runs attention only on those kernels (in that priority order),
    erroring inside ``scaled_dot_product_attention`` when the inputs suit neither — a way to *prove* the fused
    kernel runs. ``with sdpa_backends(forbid="math"):`` allows every available backend but the slow one. Also works
    as a decorator (``@sdpa_backends("flash")``) on a ``training_step``.

    Args:
        *allow: backend names to allow, by preference; default: every backend the device has.
        forbid: names to leave out (a backend the device lacks is simply not there to forbid).
        device: whose backends to check against; default: the current CUDA device if any, else CPU.

    Raises:
        ValueError: an unknown name, a backend the device lacks (the message names the available ones), or
            nothing left to run.
    """

    def __init__(self, *allow: str, forbid: str | Iterable[str] = (), device: torch.device | str | None = None) -> None:
        forbid = (forbid,) if isinstance(forbid, str) else tuple(forbid)
        for name in (*allow, *forbid):
            if name not in BACKENDS:
                raise ValueError(f"sdpa_backends: unknown backend {name!r}; choose from {sorted(BACKENDS)}")
        dev = _resolve_device(device)
        available = available_sdpa_backends(dev)
        missing = [name for name in allow if name not in available]
        if missing:
            raise ValueError(
                f"sdpa_backends: {', '.join(missing)} not available on {dev}"
                f" ({_describe(dev)}); available there: {', '.join(available)}"
            )
        chosen = [name for name in (allow or available) if name not in forbid]
        if not chosen:
            raise ValueError(
                f"sdpa_backends(allow={allow}, forbid={forbid}): no backend left to run attention on "
                f"{dev}; available there: {', '.join(available)}"
            )
        self.backends: tuple[str, ...] = tuple(dict.fromkeys(chosen))
        self.device = dev
        self._priority = bool(allow)
        self._contexts: list[Any] = []

    def __enter__(self) -> sdpa_backends:
        ctx = sdpa_kernel([BACKENDS[name] for name in self.backends], set_priority=self._priority)
        ctx.__enter__()
        self._contexts.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._contexts.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"sdpa_backends({', '.join(map(repr, self.backends))}, device={str(self.device)!r})"


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}, sm{major}{minor}"
    return device.type
