"""Tiny versions of the models people train, built from config objects (no weights, no download, no hub).

Each :class:`Family` builds its model, a batch, the loss (Hugging Face models compute theirs from ``labels=``), and
names the library's transformer block class (what ``ActivationCheckpointing(modules=[...])`` gets). The decoders
also give the numbers of the ``6·N + 12·L·d·T`` FLOPs formula.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, D, LAYERS, HEADS = 128, 32, 64, 2, 4

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAVE_LITGPT = importlib.util.find_spec("litgpt") is not None
NO_TRANSFORMERS = "needs transformers: pip install 'lightning-accel[dev]'"
NO_LITGPT = (
    "needs litgpt's model code: pip install --no-deps litgpt (its own dependency pins — lightning>=2.6.1, "
    "torch>=2.7, psutil==7.2.2, huggingface-hub<1.4 — conflict with transformers 5.x)"
)


@dataclasses.dataclass
class Family:
    """One model family: how to build it, feed it and read its loss."""

    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[torch.Generator], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    block: Callable[[], type]
    decoder: bool = True  # the 6N + 12LdT formula applies
    needs: str = "transformers"


# --- nanoGPT-style (Karpathy's model.py, manual attention path) -----------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, flash: bool = False) -> None:
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.attn_dropout = nn.Dropout(0.0)
        self.flash = flash
        self.register_buffer("bias", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, flash: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(D), CausalSelfAttention(flash)
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, flash: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.h = nn.ModuleList(Block(flash) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- builders -------------------------------------------------------------------------------------------------------


def _tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g)}


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss  # the library's own shifted loss


def _logits_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    idx = batch["input_ids"]
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def llama(attn: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=2 * D,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation=attn,
        )
    )


def gpt2(attn: str = "sdpa") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=D,
            n_layer=LAYERS,
            n_head=HEADS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation=attn,
        )
    )


def bert(attn: str = "sdpa") -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * D,
            max_position_embeddings=SEQ,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=attn,
        )
    )


def vit(attn: str = "sdpa") -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            image_size=32,
            patch_size=8,
            num_channels=3,
            hidden_size=D,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * D,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=attn,
        )
    )


def litgpt_gpt() -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    # a named config (Pythia: parallel residual, rotary, biased projections), shrunk
    return GPT(
        Config.from_name(
            "pythia-14m",
            n_layer=LAYERS,
            n_embd=D,
            n_head=HEADS,
            block_size=SEQ,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            intermediate_size=2 * D,
        )
    )


def _bert_sample(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
    length = int(torch.randint(SEQ // 2, SEQ + 1, (1,), generator=g))
    mask = (torch.arange(SEQ) < length).long()  # right padding, as a tokenizer pads
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 3, (), generator=g)}


def _vit_sample(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": torch.randint(0, 10, (), generator=g)}


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _block(module: str, name: str) -> Callable[[], type]:
    def get() -> type:
        return getattr(importlib.import_module(module), name)

    return get


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama", llama, _tokens, _lm_loss, _block("transformers.models.llama.modeling_llama", "LlamaDecoderLayer")
    ),
    "gpt2": Family("gpt2", gpt2, _tokens, _lm_loss, _block("transformers.models.gpt2.modeling_gpt2", "GPT2Block")),
    "bert": Family(
        "bert",
        bert,
        _bert_sample,
        _hf_loss,
        _block("transformers.models.bert.modeling_bert", "BertLayer"),
        decoder=False,
    ),
    "vit": Family(
        "vit", vit, _vit_sample, _hf_loss, _block("transformers.models.vit.modeling_vit", "ViTLayer"), decoder=False
    ),
    "litgpt": Family("litgpt", litgpt_gpt, _tokens, _logits_loss, _block("litgpt.model", "Block"), needs="litgpt"),
    "nanogpt": Family("nanogpt", NanoGPT, _tokens, _logits_loss, lambda: Block, needs=""),
}


def skip_reason(family: Family) -> str | None:
    """Why this family cannot run here (a missing package), or None."""
    if family.needs == "transformers" and not HAVE_TRANSFORMERS:
        return NO_TRANSFORMERS
    if family.needs == "litgpt" and not HAVE_LITGPT:
        return NO_LITGPT
    return None


def matmul_params(model: nn.Module) -> int:
    """N of the formula: parameters that take part in a matmul (embedding lookups do no FLOPs; a token embedding
    tied to the output projection counts once, as the projection)."""
    linear_weights = {id(m.weight) for m in model.modules() if hasattr(m, "weight") and not isinstance(m, nn.Embedding)}
    lookups = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in lookups)


def formula_flops_per_batch(model: nn.Module, batch_size: int) -> float:
    from lightning_accel import transformer_flops_per_token

    return transformer_flops_per_token(matmul_params(model), LAYERS, D, SEQ) * batch_size * SEQ


class _Samples(Dataset):
    def __init__(self, family: Family, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [family.sample(g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


class Task(pl.LightningModule):
    """A LightningModule around one family's model, as a user writes it; ``batch_size`` is what tuners set."""

    def __init__(
        self,
        family: Family | str,
        batch_size: int = 4,
        samples: int = 64,
        lr: float = 1e-3,
        model: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.family = FAMILIES[family] if isinstance(family, str) else family
        torch.manual_seed(0)
        self.model = model if model is not None else self.family.build()
        self.batch_size, self.samples, self.lr = batch_size, samples, lr
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.family.loss(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Samples(self.family, self.samples, seed=1), batch_size=self.batch_size)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
