"""The registry of private names and the version floor: what every other module of ``_compat`` builds on.

:class:`PrivateName` records one private name with the versions it was checked on and its users; :func:`resolve`
finds the object that must carry it (``tests/test_compat.py`` checks each). :func:`require_versions` raises at the
import of a component on a torch or Lightning below the floor. The policy: ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch

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
