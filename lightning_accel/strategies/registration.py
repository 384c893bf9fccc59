"""Registers lightning-accel's strategy strings with Lightning's ``StrategyRegistry``.

Each entry maps a string to a *factory* that imports the strategy's module only when a Trainer asks for it, so
``import lightning_accel`` imports no optional dependency (deepspeed) and touches no CUDA. Registration is a dict
insert; it is idempotent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["STRATEGIES", "register_strategies"]

#: name -> (module, factory function in it, description). Filled in as strategies land.
STRATEGIES: dict[str, tuple[str, str, str]] = {}


def _lazy_factory(module: str, factory: str) -> Callable[..., Any]:
    def build(**kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), factory)(**kwargs)

    build.__name__ = factory
    build.__qualname__ = factory
    return build


def register_strategies() -> list[str]:
    """Insert every string of :data:`STRATEGIES` into ``StrategyRegistry`` (if not there yet); returns the names."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (module, factory, description) in STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _lazy_factory(module, factory), description=description)
    return list(STRATEGIES)
