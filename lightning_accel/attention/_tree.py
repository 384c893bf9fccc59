"""Walking the nested arguments of a call (lists, tuples, dict values), shared by the probe and the rewrite."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _flatten(item)
    else:
        yield obj
