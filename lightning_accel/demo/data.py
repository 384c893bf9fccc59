"""Synthetic token data the demo generates itself (nothing is downloaded).

Sequences come from a fixed random Markov chain over the vocabulary in which each token has a few likely
successors, so a model can learn it and the loss visibly falls below ``log(vocab_size)``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["TokenWindows", "markov_tokens"]


def markov_tokens(num_tokens: int, vocab_size: int = 256, *, branching: int = 4, seed: int = 0) -> np.ndarray:
    """A stream of ``num_tokens`` tokens from a seeded Markov chain with ``branching`` successors per token."""
    if num_tokens < 2 or vocab_size < 2 or not 1 <= branching <= vocab_size:
        raise ValueError(f"markov_tokens: need num_tokens >= 2, vocab_size >= 2, 1 <= branching <= vocab_size; got "
                         f"num_tokens={num_tokens}, vocab_size={vocab_size}, branching={branching}")
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    choices = rng.integers(0, branching, size=num_tokens)
    out = np.empty(num_tokens, dtype=np.int64)
    out[0] = rng.integers(0, vocab_size)
    for i in range(1, num_tokens):  # ~1 µs a token: 1M tokens in about a second
        out[i] = successors[out[i - 1], choices[i]]
    return out


class TokenWindows(Dataset):
    """Non-overlapping ``(input, next-token target)`` windows of ``seq_len`` over an in-memory token stream."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int) -> None:
        self.tokens = torch.as_tensor(tokens, dtype=torch.long)
        self.seq_len = seq_len
        if seq_len < 1 or len(self.tokens) < seq_len + 1:
            raise ValueError(f"TokenWindows: {len(self.tokens)} tokens cannot make one window of seq_len={seq_len}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        chunk = self.tokens[start: start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]
