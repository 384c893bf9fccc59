"""The demo's LightningModule and LightningDataModule: a small GPT on synthetic Markov tokens."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_accel.data.memmap import INDEX_FILE, TokenMemmapDataset, pack_memmap, read_memmap_index
from lightning_accel.demo.data import markov_tokens
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
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.95),
        )


class DemoDataModule(pl.LightningDataModule):
    """Generates a Markov token stream (train and a held-out validation stream), packs it with ``pack_memmap`` and
    serves ``TokenMemmapDataset`` windows of it.

    The stream is written once (by local rank 0, in ``prepare_data``) to ``data_dir``, by default a folder in the
    system temp directory named after the stream's parameters, and reused by later runs with the same parameters.
    """

    def __init__(
        self,
        *,
        seq_len: int = 64,
        vocab_size: int = 256,
        batch_size: int = 32,
        train_tokens: int = 400_000,
        val_tokens: int = 40_000,
        num_workers: int = 0,
        seed: int = 0,
        data_dir: str | Path | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"DemoDataModule: batch_size must be >= 1, got {batch_size}")
        self.seq_len, self.vocab_size, self.batch_size = seq_len, vocab_size, batch_size
        self.train_tokens, self.val_tokens, self.num_workers, self.seed = train_tokens, val_tokens, num_workers, seed
        name = f"tokens-v{vocab_size}-n{train_tokens}+{val_tokens}-s{seed}"
        self.data_dir = (
            Path(data_dir) if data_dir is not None else Path(tempfile.gettempdir()) / "lightning-accel-demo" / name
        )
        self._train: TokenMemmapDataset | None = None
        self._val: TokenMemmapDataset | None = None

    def _packed(self, split: str, tokens: int) -> bool:
        folder = self.data_dir / split
        if not (folder / INDEX_FILE).is_file():
            return False
        try:
            return read_memmap_index(folder, "tokens")["num_tokens"] == tokens
        except (ValueError, FileNotFoundError, KeyError):
            return False

    def prepare_data(self) -> None:
        if self._packed("train", self.train_tokens) and self._packed("val", self.val_tokens):
            return
        # one chain (same transition table) so validation measures what training learns
        stream = markov_tokens(self.train_tokens + self.val_tokens, self.vocab_size, seed=self.seed)
        pack_memmap(stream[: self.train_tokens], self.data_dir / "train", kind="tokens", progress_bar=False)
        pack_memmap(stream[self.train_tokens :], self.data_dir / "val", kind="tokens", progress_bar=False)

    def setup(self, stage: str) -> None:
        if self._train is None:
            if not self._packed("train", self.train_tokens):  # used without a Trainer: prepare here
                self.prepare_data()
            self._train = TokenMemmapDataset(self.data_dir / "train", self.seq_len)
            self._val = TokenMemmapDataset(self.data_dir / "val", self.seq_len)

    def _loader(self, dataset: TokenMemmapDataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() runs before the dataloaders are asked for"
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)
