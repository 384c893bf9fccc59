"""The network side of pipeline parallelism (torch only, no Lightning): the structures the strategy recognises
(:func:`find_layout`) or is given (:class:`PipelineLayout`), the stages cut from them (:class:`_Stage`), the default
batch and loss, and the measured cost of each block (:func:`measure_stage_costs`). See docs/techniques/pipeline.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PipelineLayout", "default_pipeline_batch", "find_layout", "measure_stage_costs", "token_cross_entropy"]


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

    def synthetic_ids(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """Token ids of ``shape`` (seeded) when the first piece is an ``nn.Embedding``; ``None`` for any other
        input, whose dtype and shape only a real batch can give."""
        emb = self.net.get_submodule(self.first[0])
        if not isinstance(emb, nn.Embedding):
            return None
        return torch.randint(0, int(emb.num_embeddings), shape, generator=torch.Generator().manual_seed(0))

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
        ctx: dict[str, Any] = {
            "position_ids": position_ids,
            "attention_mask": hf_causal_mask(base.config, h, position_ids),
        }
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
            x = x * torch.tensor(self.net.config.n_embd**0.5, dtype=x.dtype)
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


_TOKEN = (
    "tok_emb",
    "wte",
    "embed_tokens",
    "tok_embeddings",
    "token_embedding",
    "embedding",
    "embed",
    "tok_embed",
    "token_emb",
)
_POSITION = ("pos_emb", "wpe", "position_embedding", "pos_embedding")
_BLOCKS = ("blocks", "h", "layers")
_NORM = ("ln_f", "norm", "final_norm", "norm_f")
_HEAD = ("head", "lm_head", "output")


class _NanoGPT(_Layout):
    name: str = "nanoGPT-shaped (token + position embedding → blocks → norm → head)"

    def __init__(
        self,
        net: nn.Module,
        prefix: str,
        token: str,
        position: str | None,
        drop: str | None,
        blocks: str,
        norm: str | None,
        head: str,
    ) -> None:
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
            raise ValueError(
                "pipeline_layout(): embed, blocks and head must each be a submodule of the network "
                f"(found paths {paths})"
            )
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


def find_layout(net: nn.Module, inputs: torch.Tensor | None = None) -> _Layout:
    """The recognised structure of ``net``; ``ValueError`` naming what is supported and what to give instead.

    Hugging Face decoders and litgpt ``GPT`` by their types; any other network by its structure
    (:func:`_structural_layout`: embedding(s) → an ``nn.ModuleList`` of repeated blocks → norm → head, found by type
    and by the order the network's own forward calls them on ``inputs``, its first batch); failing that, by the
    attribute names nanoGPT-shaped models use (``tok_emb``/``wte``, ``blocks``/``h``/``layers``, ``head``/``lm_head``),
    a hint where the forward cannot be run.
    """
    cls = type(net).__name__
    base = getattr(net, "model", None)
    if (
        isinstance(getattr(net, "lm_head", None), nn.Module)
        and isinstance(base, nn.Module)
        and isinstance(getattr(base, "embed_tokens", None), nn.Embedding)
        and isinstance(getattr(base, "layers", None), nn.ModuleList)
        and isinstance(getattr(base, "norm", None), nn.Module)
        and hasattr(base, "config")
    ):
        return _HFLlama(net)
    tr = getattr(net, "transformer", None)
    if cls.startswith("GPT2") and tr is not None and hasattr(net, "config"):
        return _HFGPT2(net)
    if type(net).__module__.startswith("litgpt") and tr is not None and hasattr(net, "cos"):
        if getattr(net.config, "rope_indices", None) is not None:
            raise ValueError(
                f"pipeline: litgpt {cls} with config.rope_indices (per-block rotary slices) is not "
                "split automatically; describe it with pipeline_layout()"
            )
        return _LitGPT(net)
    found = _structural_layout(net, inputs)
    if found is not None:
        return found
    for prefix, holder in (("", net), ("transformer.", tr)):
        if not isinstance(holder, nn.Module):
            continue
        token = _child(holder, _TOKEN, nn.Embedding)
        blocks = _child(holder, _BLOCKS, nn.ModuleList)
        inner_head = _child(holder, _HEAD)
        head = _child(net, _HEAD) or (prefix + inner_head if inner_head else None)
        if token and blocks and head:
            return _NanoGPT(
                net,
                prefix,
                token,
                _child(holder, _POSITION, nn.Embedding),
                _child(holder, ("drop", "dropout"), nn.Dropout),
                blocks,
                _child(holder, _NORM),
                head,
            )
    raise ValueError(
        f"pipeline: cannot split {cls}: no recognised structure (Hugging Face decoder LM, GPT-2, litgpt GPT, or, "
        "found by type and by the order its forward calls them on the first batch: nn.Embedding(s) → an "
        "nn.ModuleList of blocks of one type → an optional norm → a head, on the network or one child of it). "
        "Give a `pipeline_layout(self)` method on the LightningModule returning "
        "lightning_accel.strategies.pipeline.PipelineLayout(embed=..., blocks=..., head=...)"
    )


def _repeated_blocks(net: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(holder, blocks): the ``nn.ModuleList`` of blocks of one type holding the most parameters, a direct child of
    ``net`` or of one of its children; block names (``blocks``, ``h``, ``layers``) only break ties."""
    found = []
    for holder in [net, *(c for c in net.children() if not isinstance(c, nn.ModuleList))]:
        for name, child in holder.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            if len({type(b) for b in child}) != 1 or not any(True for _ in child.parameters()):
                continue
            size = sum(p.numel() for p in child.parameters())
            found.append((size, name in _BLOCKS, holder, child))
    if not found:
        return None
    _, _, holder, blocks = max(found, key=lambda f: (f[0], f[1]))
    return holder, blocks


def _structural_layout(net: nn.Module, inputs: torch.Tensor | None) -> _Layout | None:
    """embedding(s) → repeated blocks → norm → head, found by type and by the network's own forward on
    ``inputs`` (token ids; without them, seeded ids over the first ``nn.Embedding``'s vocabulary), whatever the
    attributes are called; ``None`` when the forward is not that (the caller then tries names, then refuses).

    The forward must call, in this order: one module on the input itself (an ``nn.Embedding`` of the
    tokens, or a stem on features or images), at most one ``nn.Embedding`` of positions (on ``arange(T)``) and one
    ``nn.Dropout``; every block of the list; an optional norm and a head (any modules). The split check then runs
    the composition against the forward."""
    found = _repeated_blocks(net)
    if found is None:
        return None
    holder, blocks = found
    if inputs is None:
        emb = next((m for m in holder.children() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            return None
        inputs = torch.randint(0, int(emb.num_embeddings), (2, 8), generator=torch.Generator().manual_seed(0))
    x = inputs.to(next((p.device for p in net.parameters() if p.device.type != "meta"), inputs.device))
    watch = [m for m in holder.children() if not isinstance(m, nn.ModuleList)] + list(blocks)
    if holder is not net:
        watch += [m for m in net.children() if m is not holder]
    calls: list[tuple[nn.Module, tuple]] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args))) for m in watch]
    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            net(x)
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
        return None  # not a forward of these inputs: the names, then the error, say what to do
    finally:
        for handle in handles:
            handle.remove()
        net.train(was)
    order = [m for m, _ in calls]
    start = next((i for i, m in enumerate(order) if m is blocks[0]), None)
    n = len(blocks)
    if start is None or len(order) < start + n or any(a is not b for a, b in zip(order[start : start + n], blocks)):
        return None
    pre, post = calls[:start], order[start + n :]
    if not 1 <= len(post) <= 2:
        return None  # nothing, or more than a norm and a head, after the blocks
    token = position = drop = None
    for m, args in pre:
        arg = args[0] if args else None
        if token is None and _same(arg, x) and any(True for _ in m.parameters()):
            token = m  # an nn.Embedding of token ids, or a stem on features or images (a Linear, a convolution)
        elif isinstance(m, nn.Embedding) and position is None and _is_positions(arg, x.shape[1] if x.dim() > 1 else 0):
            position = m
        elif isinstance(m, nn.Dropout) and drop is None:
            drop = m
        else:
            return None
    if token is None:
        return None
    path = {id(m): name for name, m in net.named_modules()}
    blocks_path = path[id(blocks)]
    layout = _NanoGPT(
        net,
        "",
        path[id(token)],
        path[id(position)] if position is not None else None,
        path[id(drop)] if drop is not None else None,
        blocks_path,
        path[id(post[0])] if len(post) == 2 else None,
        path[id(post[-1])],
    )
    layout.name = (
        f"{path[id(token)]} → {n} blocks ({blocks_path}) → "
        + (f"{path[id(post[0])]} → " if len(post) == 2 else "")
        + f"{path[id(post[-1])]}, found by its forward"
    )
    return layout


def _same(a: Any, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and (a is b or (a.shape == b.shape and bool(torch.equal(a, b))))


def _is_positions(a: Any, length: int) -> bool:
    """``arange(length)`` (with a leading batch dimension of 1 or not)."""
    if not isinstance(a, torch.Tensor) or a.is_floating_point() or a.numel() != length or length == 0:
        return False
    return bool(torch.equal(a.reshape(-1).cpu(), torch.arange(length)))


class _Offstage(nn.Module):
    """Stands in for a module another pipeline rank holds (keeps the original names of this rank's parameters)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module lives on another pipeline stage")


class _Stage(nn.Module):
    """One pipeline stage: its blocks, plus the embedding (first) or the final norm and head (last)."""

    def __init__(self, layout: _Layout, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "layout", layout)  # not a submodule: only this stage's parts are
        self.first, self.last = first, last
        allb = layout.block_list()
        self.blocks = nn.ModuleList(allb[i] for i in blocks)
        self.parts = nn.ModuleList(
            ([layout.net.get_submodule(p) for p in layout.first] if first else [])
            + ([layout.net.get_submodule(p) for p in layout.last] if last else [])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layout.embed(x) if self.first else x
        ctx = self.layout.context(h)
        for block in self.blocks:
            h = self.layout.call_block(block, h, ctx)
        return self.layout.head(h) if self.last else h


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the network returned {type(output).__name__}, not logits")


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens (``-100`` targets ignored), in fp32 like Hugging Face's LM loss."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100)


def _shift_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``ids`` at full length: position ``i`` predicts ``ids[i+1]``, the last is ignored."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def default_pipeline_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of a batch: ``(x, y)`` as given; ``ids`` / ``(ids,)`` / ``{"input_ids": ids}``: the ids
    and the ids shifted by one (Hugging Face's ``labels=ids``)."""
    if isinstance(batch, dict) and "input_ids" in batch:
        ids, labels = batch["input_ids"], batch.get("labels", batch["input_ids"])
        return ids, _shift_targets(labels)
    if isinstance(batch, torch.Tensor):
        return batch, _shift_targets(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 1 and isinstance(batch[0], torch.Tensor):
        return batch[0], _shift_targets(batch[0])
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(b, torch.Tensor) for b in batch):
        return batch[0], batch[1]
    raise ValueError(
        f"pipeline: cannot read (inputs, targets) from a batch of type {type(batch).__name__}; give the "
        "LightningModule a `pipeline_batch(self, batch)` method returning (inputs, targets)"
    )


def measure_stage_costs(
    layout: _Layout,
    device: torch.device,
    *,
    inputs: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    shape: tuple[int, int] = (2, 8),
    reps: int = 3,
) -> tuple[float, list[float], float]:
    """Forward + backward time (µs, the median of ``reps`` after one warm-up) of the embedding, of every block and
    of the head with the loss, on ``device``.

    The batch is ``inputs`` / ``targets`` (what goes into the first stage and the last stage's target: the strategy
    passes one micro-batch of the module's own first batch, so float inputs, images and any shape are measured as
    they train) and ``loss(logits, targets)`` (default: :func:`token_cross_entropy`). Without ``inputs``, a seeded
    batch of ``shape`` token ids (next-token targets) for a network whose first piece is an ``nn.Embedding``. What
    is not a block stays on the device during the measurement, the blocks go there one at a time (and everything
    goes back after), so a model whose blocks do not fit the device together can still be measured.
    """
    if inputs is None:
        ids = layout.synthetic_ids(shape)
        if ids is None:
            raise ValueError(
                f"measure_stage_costs: {type(layout.net).__name__}'s first piece "
                f"({type(layout.net.get_submodule(layout.first[0])).__name__}) does not take token ids; pass "
                "inputs= and targets= (one micro-batch of a real batch)"
            )
        inputs, targets = ids, ids.roll(-1, dims=1)
    if targets is None:
        raise ValueError("measure_stage_costs: inputs= needs targets= (the last stage's target for the loss)")
    loss_fn = loss if loss is not None else token_cross_entropy
    net = layout.net
    blocks = layout.block_list()
    in_blocks = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    rest = [t for t in [*net.parameters(), *net.buffers()] if id(t) not in in_blocks]
    homes = [t.data for t in rest]
    was = net.training
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(run: Callable[[], torch.Tensor]) -> float:
        times = []
        for _ in range(reps + 1):
            sync()
            start = time.perf_counter()
            run().float().sum().backward()
            sync()
            times.append(time.perf_counter() - start)
        return float(sorted(times[1:])[len(times[1:]) // 2]) * 1e6

    try:
        net.train()
        for t in rest:
            t.data = t.data.to(device)
        x, y = inputs.to(device), targets.to(device)
        first = timed(lambda: layout.embed(x))
        with torch.no_grad():
            h = layout.embed(x)
        ctx = layout.context(h)
        costs = []
        for block in blocks:
            home = next(iter(block.parameters()), torch.empty(0)).device
            block.to(device)
            hb = h.detach().requires_grad_(h.is_floating_point())
            costs.append(timed(lambda b=block, hb=hb: layout.call_block(b, hb, ctx)))
            block.zero_grad(set_to_none=True)
            block.to(home)
        hl = h.detach().requires_grad_(h.is_floating_point())
        last = timed(lambda: loss_fn(layout.head(hl), y))
    finally:
        net.zero_grad(set_to_none=True)
        for t, data in zip(rest, homes):
            t.data = data
        net.train(was)
    return first, costs, last
