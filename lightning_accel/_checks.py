"""The one integer-argument check of the package: a whole number at least some minimum, or one clear error.

``bool`` is not accepted as an integer (``window=True`` is a mistake, not ``window=1``). The error names the
component, the argument, the offending value and the fix, the way Lightning words its own argument errors::

    MFUMonitor(window=0): use an integer >= 1, e.g. window=20
    demo: --steps must be an integer >= 1, got 0

No torch, no Lightning: the framework-free ``core/`` uses it too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_int", "is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    owner: str,
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    optional: bool = False,
    example: int | None = None,
    flag: bool = False,
    unit: str = "",
) -> Any:
    """``value`` unchanged when it is an integer ``>= minimum`` (or ``None`` with ``optional``); else ``ValueError``.

    Args:
        owner: who takes the argument (``"MFUMonitor"``, ``"find_batch_size"``, ``"demo"``).
        name: the argument's name.
        value: what the user passed.
        minimum: the smallest allowed value.
        optional: ``None`` is allowed (it means a default).
        example: a good value, named in the message.
        flag: a command-line option: the message says ``--name`` (underscores as dashes).
        unit: what the integer counts (``"batches"``), named in the message.
    """
    if (optional and value is None) or (is_int(value) and value >= minimum):
        return value
    what = f"an integer >= {minimum}{f' ({unit})' if unit else ''}{' or None' if optional else ''}"
    if flag:
        raise ValueError(f"{owner}: --{name.replace('_', '-')} must be {what}, got {value!r}")
    hint = f", e.g. {name}={example}" if example is not None else ""
    raise ValueError(f"{owner}({name}={value!r}): use {what}{hint}")
