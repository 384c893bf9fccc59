"""Hand-written attention switched to SDPA (:class:`FusedAttention`, over ``use_fused_attention``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["FusedAttention"]


def _attention_blocks(model: nn.Module) -> list[str]:
    """Innermost modules that look like hand-written attention (class name contains "Attention", or the name ends
    in attn/attention), excluding ``nn.MultiheadAttention`` (switched only with a probe of its weights' use)."""
    names = []
    for name, module in model.named_modules():
        if not name or isinstance(module, nn.MultiheadAttention):
            continue
        last = name.rsplit(".", 1)[-1].lower()
        if "attention" in type(module).__name__.lower() or last in ("attn", "attention", "self_attn", "self_attention"):
            names.append(name)
    return [n for n in names if not any(o != n and o.startswith(n + ".") for o in names)]


def _already_fused(model: nn.Module, blocks: list[str]) -> bool:
    """Every block inside a Hugging Face model on a fused attention implementation, or of a class whose ``forward``
    calls ``scaled_dot_product_attention`` and no softmax (the demo GPT, litgpt); read from the code, no step run."""
    import inspect

    from lightning_accel._compat import hf_attn_implementation
    from lightning_accel.attention.hf_switch import _FUSED_HF

    fused_hf = [name for name, m in model.named_modules() if hf_attn_implementation(m) in _FUSED_HF]
    modules = dict(model.named_modules())
    for name in blocks:
        if any(name.startswith(f"{hf}.") or not hf for hf in fused_hf):
            continue
        try:
            source = inspect.getsource(type(modules[name]).forward)
        except (KeyError, OSError, TypeError):
            return False
        if "scaled_dot_product_attention" not in source or "softmax" in source:
            return False
    return True


class FusedAttention(Intervention):
    """``use_fused_attention``: Hugging Face models on eager attention switch to the library's SDPA path, and the
    hand-written ``softmax(q @ k.T) @ v`` of other attention blocks runs as one ``F.scaled_dot_product_attention``
    call. Not offered when the blocks already call SDPA (read from their code); rejected without measuring when the
    probe's steps fused nothing."""

    name = "fused_attention"
    kind = "reorder"
    knobs = ("attention",)

    def unavailable(self, run: Run) -> str | None:
        blocks = self.params.get("blocks") or _attention_blocks(run.module)
        if not blocks:
            return "no hand-written attention block found (modules named *attn / *Attention*)"
        if not self.params and _already_fused(run.module, blocks):
            # said before anything is measured: its prior (a quarter of forward + backward) would otherwise make a
            # short fit of the demo GPT, which calls SDPA already, look worth searching
            return "the attention already runs fused (its blocks call F.scaled_dot_product_attention)"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.attention import use_fused_attention

        blocks = self.params.get("blocks") or _attention_blocks(run.module)
        self.params = {"blocks": list(blocks)}
        # the table reports what fused and what did not: no warning per block that already calls SDPA
        self._result = use_fused_attention(run.module, blocks=blocks, warn=False)
        undo.push(self._result.restore)

    def changed_nothing(self, run: Run) -> str | None:
        result = self._result
        if result.library or result.mha or sum(result.fused_calls.values()):
            return None
        return "no attention call matched the fused pattern (nothing changed)" + (
            f"; {next(iter(result.not_fired.values()))}" if result.not_fired else ""
        )

    def describe(self, run: Run) -> str:
        result = getattr(self, "_result", None)
        if result is not None and result.library:
            switched = ", ".join(f"{name or 'model'} {before} → sdpa" for name, before in result.library.items())
            return f"use_fused_attention: Hugging Face attn_implementation {switched}"
        blocks = self.params.get("blocks") or []
        shown = ", ".join(blocks[:2]) + (f" +{len(blocks) - 2}" if len(blocks) > 2 else "")
        return f"use_fused_attention({shown or 'attention blocks'})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        line = f"la.use_fused_attention(model, blocks={self.params['blocks']!r})"
        result = getattr(self, "_result", None)
        if result is not None and result.library:  # what it does there: the library's own setting
            line += "  # Hugging Face: the same as building the model with attn_implementation='sdpa'"
        return [], [line]
