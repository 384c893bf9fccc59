"""The network structures the pipeline strategy splits: what runs as the embedding, the blocks and the head.

:func:`find_layout` recognises Hugging Face decoder LMs (``LlamaForCausalLM``-shaped, ``GPT2LMHeadModel``), litgpt
``GPT`` and nanoGPT-shaped models (token and position embeddings, an ``nn.ModuleList`` of blocks, a final norm and
a head); anything else describes itself with a :class:`PipelineLayout` returned from the LightningModule's
``pipeline_layout()``. Each recognised structure names its pieces as module paths relative to the network and says
how each is called (the per-block context: rotary embeddings, the causal mask), so a stage can run its share of the
network's own forward. Torch only: no Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PipelineLayout", "find_layout"]


@dataclass
class PipelineLayout:
    """How a network runs as a pipeline, for a structure the strategy does not recognise.

    ``embed(inputs) -> hidden``, each ``block(hidden) -> hidden`` of ``blocks``, ``head(hidden) -> logits``; all three
    must be submodules of the network, and together they must be the network's forward. Return it from a
    ``pipeline_layout(self)`` method of the LightningModule.
    """

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module


class _Layout:
    """A recognised structure: module paths (relative to the network) and how each piece is called."""

    name = "layout"

    def __init__(self, net: nn.Module, first: list[str], blocks: str, last: list[str]) -> None:
        self.net, self.first, self.blocks, self.last = net, first, blocks, last

    def block_list(self) -> nn.ModuleList:
        return self.net.get_submodule(self.blocks)  # type: ignore[return-value]

    def vocab(self) -> int:
        emb = self.net.get_submodule(self.first[0])
        return int(emb.num_embeddings) if isinstance(emb, nn.Embedding) else 16

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def context(self, h: torch.Tensor) -> dict[str, Any]:
        return {}

    def call_block(self, block: nn.Module, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        out = block(h, **ctx)  # what context() built (nothing by default); a tuple's first item is the hidden state
        return out[0] if isinstance(out, tuple) else out

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _HFLlama(_Layout):
    name = "Hugging Face decoder (embed_tokens → layers → norm → lm_head)"

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net, ["model.embed_tokens"], "model.layers", ["model.norm", "lm_head"])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net.model.embed_tokens(ids)

    def context(self, h: torch.Tensor) -> dict[str, Any]:
        from lightning_accel._compat import hf_causal_mask

        base = self.net.model
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        ctx: dict[str, Any] = {"position_ids": position_ids,
                               "attention_mask": hf_causal_mask(base.config, h, position_ids)}
        if getattr(base, "rotary_emb", None) is not None:
            ctx["position_embeddings"] = base.rotary_emb(h, position_ids=position_ids)
        return ctx

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.net.lm_head(self.net.model.norm(h))


class _HFGPT2(_Layout):
    name = "Hugging Face GPT-2 (wte + wpe → h → ln_f → lm_head)"

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net, ["transformer.wte", "transformer.wpe"], "transformer.h", ["transformer.ln_f", "lm_head"])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.net.transformer
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return t.drop(t.wte(ids) + t.wpe(pos))

    def context(self, h: torch.Tensor) -> dict[str, Any]:
        from lightning_accel._compat import hf_causal_mask

        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        return {"attention_mask": hf_causal_mask(self.net.config, h, position_ids)}

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.net.lm_head(self.net.transformer.ln_f(h))


class _LitGPT(_Layout):
    name = "litgpt GPT (wte → h → ln_f → lm_head)"

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net, ["transformer.wte"], "transformer.h", ["transformer.ln_f", "lm_head"])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.net.transformer.wte(ids)
        if self.net.config.scale_embeddings:
            x = x * torch.tensor(self.net.config.n_embd ** 0.5, dtype=x.dtype)
        return x

    def context(self, h: torch.Tensor) -> dict[str, Any]:
        t = h.shape[1]
        return {"cos": self.net.cos[:t].unsqueeze(0), "sin": self.net.sin[:t].unsqueeze(0)}

    def call_block(self, block: nn.Module, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return block(h, ctx["cos"], ctx["sin"], None, None, None)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.net.lm_head(self.net.transformer.ln_f(h))
        cap = self.net.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None else logits


_TOKEN = ("tok_emb", "wte", "embed_tokens", "tok_embeddings", "token_embedding", "embedding")
_POSITION = ("pos_emb", "wpe", "position_embedding", "pos_embedding")
_BLOCKS = ("blocks", "h", "layers")
_NORM = ("ln_f", "norm", "final_norm", "norm_f")
_HEAD = ("head", "lm_head", "output")


class _NanoGPT(_Layout):
    name = "nanoGPT-shaped (token + position embedding → blocks → norm → head)"

    def __init__(self, net: nn.Module, prefix: str, token: str, position: str | None, drop: str | None,
                 blocks: str, norm: str | None, head: str) -> None:
        first = [prefix + token] + ([prefix + position] if position else [])
        last = ([prefix + norm] if norm else []) + [head]
        super().__init__(net, first, prefix + blocks, last)
        self.position = prefix + position if position else None
        self.drop = prefix + drop if drop else None
        self.norm = prefix + norm if norm else None
        self.head_path = head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.net.get_submodule(self.first[0])(ids)
        if self.position:
            x = x + self.net.get_submodule(self.position)(torch.arange(ids.shape[1], device=ids.device))
        return self.net.get_submodule(self.drop)(x) if self.drop else x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm:
            h = self.net.get_submodule(self.norm)(h)
        return self.net.get_submodule(self.head_path)(h)


class _UserLayout(_Layout):
    name = "pipeline_layout()"

    def __init__(self, net: nn.Module, layout: PipelineLayout) -> None:
        names = {id(m): n for n, m in net.named_modules()}
        paths = [names.get(id(m)) for m in (layout.embed, layout.blocks, layout.head)]
        if None in paths or "" in paths:
            raise ValueError("pipeline_layout(): embed, blocks and head must each be a submodule of the network "
                             f"(found paths {paths})")
        super().__init__(net, [paths[0]], paths[1], [paths[2]])  # type: ignore[list-item]
        self.user = layout

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.user.embed(ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.user.head(h)


def _child(module: nn.Module, names: tuple[str, ...], kind: type | tuple[type, ...] = nn.Module) -> str | None:
    for name in names:
        sub = getattr(module, name, None)
        if isinstance(sub, kind):
            return name
    return None


def find_layout(net: nn.Module) -> _Layout:
    """The recognised structure of ``net``; ``ValueError`` naming what is supported and what to give instead."""
    cls = type(net).__name__
    base = getattr(net, "model", None)
    if (isinstance(getattr(net, "lm_head", None), nn.Module) and isinstance(base, nn.Module)
            and isinstance(getattr(base, "embed_tokens", None), nn.Embedding)
            and isinstance(getattr(base, "layers", None), nn.ModuleList)
            and isinstance(getattr(base, "norm", None), nn.Module) and hasattr(base, "config")):
        return _HFLlama(net)
    tr = getattr(net, "transformer", None)
    if cls.startswith("GPT2") and tr is not None and hasattr(net, "config"):
        return _HFGPT2(net)
    if type(net).__module__.startswith("litgpt") and tr is not None and hasattr(net, "cos"):
        if getattr(net.config, "rope_indices", None) is not None:
            raise ValueError(f"pipeline: litgpt {cls} with config.rope_indices (per-block rotary slices) is not "
                             "split automatically; describe it with pipeline_layout()")
        return _LitGPT(net)
    for prefix, holder in (("", net), ("transformer.", tr)):
        if not isinstance(holder, nn.Module):
            continue
        token = _child(holder, _TOKEN, nn.Embedding)
        blocks = _child(holder, _BLOCKS, nn.ModuleList)
        inner_head = _child(holder, _HEAD)
        head = _child(net, _HEAD) or (prefix + inner_head if inner_head else None)
        if token and blocks and head:
            return _NanoGPT(net, prefix, token, _child(holder, _POSITION, nn.Embedding),
                            _child(holder, ("drop", "dropout"), nn.Dropout), blocks, _child(holder, _NORM), head)
    raise ValueError(
        f"pipeline: cannot split {cls}: no recognised structure (Hugging Face decoder LM, GPT-2, litgpt GPT, or a "
        "token embedding + an nn.ModuleList of blocks named blocks/h/layers + a head named head/lm_head/output). "
        "Give a `pipeline_layout(self)` method on the LightningModule returning "
        "lightning_accel.strategies.pipeline.PipelineLayout(embed=..., blocks=..., head=...)")
