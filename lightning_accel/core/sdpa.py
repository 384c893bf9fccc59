"""Which scaled-dot-product-attention kernel a model really runs, seen at the dispatcher.

``torch.nn.functional.scaled_dot_product_attention`` picks a backend per call (flash, memory-efficient, cuDNN or
the math fallback that materialises the attention matrix) from the inputs, the device and the enabled backends.
The fused backends show up as the aten op the call dispatches to, which a ``TorchDispatchMode`` observes without
changing anything; the math fallback is a composite of matmuls and softmax with no op of its own, so the probe also
counts the Python-level calls with a ``TorchFunctionMode``: SDPA calls that reached no fused op ran the math kernel.
Used for one batch only: the modes cost a Python call per op.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SdpaBackendProbe"]

# aten op (overload packet name) -> backend
_BACKENDS: dict[str, str] = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "fused",
    "_scaled_dot_product_attention_math_for_mps": "math",
}


class _FusedOps(TorchDispatchMode):
    def __init__(self, calls: Counter[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        backend = _BACKENDS.get(func._overloadpacket.__name__)
        if backend is not None:
            self.calls[backend] += 1
        return func(*args, **(kwargs or {}))


class _SdpaCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.n += 1
        return func(*args, **(kwargs or {}))


class SdpaBackendProbe:
    """Context manager counting SDPA calls per backend.

    Example::

        with SdpaBackendProbe() as probe:
            model(x).sum().backward()
        probe.backend  # "flash", "efficient", "cudnn", "math" or None (no SDPA call)
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._function = _SdpaCalls()
        self._dispatch = _FusedOps(self.calls)

    def __enter__(self) -> SdpaBackendProbe:
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
        fused = sum(self.calls.values())
        if self._function.n > fused:
            self.calls["math"] += self._function.n - fused

    @property
    def backend(self) -> str | None:
        """The backend of most calls; ``"math"`` wins ties, since one math call is already the finding."""
        if not self.calls:
            return None
        top = max(self.calls.values())
        winners = [b for b, n in self.calls.items() if n == top]
        return "math" if "math" in winners else winners[0]
