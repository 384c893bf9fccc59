"""Attention fast paths: choose SDPA backends, see which one ran, and route slow attention to the fused kernels.

One feature per module:

* :mod:`.backends` — :func:`sdpa_backends`, a context manager (and decorator) over
  ``torch.nn.attention.sdpa_kernel`` that allows or forbids backends by name (``"flash"``, ``"efficient"``,
  ``"cudnn"``, ``"math"``) and refuses, naming what the device has, a backend the device lacks;
  :func:`available_sdpa_backends`.
* :mod:`.recorder` — :class:`SDPABackendRecorder` counts which backend each ``scaled_dot_product_attention`` call
  actually ran, so a silent fall-back to the (slow, memory-hungry) math path can be named.
* :mod:`.fused` — :func:`use_fused_attention` switches Hugging Face models to the library's own SDPA attention
  (:mod:`.hf_switch`), makes ``nn.MultiheadAttention`` modules whose attention weights are never used run with
  ``need_weights=False`` (:mod:`.mha`, which lets them use the fused SDPA kernels), and rewrites the hand-written
  pattern ``softmax(q @ k^T * scale + mask) @ v`` (as Hugging Face eager, nanoGPT and timm write it) inside
  modules the user names into one ``F.scaled_dot_product_attention`` call (:mod:`.rewrite` over the lazy
  placeholders of :mod:`._lazy`); a rewrite that never fires says which op broke the pattern. It returns a
  :class:`FusedAttentionChanges` (the Autopilot's intervention is
  :class:`lightning_accel.callbacks.autopilot.fixes.FusedAttention`).

Why it matters: ``need_weights=True`` (``nn.MultiheadAttention``'s default!) and hand-written attention both
materialise the ``L x S`` score matrix in memory and run softmax as separate kernels; FlashAttention-style kernels
tile it in on-chip memory (Dao et al., 2022, "FlashAttention", arXiv:2205.14135).
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
