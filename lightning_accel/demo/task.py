"""The demo's LightningModule and LightningDataModule: a small GPT on synthetic Markov tokens."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_accel.demo.data import TokenWindows, markov_tokens
from lightning_accel.demo.model import GPT, GPTConfig

__all__ = ["DemoDataModule", "GPTTask"]


class GPTTask(pl.LightningModule):
    """Next-token prediction with :class:`GPT`; logs ``train_loss`` and ``val_loss`` (nats per token)."""

    def __init__(self, config: GPTConfig | None = None, lr: float = 3e-3, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.lr = lr
        self.weight_decay = weight_decay
        self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, batch_size=batch[0].shape[0], sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=self.lr, betas=(0.9, 0.95))


class DemoDataModule(pl.LightningDataModule):
    """Generates a Markov token stream (train and a held-out validation stream) and serves windows of it."""

    def __init__(self, *, seq_len: int = 64, vocab_size: int = 256, batch_size: int = 32,
                 train_tokens: int = 400_000, val_tokens: int = 40_000, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"DemoDataModule: batch_size must be >= 1, got {batch_size}")
        self.seq_len, self.vocab_size, self.batch_size = seq_len, vocab_size, batch_size
        self.train_tokens, self.val_tokens, self.num_workers, self.seed = train_tokens, val_tokens, num_workers, seed
        self._train: TokenWindows | None = None
        self._val: TokenWindows | None = None

    def setup(self, stage: str) -> None:
        if self._train is None:
            # one chain (same transition table) so validation measures what training learns
            stream = markov_tokens(self.train_tokens + self.val_tokens, self.vocab_size, seed=self.seed)
            self._train = TokenWindows(stream[: self.train_tokens], self.seq_len)
            self._val = TokenWindows(stream[self.train_tokens:], self.seq_len)

    def _loader(self, dataset: TokenWindows | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() runs before the dataloaders are asked for"
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, drop_last=shuffle,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)
