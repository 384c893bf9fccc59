"""Synthetic token data the demo generates itself (nothing is downloaded).

Sequences come from a fixed random Markov chain over the vocabulary in which each token has a few likely
successors, so a model can learn it and the loss visibly falls below ``log(vocab_size)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["markov_tokens"]


def markov_tokens(num_tokens: int, vocab_size: int = 256, *, branching: int = 4, seed: int = 0) -> np.ndarray:
    """A stream of ``num_tokens`` tokens from a seeded Markov chain with ``branching`` successors per token."""
    if num_tokens < 2 or vocab_size < 2 or not 1 <= branching <= vocab_size:
        raise ValueError(
            f"markov_tokens: need num_tokens >= 2, vocab_size >= 2, 1 <= branching <= vocab_size; got "
            f"num_tokens={num_tokens}, vocab_size={vocab_size}, branching={branching}"
        )
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    choices = rng.integers(0, branching, size=num_tokens)
    out = np.empty(num_tokens, dtype=np.int64)
    out[0] = rng.integers(0, vocab_size)
    for i in range(1, num_tokens):  # ~1 µs a token: 1M tokens in about a second
        out[i] = successors[out[i - 1], choices[i]]
    return out
