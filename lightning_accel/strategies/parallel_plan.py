"""Automatic tensor-parallel and FSDP2 plans for a model that has no ``configure_model`` of its own (torch only).

:func:`derive_plan` reads the model (a Hugging Face model's own tensor-parallel plan, or one read from its module
structure), :func:`apply_plan` applies the plan on a device mesh; the ``fsdp2`` / ``tp`` / ``fsdp2_tp`` strategies
(:mod:`.model_parallel`) call both. See docs/techniques/fsdp2-tp.md.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accel._checks import check_int

__all__ = ["ParallelPlan", "PlanEntry", "apply_plan", "derive_plan", "regroup_fused_qkv"]

_Q = ("q_proj", "query", "q", "wq", "q_lin", "query_proj")
_K = ("k_proj", "key", "k", "wk", "k_lin", "key_proj")
_V = ("v_proj", "value", "v", "wv", "v_lin", "value_proj")
_O = ("o_proj", "out_proj", "proj", "wo", "dense", "c_proj", "out_lin", "o")
_FUSED_QKV = ("qkv", "c_attn", "qkv_proj", "Wqkv", "query_key_value", "in_proj")
# (column-wise names, row-wise name): the first match wins
_MLPS = (
    (("gate_proj", "up_proj"), "down_proj"),
    (("fc_1", "fc_2"), "proj"),
    (("w1", "w3"), "w2"),
    (("up_proj",), "down_proj"),
    (("fc",), "proj"),
    (("fc1",), "fc2"),
    (("c_fc",), "c_proj"),
    (("dense_h_to_4h",), "dense_4h_to_h"),
    (("lin1",), "lin2"),
    (("linear1",), "linear2"),
)
_HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_query_groups")

#: styles of the plans, mapped onto torch's ParallelStyle in :func:`_torch_style`
_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "fused_qkv_colwise")


@dataclass(frozen=True)
class PlanEntry:
    """One tensor-parallel decision: ``module`` (qualified name from the LightningModule) gets ``style``."""

    module: str
    style: str
    source: str  # "hf" (the library's plan) or "structure"


@dataclass
class _FusedQKVAttention:
    """A litgpt attention module with one fused ``qkv`` linear whose rows the plan regroups per rank."""

    module: str
    n_head: int
    n_query_groups: int
    head_size: int


@dataclass
class ParallelPlan:
    """What :func:`apply_plan` does to a model; :meth:`describe` prints it (module → style).

    Attributes:
        tp_size: tensor-parallel size the plan was checked against.
        tp: tensor-parallel entries (empty for FSDP2 only).
        fsdp_units: modules to ``fully_shard``, innermost first (empty without data parallelism).
        replicated: notable modules left whole on every tensor-parallel rank (norms, embeddings, heads).
        sources: model → where its plan came from.
        notes: one line per decision worth knowing (tied embeddings, regrouped rows, per-rank heads).
    """

    tp_size: int
    tp: list[PlanEntry] = field(default_factory=list)
    fsdp_units: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _fused: list[_FusedQKVAttention] = field(default_factory=list, repr=False)
    heads_by_module: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    def tp_dict(self) -> dict[str, str]:
        """``{module: style}`` of the tensor-parallel entries."""
        return {e.module: e.style for e in self.tp}

    def describe(self) -> str:
        """The plan as text: layers collapsed (``layers.*``), one line per module pattern → style."""
        lines = [f"{model}: {source}" for model, source in self.sources.items()]
        if self.tp:
            lines.append(f"tensor parallel (size {self.tp_size}):")
            for pattern, (style, count) in _collapse([(e.module, e.style) for e in self.tp]).items():
                lines.append(f"  {pattern:<48} {style}" + (f"  (x{count})" if count > 1 else ""))
            if self.replicated:
                reps = _collapse([(m, "replicated") for m in self.replicated])
                lines.append("  replicated: " + ", ".join(reps))
        if self.fsdp_units:
            units = _collapse([(m, "fully_shard") for m in self.fsdp_units])
            lines.append(
                "FSDP2 fully_shard: " + ", ".join(f"{p} (x{c})" if c > 1 else p for p, (_, c) in units.items())
            )
        lines.extend(f"note: {n}" for n in dict.fromkeys(self.notes))
        return "\n".join(lines)


def _collapse(pairs: list[tuple[str, str]]) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for name, style in pairs:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        prev = out.get(key)
        out[key] = (style, (prev[1] if prev else 0) + 1)
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _is_hf(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__
    )


def _linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear)


def _check_divides(tp: int, value: int, what: str, module: str, cls: str) -> None:
    if value % tp:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the {value} {what} of '{module}' ({cls}); "
            f"use a tensor-parallel size among {divisors}, or write configure_model with a plan of "
            "your own"
        )


# ------------------------------------------------------------------------------------------- Hugging Face
_HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather_output",
    "colwise_rep": "colwise_rep",
    "embedding_rowwise": "embedding_rowwise",
}


def _hf_plan(prefix: str, model: nn.Module, tp: int, plan: ParallelPlan) -> bool:
    from lightning_accel._compat import hf_tp_plan

    raw = hf_tp_plan(model)
    if not raw:
        return False
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    modules = dict(model.named_modules())
    patterns = [(re.compile("^" + re.escape(k).replace(r"\*", r"\d+") + "$"), k, v) for k, v in raw.items()]
    entries: list[PlanEntry] = []
    dropped: list[str] = []
    for name, sub in modules.items():
        for regex, _key, style in patterns:
            if not regex.match(name):
                continue
            if tied and (isinstance(sub, nn.Embedding) or name.split(".")[-1] == "lm_head"):
                dropped.append(name)
                break
            if style not in _HF_STYLES:
                raise ValueError(
                    f"the Hugging Face plan of {type(model).__name__} shards '{name}' as {style!r}, a "
                    f"style this strategy does not map onto torch ({', '.join(_HF_STYLES)}); write "
                    "configure_model, or use strategy='fsdp2'"
                )
            entries.append(PlanEntry(_join(prefix, name), _HF_STYLES[style], "hf"))
            break
    if not entries:
        return False
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    cls = type(model).__name__
    for entry in entries:
        sub = modules[entry.module[len(prefix) + 1 :] if prefix else entry.module]
        parent = entry.module.rsplit(".", 1)[0]
        leaf = entry.module.rsplit(".", 1)[-1]
        if heads and leaf in _Q:
            _check_divides(tp, heads, "attention heads", parent, cls)
        if kv and leaf in _K + _V:
            _check_divides(tp, kv, "key/value heads", parent, cls)
        # the vocabulary of an output head / embedding may shard unevenly (DTensor pads); heads and widths may not
        if isinstance(sub, nn.Linear) and entry.style in ("colwise", "rowwise"):
            width = sub.out_features if entry.style == "colwise" else sub.in_features
            _check_divides(tp, width, "features of the sharded dimension", entry.module, type(sub).__name__)
    plan.tp.extend(entries)
    plan.sources[prefix or "model"] = f"Hugging Face tp_plan of {cls} ({len(raw)} rules)"
    if dropped:
        plan.replicated.extend(_join(prefix, d) for d in dropped)
        plan.notes.append(f"{cls} ties its input and output embeddings: {', '.join(dropped)} stay replicated")
    for name, sub in modules.items():
        # embeddings, norms and an output head the library's plan leaves alone (transformers 5.0's Llama plan
        # covers only the decoder layers) stay replicated
        if (
            isinstance(sub, (nn.Embedding, nn.LayerNorm))
            or "Norm" in type(sub).__name__
            or name.split(".")[-1] == "lm_head"
        ):
            full = _join(prefix, name)
            if full not in plan.tp_dict() and full not in plan.replicated:
                plan.replicated.append(full)
    return True


# ------------------------------------------------------------------------------------------- structure
def _attention(name: str, module: nn.Module, tp: int, plan: ParallelPlan) -> bool:
    children = dict(module.named_children())
    pick = lambda names: next((n for n in names if _linear(children.get(n))), None)  # noqa: E731
    q, k, v, o = pick(_Q), pick(_K), pick(_V), pick(_O)
    fused = pick(_FUSED_QKV)
    if o is None or not ((q and k and v) or fused):
        return False
    cls = type(module).__name__
    config = getattr(module, "config", None)
    if fused and not (q and k and v):
        litgpt = all(isinstance(getattr(config, a, None), int) for a in ("n_head", "n_query_groups", "head_size"))
        if not litgpt:
            raise ValueError(
                f"attention '{name}' ({cls}) computes q, k and v with one fused linear '{fused}' whose "
                "row layout this plan does not know (only litgpt's [q; k; v] layout is supported); "
                "write configure_model with a plan of your own, or use strategy='fsdp2'"
            )
        if getattr(config, "norm_qk", False):
            raise ValueError(
                f"attention '{name}' ({cls}) normalises q/k over all heads (norm_qk); a per-rank norm "
                "would differ: write configure_model, or use strategy='fsdp2'"
            )
        _check_divides(tp, config.n_head, "attention heads", name, cls)
        _check_divides(tp, config.n_query_groups, "key/value head groups", name, cls)
        plan._fused.append(_FusedQKVAttention(name, config.n_head, config.n_query_groups, config.head_size))
        plan.tp.append(PlanEntry(_join(name, fused), "fused_qkv_colwise", "structure"))
        plan.notes.append(
            f"{_collapse([(name, '')]).popitem()[0]}.{fused}: rows regrouped per rank "
            "(see regroup_fused_qkv); resume checkpoints with the same tensor-parallel size"
        )
    else:
        counts = {
            a: getattr(module, a) for a in _HEAD_ATTRS + _KV_HEAD_ATTRS if isinstance(getattr(module, a, None), int)
        }
        if config is not None:
            for a in ("num_attention_heads", "num_key_value_heads", "n_head", "n_query_groups"):
                if isinstance(getattr(config, a, None), int):
                    counts.setdefault(f"config.{a}", getattr(config, a))
        for attr, value in counts.items():
            _check_divides(
                tp, value, "key/value heads" if any(k in attr for k in _KV_HEAD_ATTRS) else "attention heads", name, cls
            )
        own = {a: v for a, v in counts.items() if not a.startswith("config.")}
        if own:
            plan.heads_by_module[name] = own
        for leaf in (q, k, v):
            plan.tp.append(PlanEntry(_join(name, leaf), "colwise", "structure"))
    out = children[o]
    _check_divides(tp, out.in_features, "input features of the output projection", _join(name, o), cls)
    plan.tp.append(PlanEntry(_join(name, o), "rowwise", "structure"))
    return True


def _mlp(name: str, module: nn.Module, tp: int, plan: ParallelPlan) -> bool:
    children = dict(module.named_children())
    cls = type(module).__name__
    for ups, down in _MLPS:
        if all(_linear(children.get(u)) for u in ups) and _linear(children.get(down)):
            for u in ups:
                _check_divides(tp, children[u].out_features, "hidden features", _join(name, u), cls)
                plan.tp.append(PlanEntry(_join(name, u), "colwise", "structure"))
            plan.tp.append(PlanEntry(_join(name, down), "rowwise", "structure"))
            return True
    if (
        isinstance(module, nn.Sequential)
        and len(module) == 3
        and _linear(module[0])
        and _linear(module[2])
        and not isinstance(module[1], nn.Linear)
        and not any(True for _ in module[1].parameters())
        and module[0].out_features == module[2].in_features
    ):
        _check_divides(tp, module[0].out_features, "hidden features", _join(name, "0"), cls)
        plan.tp.extend(
            [PlanEntry(_join(name, "0"), "colwise", "structure"), PlanEntry(_join(name, "2"), "rowwise", "structure")]
        )
        return True
    return False


def _structure_plan(prefix: str, root: nn.Module, tp: int, plan: ParallelPlan) -> int:
    found = 0
    skip: set[str] = set()
    for name, module in root.named_modules():
        if any(name.startswith(s + ".") for s in skip):
            continue
        full = _join(prefix, name)
        if _attention(full, module, tp, plan) or _mlp(full, module, tp, plan):
            found += 1
            skip.add(name)
    for name, module in root.named_modules():
        if isinstance(module, (nn.Embedding, nn.LayerNorm)) or "Norm" in type(module).__name__:
            plan.replicated.append(_join(prefix, name))
    if found:
        plan.sources[prefix or "model"] = f"module structure of {type(root).__name__} ({found} attention/MLP blocks)"
    return found


def _blocks(root: nn.Module, plan: ParallelPlan) -> list[str]:
    """Elements of ModuleLists that hold a module the plan recognised (transformer blocks), innermost lists last."""
    targets = {e.module.rsplit(".", 1)[0] for e in plan.tp} | {a.module for a in plan._fused}
    blocks = []
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList):
            for i, _ in enumerate(module):
                block = f"{name}.{i}"
                if any(t == block or t.startswith(block + ".") for t in targets):
                    blocks.append(block)
    return blocks


def _structural_blocks(root: nn.Module) -> list[str]:
    probe = ParallelPlan(tp_size=1)
    for name, module in root.named_modules():
        try:
            _attention(name, module, 1, probe) or _mlp(name, module, 1, probe)
        except ValueError:  # an unknown fused layout still marks a block for FSDP
            probe.tp.append(PlanEntry(f"{name}.x", "colwise", "structure"))
    return _blocks(root, probe)


def derive_plan(module: nn.Module, *, tp_size: int = 1, fsdp: bool = False) -> ParallelPlan:
    """The automatic plan of ``module`` (a LightningModule or any ``nn.Module`` holding the model).

    Args:
        module: the module whose submodules are planned (names in the plan are relative to it).
        tp_size: tensor-parallel size (1: no tensor parallelism).
        fsdp: also list the FSDP2 units.

    Raises:
        ValueError: with ``tp_size > 1``, when nothing is recognised (the message lists what was found), or a size
            does not divide the heads / widths (the message names the module and the sizes).
    """
    check_int("derive_plan", "tp_size", tp_size)
    plan = ParallelPlan(tp_size=tp_size)
    if tp_size > 1:
        hf_roots = []
        for name, sub in module.named_modules():
            if _is_hf(sub) and not any(name.startswith(r + ".") or r == "" for r in hf_roots):
                if _hf_plan(name, sub, tp_size, plan):
                    hf_roots.append(name)
        covered = lambda n: any(n == r or n.startswith(r + ".") or r == "" for r in hf_roots)  # noqa: E731
        found = 0
        for name, sub in module.named_children():
            if not covered(name):
                found += _structure_plan(name, sub, tp_size, plan)
        if not plan.tp:
            kinds = Counter(type(m).__name__ for m in module.modules() if next(m.children(), None) is None)
            children = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
            raise ValueError(
                f"{type(module).__name__}: no recognised attention or MLP blocks to shard for tensor "
                f"parallelism (top-level children: {children}; layers: "
                f"{', '.join(f'{k} x{v}' for k, v in kinds.most_common(8))}); write configure_model "
                "with a plan of your own, or use strategy='fsdp2'"
            )
        for entry in plan.tp:
            sub = module.get_submodule(entry.module)
            if entry.style == "embedding_rowwise" and not isinstance(sub, nn.Embedding):
                raise ValueError(f"'{entry.module}' is planned as embedding_rowwise but is {type(sub).__name__}")
        tp_names = plan.tp_dict()
        plan.replicated = [m for m in dict.fromkeys(plan.replicated) if m not in tp_names]
    if fsdp:
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"{type(module).__name__} registers parameters directly on itself ({', '.join(direct)})"
                "; FSDP2 shards submodules (it gathers parameters in their forward): move them into a "
                "submodule, or write configure_model"
            )
        blocks = _blocks(module, plan) if plan.tp else _structural_blocks(module)
        roots = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
        plan.fsdp_units = blocks + [r for r in roots if r not in blocks]
        if not plan.sources:
            plan.sources["model"] = (
                f"FSDP2 over {len(blocks)} blocks + {len(roots)} top-level modules"
                if blocks
                else f"FSDP2 over the {len(roots)} top-level modules"
            )
    return plan


# ------------------------------------------------------------------------------------------- apply
def regroup_fused_qkv(
    weight: torch.Tensor, *, n_head: int, n_query_groups: int, head_size: int, tp_size: int, inverse: bool = False
) -> torch.Tensor:
    """Rows of a litgpt fused ``qkv`` weight (or bias) from ``[q; k; v]`` to ``[q₀ k₀ v₀ | q₁ k₁ v₁ | …]``
    (``inverse=True``: back), so that a contiguous 1/``tp_size`` of the rows holds one rank's heads."""
    q, kv = n_head * head_size, n_query_groups * head_size
    if weight.shape[0] != q + 2 * kv or n_head % tp_size or n_query_groups % tp_size:
        raise ValueError(
            f"regroup_fused_qkv: {weight.shape[0]} rows do not match n_head={n_head}, "
            f"n_query_groups={n_query_groups}, head_size={head_size} split {tp_size} ways"
        )
    qs, ks = q // tp_size, kv // tp_size
    index = torch.cat(
        [
            torch.cat(
                [
                    torch.arange(r * qs, (r + 1) * qs),
                    torch.arange(q + r * ks, q + (r + 1) * ks),
                    torch.arange(q + kv + r * ks, q + kv + (r + 1) * ks),
                ]
            )
            for r in range(tp_size)
        ]
    )
    index = index.to(weight.device)
    if inverse:
        return weight[torch.argsort(index)]
    return weight[index]


def _torch_style(style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style in ("colwise", "fused_qkv_colwise"):
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    raise ValueError(f"unknown plan style {style!r}; known: {', '.join(_STYLES)}")


def apply_plan(
    module: nn.Module,
    plan: ParallelPlan,
    *,
    tp_mesh: Any = None,
    dp_mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> None:
    """Apply ``plan`` in place: tensor parallelism on ``tp_mesh`` (if the plan has entries and the mesh > 1 rank),
    then FSDP2 ``fully_shard`` on ``dp_mesh`` for :attr:`ParallelPlan.fsdp_units` (if the mesh > 1 rank)."""
    if plan.tp and tp_mesh is not None and tp_mesh.size() > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        t = tp_mesh.size()
        if t != plan.tp_size:
            raise ValueError(f"the plan was checked for tensor_parallel_size={plan.tp_size}, the mesh has {t} ranks")
        for fused in plan._fused:
            attn = module.get_submodule(fused.module)
            qkv = next(m for n, m in attn.named_children() if n in _FUSED_QKV and isinstance(m, nn.Linear))
            if qkv.weight.device.type != "meta":
                with torch.no_grad():
                    for p in (qkv.weight, qkv.bias):
                        if p is not None:
                            p.copy_(
                                regroup_fused_qkv(
                                    p.detach(),
                                    n_head=fused.n_head,
                                    head_size=fused.head_size,
                                    n_query_groups=fused.n_query_groups,
                                    tp_size=t,
                                )
                            )
            local = copy.copy(attn.config)  # the config is shared by the whole model: copy it for this module
            local.n_head, local.n_query_groups = fused.n_head // t, fused.n_query_groups // t
            attn.config = local
        for name, counts in plan.heads_by_module.items():
            attn = module.get_submodule(name)
            for attr, value in counts.items():
                setattr(attn, attr, value // t)
        parallelize_module(module, tp_mesh, {e.module: _torch_style(e.style) for e in plan.tp})
    if plan.fsdp_units and dp_mesh is not None and dp_mesh.size() > 1:
        from torch.distributed.fsdp import fully_shard

        kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for name in plan.fsdp_units:
            fully_shard(module.get_submodule(name), **kwargs)
