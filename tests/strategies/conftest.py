"""Isolation for strategy tests: Lightning's launcher writes distributed variables into ``os.environ``.

An in-process fit (even on one device) leaves ``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
behind; a 2-process script started afterwards inherits ``LOCAL_RANK`` and then believes its processes were
launched externally, so rank 0 waits for a rank 1 nobody starts. Every test here starts without them and leaves
``os.environ`` as it found it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

_LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _clean_launch_environment() -> Iterator[None]:
    saved = dict(os.environ)
    for key in _LAUNCH_VARIABLES:
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)
