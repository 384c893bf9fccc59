"""Optional-dependency gates.

Every optional dependency (deepspeed, NVIDIA DALI, NVML, matplotlib, jsonargparse) is imported through
:func:`require` at the place it is used, never at ``import lightning_accel``. A missing one raises an
``ImportError`` that names the feature and the ``pip`` line that installs it.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "is_available", "require"]

#: import name -> (extra of lightning-accel that installs it, PyPI distribution)
EXTRAS: dict[str, tuple[str, str]] = {
    "deepspeed": ("deepspeed", "deepspeed"),
    "nvidia.dali": ("dali", "nvidia-dali-cuda120"),
    "pynvml": ("nvml", "nvidia-ml-py"),
    "matplotlib": ("plots", "matplotlib"),
    "jsonargparse": ("cli", "jsonargparse[signatures]"),
    "nbclient": ("notebooks", "nbclient"),
}


def is_available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` or raise an ImportError with the install line.

    Args:
        module: the import name, e.g. ``"nvidia.dali"``.
        feature: what needs it, e.g. ``"DALIImageDataModule"``; used in the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra, dist = EXTRAS.get(module, (None, module))
        hint = f"pip install 'lightning-accel[{extra}]'" if extra else f"pip install {dist}"
        raise ImportError(f"{feature} needs {dist} (import {module!r} failed: {err}). Install it: {hint}") from err
