"""Losses that keep the largest tensor of a language model's step out of memory.

* :mod:`.linear_cross_entropy` — :func:`linear_cross_entropy` and :class:`LinearCrossEntropy`: the output head and
  the cross-entropy over chunks of tokens, the ``tokens x vocabulary`` logits never held (Liger Kernel's fused
  kernel on CUDA when installed).
* :mod:`.causal_lm` — :func:`use_fused_linear_cross_entropy`: a Hugging Face causal LM computes its training loss
  that way, checked against the model's own loss on the first batch.

Docs: docs/techniques/fused-cross-entropy.md. Nothing here imports Lightning or transformers.
"""

from __future__ import annotations

from lightning_accel.losses.causal_lm import FusedLinearCrossEntropyHandle, use_fused_linear_cross_entropy
from lightning_accel.losses.linear_cross_entropy import LinearCrossEntropy, default_chunk_tokens, linear_cross_entropy

__all__ = [
    "FusedLinearCrossEntropyHandle",
    "LinearCrossEntropy",
    "default_chunk_tokens",
    "linear_cross_entropy",
    "use_fused_linear_cross_entropy",
]
