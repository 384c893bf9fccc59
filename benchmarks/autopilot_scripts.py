"""Naive real-model training scripts for the Autopilot benchmark: each is written the way a new user writes it, with
several causes of slowness at once, and every cause is one knob a person tuning by hand would turn.

The causes (vanilla = :data:`VANILLA`):

* ``attention="eager"``: Hugging Face models built with ``attn_implementation="eager"`` (the hand-written
  ``softmax(q @ k^T) @ v``); the demo GPT and litgpt's GPT already call SDPA, so this knob does not exist for them;
* ``precision="32-true"``: Lightning's default precision (nothing passed to the Trainer);
* ``optimizer="single"``: ``AdamW(foreach=False)``, the per-tensor for-loop step;
* ``micro=(4, 8)``: micro-batch 4 × ``accumulate_grad_batches=8`` (global batch 32);
* ``num_workers=0`` with a costly dataset: every sample is tokenised on access by a small pure-Python BPE (byte
  pairs merged by a fixed merge table), about 1 ms per sample on the 2-core benchmark VM.

The hand-tuned configuration (:data:`HAND_TUNED`) turns the same knobs: SDPA, micro-batch 32 × 1 (same global
batch), ``AdamW(foreach=True)``, one loader worker, in fp32 and in ``bf16-mixed``; :func:`grid` lists every
combination of the knobs' values (:data:`GRID`), the exhaustive search the Autopilot is compared with.

``bert_cls`` is the classification script: a Hugging Face BERT sequence classifier on eager attention, two
classes read off the tokens, validated four times an epoch on held-out samples (``val_loss``).

Models are tiny (CPU-sized) and built from config objects: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ = 512, 64
GLOBAL_BATCH = 32

#: the knobs as the naive script sets them
VANILLA: dict[str, Any] = {
    "attention": "eager",
    "precision": "32-true",
    "optimizer": "single",
    "micro": (4, 8),
    "num_workers": 0,
}
#: what a person tuning by hand sets (precision is tried both ways, the better counts)
HAND_TUNED: dict[str, Any] = {"attention": "sdpa", "optimizer": "foreach", "micro": (32, 1), "num_workers": 1}
#: every value of each knob the exhaustive grid sets (the knobs the Autopilot may change in these scripts)
GRID: dict[str, tuple[Any, ...]] = {
    "attention": ("eager", "sdpa"),
    "precision": ("32-true", "bf16-mixed"),
    "optimizer": ("single", "foreach", "fused"),
    "micro": ((4, 8), (8, 4), (16, 2), (32, 1)),
    "num_workers": (0, 1, 2),
}


#: the Autopilot's fixes whose effect :func:`trained_config` reads back as one of :data:`GRID`'s knobs; a kept fix
#: outside these puts the trained configuration outside the grid
GRID_FIXES = frozenset(
    {"micro_batch", "precision", "optimizer_foreach", "optimizer_fused", "fused_attention", "dataloader"}
)


def trained_config(trainer: pl.Trainer, module: NaiveLM, micro: int, kept: Sequence[str] = ()) -> dict[str, Any]:
    """The knobs (keys of :data:`VANILLA`) as the fit trained with them, read back from the trainer after it, so a
    search's kept set is named as a grid point: ``micro`` is the micro-batch the training loader gave, ``kept`` the
    names of the Autopilot's kept fixes (any outside :data:`GRID_FIXES` lands under ``"other"``)."""
    dtype = getattr(trainer.precision_plugin, "compute_dtype", None)  # AutoMixedPrecision: what it resolved to
    names = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", torch.float32: "32-true"}
    precision = names.get(dtype, str(trainer.precision))
    group = trainer.optimizers[0].param_groups[0]
    optimizer = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "single"
    loader = trainer.train_dataloader
    attention = module.model.config._attn_implementation if module.script.hf else VANILLA["attention"]
    config = {
        "attention": attention,
        "precision": precision,
        "optimizer": optimizer,
        "micro": (micro, GLOBAL_BATCH // max(1, micro)),
        "num_workers": int(getattr(loader, "num_workers", 0)),
    }
    other = sorted(set(kept) - GRID_FIXES)
    return {**config, "other": other} if other else config


def grid(script: Script, knobs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every combination of :data:`GRID`'s values for ``knobs`` (all of them when empty), the others as
    :data:`VANILLA` sets them; ``attention`` only where the script has an eager attention to replace."""
    unknown = sorted(set(knobs) - set(GRID))
    if unknown:
        raise ValueError(f"grid knobs {unknown!r}: not among {sorted(GRID)}")
    chosen = [k for k in GRID if (not knobs or k in knobs) and (k != "attention" or script.hf)]
    return [dict(VANILLA, **dict(zip(chosen, values))) for values in itertools.product(*(GRID[k] for k in chosen))]


# ------------------------------------------------------------------------------------------------ the costly dataset
def _merge_table(seed: int = 0, merges: int = 400) -> dict[tuple[int, int], int]:
    """A fixed BPE-style merge table: ``merges`` byte pairs (over the text's alphabet) → new ids 256, 257, …"""
    g = torch.Generator().manual_seed(seed)
    letters = [ord(c) for c in "etaoinshrdlu "]
    table: dict[tuple[int, int], int] = {}
    ids = list(letters)
    while len(table) < merges:
        a, b = (ids[int(i)] for i in torch.randint(0, len(ids), (2,), generator=g))
        if (a, b) not in table:
            table[(a, b)] = 256 + len(table)
            ids.append(256 + len(table) - 1)
    return table


def tokenize(text: str, table: dict[tuple[int, int], int], passes: int) -> list[int]:
    """Byte-level BPE as a tokenizer runs it, in pure Python: bytes, then ``passes`` left-to-right merge passes."""
    ids = list(text.encode())
    for _ in range(passes):
        out: list[int] = []
        i = 0
        while i < len(ids):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) in table:
                out.append(table[(ids[i], ids[i + 1])])
                i += 2
            else:
                out.append(ids[i])
                i += 1
        ids = out
    return ids


class TokenizingDataset(Dataset):
    """``n`` raw text samples tokenised on every access (``__getitem__``), returning ``seq + 1`` token ids.

    The texts are generated once (random words over a small alphabet, seeded); the cost per sample is the
    tokenisation: ``chars`` characters × ``passes`` merge passes (~1 ms at the defaults on the benchmark VM).
    """

    def __init__(self, n: int, seed: int, *, chars: int = 2000, passes: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        alphabet = "etaoinshrdlu "
        codes = torch.randint(0, len(alphabet), (n, chars), generator=g).tolist()
        self.texts = ["".join(alphabet[c] for c in row) for row in codes]
        self.table, self.passes = _merge_table(), passes

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> torch.Tensor:
        ids = tokenize(self.texts[i], self.table, self.passes)[: SEQ + 1]
        ids += [0] * (SEQ + 1 - len(ids))
        return torch.tensor(ids, dtype=torch.long) % VOCAB


class LabelledTokens(Dataset):
    """:class:`TokenizingDataset`'s samples (``SEQ`` ids) with a class: whether more than five ids come from the
    merge table's upper half (about half the samples), so the label is learnable from the tokens."""

    def __init__(self, n: int, seed: int) -> None:
        self.tokens = TokenizingDataset(n, seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokens[i][:SEQ]
        return ids, ((ids >= VOCAB // 2).sum() > 5).long()


# ------------------------------------------------------------------------------------------------ the models
def hf_gpt2(attention: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ + 1,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation=attention,
        )
    )


def hf_llama(attention: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ + 1,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            attn_implementation=attention,
        )
    )


def litgpt_gpt(attention: str) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(
        Config.from_name(
            "pythia-14m",
            n_layer=2,
            n_embd=128,
            n_head=4,
            block_size=SEQ,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            intermediate_size=512,
        )
    )


def hf_bert_classifier(attention: str) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=SEQ,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation=attention,
        )
    )


def demo_gpt(attention: str) -> nn.Module:
    from lightning_accel.demo.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, d_model=128))


@dataclass
class Script:
    name: str
    what: str
    build: Callable[[str], nn.Module]
    hf: bool  # Hugging Face: forward(input_ids=, labels=) returns .loss; has an eager attention to fix
    needs: str = ""
    classify: bool = False  # a sequence classifier with a validation loop (NaiveClassifier), not a language model

    def missing(self) -> str | None:
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"needs {self.needs}"
        return None


SCRIPTS: dict[str, Script] = {
    "gpt2": Script(
        "gpt2", "HF GPT-2 (2 layers, d 128, seq 64, vocab 512), eager attention", hf_gpt2, True, "transformers"
    ),
    "llama": Script(
        "llama",
        "HF Llama (2 layers, d 128, GQA 4/2 heads, seq 64, vocab 512), eager attention",
        hf_llama,
        True,
        "transformers",
    ),
    "litgpt": Script(
        "litgpt",
        "litgpt GPT from Config (pythia-14m shrunk: 2 layers, d 128, seq 64), SDPA already",
        litgpt_gpt,
        False,
        "litgpt",
    ),
    "demo": Script(
        "demo", "the demo GPT (lightning_accel.demo, 2 layers, d 128, seq 64), SDPA already", demo_gpt, False
    ),
    "bert_cls": Script(
        "bert_cls",
        "HF BERT sequence classifier (2 layers, d 128, seq 64, 2 classes), eager attention, validated",
        hf_bert_classifier,
        True,
        "transformers",
        classify=True,
    ),
}


class NaiveLM(pl.LightningModule):
    """The LightningModule a user writes around the model: ``batch_size`` attribute, its own ``train_dataloader``
    over the tokenising dataset, ``AdamW`` with the for-loop step (``optimizer="single"``)."""

    def __init__(
        self, script: Script, *, attention: str, micro: int, num_workers: int, optimizer: str, samples: int
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.script = script
        self.model = script.build(attention if script.hf else "sdpa")
        self.batch_size, self.num_workers, self.optimizer_impl, self.samples = micro, num_workers, optimizer, samples

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.script.hf:
            return self.model(input_ids=tokens, labels=tokens).loss
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TokenizingDataset(self.samples, seed=1),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        flags = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
        return torch.optim.AdamW(self.parameters(), lr=1e-3, **flags[self.optimizer_impl])


class NaiveClassifier(NaiveLM):
    """The same user's classifier: :class:`LabelledTokens` batches, and a ``validation_step`` logging ``val_loss``
    over held-out samples (the Trainer validates four times an epoch: :func:`trainer_arguments`)."""

    def loss(self, batch: Any) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), batch_size=len(batch[0]))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            LabelledTokens(self.samples, seed=1),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(LabelledTokens(64, seed=777), batch_size=16)


def trainer_arguments(script: Script) -> dict[str, Any]:
    """The Trainer's validation settings as the script's author wrote them: none for the language models, four
    validations an epoch of two held-out batches for the classifier."""
    if script.classify:
        return {"val_check_interval": 0.25, "limit_val_batches": 2, "num_sanity_val_steps": 0}
    return {"limit_val_batches": 0, "num_sanity_val_steps": 0}


def example_batch(script: Script, n: int = 4, seed: int = 3) -> Any:
    """``n`` samples collated as the script's loader collates them."""
    if script.classify:
        data = LabelledTokens(n, seed=seed)
        ids, labels = zip(*(data[i] for i in range(n)))
        return torch.stack(ids), torch.stack(labels)
    data = TokenizingDataset(n, seed=seed)
    return torch.stack([data[i] for i in range(n)])


def build(script: Script, config: dict[str, Any], *, samples: int) -> tuple[NaiveLM, dict[str, Any]]:
    """The module and the Trainer arguments of ``config`` (keys of :data:`VANILLA`)."""
    micro, accumulate = config["micro"]
    if micro * accumulate != GLOBAL_BATCH:
        raise ValueError(f"micro={config['micro']!r}: the global batch must stay {GLOBAL_BATCH}")
    module = (NaiveClassifier if script.classify else NaiveLM)(
        script,
        attention=config["attention"],
        micro=micro,
        num_workers=config["num_workers"],
        optimizer=config["optimizer"],
        samples=samples,
    )
    kwargs: dict[str, Any] = {"accumulate_grad_batches": accumulate}
    if config["precision"] != "32-true":  # the naive script passes nothing: Lightning's default
        kwargs["precision"] = config["precision"]
    return module, kwargs


def heldout_batches(n: int = 4, batch: int = 16, script: Script | None = None) -> list[Any]:
    """Fixed held-out batches (another seed), tokenised once; labelled for a classifier."""
    if script is not None and script.classify:
        return [example_batch(script, batch, seed=12345 + i) for i in range(n)]
    data = TokenizingDataset(n * batch, seed=12345)
    return [torch.stack([data[i * batch + j] for j in range(batch)]) for i in range(n)]


def heldout_loss(module: NaiveLM, batches: list[Any]) -> float:
    """Mean fp32 loss over the held-out batches (outside any autocast)."""
    was = module.training
    module.eval()
    with torch.no_grad():
        value = sum(float(module.loss(b)) for b in batches) / len(batches)
    module.train(was)
    return value
