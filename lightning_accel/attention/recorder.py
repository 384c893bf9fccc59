"""Seeing which SDPA backend ran: :class:`SDPABackendRecorder` counts the fused kernels and the math fall-backs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lightning_accel import _compat
from lightning_accel._compat import TorchDispatchMode
from lightning_accel.attention.backends import BACKENDS

__all__ = ["SDPABackendRecorder"]

_FUSED_OPS: dict[str, str] = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
}


class _FusedOpCounter(TorchDispatchMode):
    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = counts
        self.fused_seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        backend = _FUSED_OPS.get(_compat.op_packet_name(func))  # forward ops only: backward ops have other names
        if backend is not None:
            self.counts[backend] += 1
            self.fused_seen += 1
        return func(*args, **(kwargs or {}))


class SDPABackendRecorder:
    """Counts which SDPA backend ran, while the ``with`` block runs.

    ``with SDPABackendRecorder() as rec: model(x)`` then ``rec.counts == {"flash": n, "efficient": n, "cudnn": n,
    "math": n}``: fused kernels are counted as the aten ops they dispatch to (forward calls; backward kernels are
    not counted again); ``math`` counts calls of ``torch.nn.functional.scaled_dot_product_attention`` that reached no
    fused op (the math path is a composite that decomposes into matmul/softmax), plus ``nn.MultiheadAttention``
    calls with ``need_weights=True`` (``F.multi_head_attention_forward`` then computes attention with explicit
    bmm + softmax and never calls SDPA). :attr:`calls` is the number of attention calls seen (SDPA calls plus those
    MHA calls).

    Limits: calls through a reference taken before the block (``from torch.nn.functional import
    scaled_dot_product_attention`` at import time) are seen only when they reach a fused op; code compiled by
    ``torch.compile`` is not seen (its kernels run outside the dispatcher); ``nn.MultiheadAttention``'s C++
    inference fast path (``_native_multi_head_attention``) is not seen. The dispatch mode adds Python work to every
    op while active: record a few steps, not a whole run.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {name: 0 for name in BACKENDS}
        self.calls = 0
        self._mode: _FusedOpCounter | None = None
        self._original: Callable[..., torch.Tensor] | None = None
        self._original_mha: Callable[..., Any] | None = None

    @property
    def math_fallback(self) -> bool:
        """Whether any attention call ran on the math path."""
        return self.counts["math"] > 0

    @property
    def backend(self) -> str | None:
        """The backend of most calls (``None`` without attention); ``"math"`` wins ties, since one math call is
        already what ``BottleneckDoctor``'s attention rule reports."""
        top = max(self.counts.values())
        if top == 0:
            return None
        winners = [name for name, n in self.counts.items() if n == top]
        return "math" if "math" in winners else winners[0]

    def __enter__(self) -> SDPABackendRecorder:
        mode = _FusedOpCounter(self.counts)
        original = F.scaled_dot_product_attention

        def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
            before = mode.fused_seen
            out = original(*args, **kwargs)
            self.calls += 1
            if mode.fused_seen == before:
                self.counts["math"] += 1
            return out

        original_mha = F.multi_head_attention_forward

        def counting_mha(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("need_weights", True):
                # the explicit bmm-softmax-bmm path: unfused, whatever the SDPA settings
                self.calls += 1
                self.counts["math"] += 1
            return original_mha(*args, **kwargs)

        self._mode, self._original, self._original_mha = mode, original, original_mha
        # nn.MultiheadAttention calls F.multi_head_attention_forward, which looks scaled_dot_product_attention up
        # in torch.nn.functional's globals: both are found through the module at call time
        F.scaled_dot_product_attention = counting_sdpa
        F.multi_head_attention_forward = counting_mha
        mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        F.scaled_dot_product_attention = self._original  # type: ignore[assignment]
        F.multi_head_attention_forward = self._original_mha  # type: ignore[assignment]
        self._mode = None

    def __repr__(self) -> str:
        return f"SDPABackendRecorder(calls={self.calls}, counts={self.counts})"
