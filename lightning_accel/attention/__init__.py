"""Attention fast paths: choose SDPA backends, see which one ran, and route slow attention to the fused kernels.

One feature per module: :mod:`.backends` (:func:`sdpa_backends`), :mod:`.recorder` (:class:`SDPABackendRecorder`)
and :mod:`.fused` (:func:`use_fused_attention`). Hand-written attention materialises the score matrix; the fused
kernels tile it on chip. The manual, with the module map: ``docs/techniques/attention.md``.
"""

from __future__ import annotations

from lightning_accel import _compat

_compat.require_versions("the attention helpers", lightning=False)  # sdpa_kernel(set_priority=): torch 2.6

from lightning_accel.attention.backends import BACKENDS, available_sdpa_backends, sdpa_backends  # noqa: E402
from lightning_accel.attention.fused import FusedAttentionChanges, use_fused_attention  # noqa: E402
from lightning_accel.attention.recorder import SDPABackendRecorder  # noqa: E402
from lightning_accel.attention.rewrite import ATTENTION_FIX  # noqa: E402

__all__ = [
    "ATTENTION_FIX",
    "BACKENDS",
    "FusedAttentionChanges",
    "SDPABackendRecorder",
    "available_sdpa_backends",
    "sdpa_backends",
    "use_fused_attention",
]
