"""The switch: :func:`use_fused_attention` routes a model's attention to SDPA, one step per kind of attention
(Hugging Face models, ``nn.MultiheadAttention``, hand-written blocks), and returns what it changed."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from lightning_accel import _compat
from lightning_accel.attention.changes import FusedAttentionChanges
from lightning_accel.attention.hf_switch import _FUSED_HF, _hf_attention_modules, _hf_models, _switch_hf, _SwitchBack
from lightning_accel.attention.mha import _mha_weights_used, _no_weights_pre_hook
from lightning_accel.attention.rewrite import _install_block_rewrite

__all__ = ["FusedAttentionChanges", "use_fused_attention"]


def use_fused_attention(
    model: nn.Module,
    example_inputs: Any = None,
    blocks: Iterable[str] = (),
    *,
    library_switch: bool = True,
    warn: bool = True,
) -> FusedAttentionChanges:
    """Route attention in ``model`` to ``F.scaled_dot_product_attention`` where results stay the same.

    1. Hugging Face ``transformers`` models inside ``model`` (found by their config's attention implementation)
       running ``attn_implementation="eager"`` are switched with the library's own
       ``set_attn_implementation("sdpa")``, which keeps masks, dropout and caching as the library means them.
       A model that cannot be switched (no ``set_attn_implementation`` in the installed version, a class without
       SDPA support) is named with the reason in a warning and :attr:`FusedAttentionChanges.unswitchable`, and its
       attention modules (class names ending in ``Attention``) are rewritten as in 3. ``library_switch=False``
       skips the switch: named blocks inside such models are then rewritten.
    2. ``nn.MultiheadAttention`` modules. With ``example_inputs``, one forward (no grad, RNG and buffers restored)
       finds the modules called with ``need_weights=True`` whose returned weights are never used — no torch
       operation touches them and nothing keeps them after the forward; those then run with
       ``need_weights=False`` (the fused path) and return ``(output, None)``. Without ``example_inputs``, only
       MHA modules named in ``blocks`` are switched.
    3. Hand-written attention in the modules named in ``blocks``: while such a module runs, the pattern
       ``matmul(q, kt) [* c | / c]* [+ float_mask | .masked_fill(bool_mask, -inf or dtype min)]* ->
       softmax(dim=-1[, dtype=...]) [-> .to(dtype) | .type(dtype) | .float() ...] [-> dropout with p=0 or in
       eval] -> matmul(p, v)`` becomes ``F.scaled_dot_product_attention(q, kt.transpose(-2, -1), v,
       attn_mask=..., scale=c)``. This covers Hugging Face eager attention (Llama, GPT-2, BERT, ViT), nanoGPT's
       manual path and timm-style blocks (a query pre-scaled before the matmul is a scale of 1). Intermediate
       results are lazy placeholders; any other use of one (reading the scores, training-mode dropout with
       p > 0, another ``masked_fill`` value, ...) computes the original operations exactly as written, so the
       block never changes its results beyond floating-point rounding. Attention weights returned next to the
       output (Hugging Face's ``attn_weights``) stay placeholders that compute only if something uses them.
       Under autocast, q, k, v are cast to the autocast dtype as the original matmuls would. Rows masked
       entirely with ``-inf`` give 0 in the fused kernel and NaN in the original. A block whose first forward
       fused nothing warns once, naming the first op that broke the pattern (:attr:`FusedAttentionChanges.not_fired`).
       Meant for eager mode: under ``torch.compile``, Inductor's own pattern matcher (``fuse_attention``)
       rewrites many such patterns, and the hooks and ``TorchFunctionMode`` used here are best left out of
       compiled code.

    Args:
        model: the model; changed in place through forward hooks (undo with :meth:`FusedAttentionChanges.restore`).
        example_inputs: one input for ``model(...)``: a tensor, a tuple of positional args or a dict of kwargs.
        blocks: names (as in ``model.named_modules()``) of hand-written attention modules, or of MHA modules to
            switch without a probe.
        library_switch: switch Hugging Face models with the library's own setting (default) instead of
            rewriting their eager attention.
        warn: warn about a model that cannot be switched, nothing to change, and a rewrite that never fires;
            ``False`` for callers that report the result themselves (the Autopilot's table): the same facts stay
            in :attr:`FusedAttentionChanges.unswitchable` and :attr:`FusedAttentionChanges.not_fired`.

    Returns:
        A :class:`FusedAttentionChanges` listing what changed.

    Raises:
        ValueError: a name in ``blocks`` that is not a submodule of ``model``.
    """
    blocks, modules = _check_blocks(model, blocks)
    result = FusedAttentionChanges()
    already: list[str] = []
    if library_switch:
        blocks, already = _switch_library_models(model, blocks, result, warn=warn)
    mhas = {name: m for name, m in modules.items() if isinstance(m, nn.MultiheadAttention)}
    _switch_mha_without_weights(model, mhas, blocks, example_inputs, result)
    for name in blocks:
        if name not in mhas:
            _install_block_rewrite(name, modules[name], result, warn=warn)
            result.blocks.append(name)
    if warn and not result.mha and not result.blocks and not result.library and not already:
        _warn_nothing_changed(result, example_inputs)
    return result


def _check_blocks(model: nn.Module, blocks: Iterable[str]) -> tuple[list[str], dict[str, nn.Module]]:
    """``blocks`` as a list (a single name allowed), checked against ``model.named_modules()``."""
    blocks = [blocks] if isinstance(blocks, str) else list(blocks)
    modules = dict(model.named_modules())
    unknown = [name for name in blocks if name not in modules]
    if unknown:
        raise ValueError(
            f"use_fused_attention(blocks={blocks!r}): {unknown} not found in the model; names are as in "
            f"model.named_modules(), e.g. {list(modules)[1:6]}"
        )
    return blocks, modules


def _inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".") or outer == ""


def _switch_library_models(
    model: nn.Module, blocks: list[str], result: FusedAttentionChanges, *, warn: bool
) -> tuple[list[str], list[str]]:
    """Step 1: Hugging Face models onto the library's SDPA attention.

    Returns:
        The blocks left to rewrite (those inside a switched model are dropped: the library's SDPA path runs there
        now; an unswitchable model's attention modules are added when no block inside it was named), and the
        models that ran a fused implementation already.
    """
    switched: list[str] = []
    already: list[str] = []
    for name, hf in _hf_models(model).items():
        before = _compat.hf_attn_implementation(hf)
        if before in _FUSED_HF:
            already.append(name)
        reason = _switch_hf(name, hf)
        if reason is not None:
            result.unswitchable[name] = reason
            auto = [] if any(_inside(b, name) for b in blocks) else _hf_attention_modules(hf, name)
            if warn:
                warnings.warn(
                    f"use_fused_attention: {reason}. Rewriting its hand-written attention instead"
                    f"{f' ({len(auto)} modules)' if auto else ''}.",
                    UserWarning,
                    stacklevel=3,
                )
            blocks = blocks + [b for b in auto if b not in blocks]
        elif before not in _FUSED_HF:
            result.library[name] = str(before)
            result._handles.append(_SwitchBack(hf, str(before)))
            switched.append(name)
    return [b for b in blocks if not any(_inside(b, n) for n in switched)], already


def _switch_mha_without_weights(
    model: nn.Module,
    mhas: dict[str, nn.MultiheadAttention],
    blocks: list[str],
    example_inputs: Any,
    result: FusedAttentionChanges,
) -> None:
    """Step 2: ``nn.MultiheadAttention`` modules named in ``blocks``, and (with ``example_inputs``) those whose
    returned weights the probe forward found unused, run with ``need_weights=False``."""
    switch = [name for name in blocks if name in mhas]
    if example_inputs is not None and mhas:
        used = _mha_weights_used(model, mhas, example_inputs)
        switch += [name for name, was_used in used.items() if not was_used and name not in switch]
        result.kept = [name for name, was_used in used.items() if was_used and name not in switch]
    for name in switch:
        result._handles.append(mhas[name].register_forward_pre_hook(_no_weights_pre_hook, with_kwargs=True))
        result.mha.append(name)


def _warn_nothing_changed(result: FusedAttentionChanges, example_inputs: Any) -> None:
    warnings.warn(
        "use_fused_attention: nothing to change: "
        + (
            f"the MultiheadAttention modules {result.kept} use their attention weights"
            if result.kept
            else "no nn.MultiheadAttention module called with need_weights=True in the example forward"
            if example_inputs is not None
            else "pass example_inputs to find nn.MultiheadAttention modules, or name hand-written attention "
            "modules in blocks=[...]"
        )
        + "; the model is unchanged.",
        UserWarning,
        stacklevel=3,
    )
