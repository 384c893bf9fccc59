"""A Hugging Face causal LM's loss computed without its logits (:class:`FusedCrossEntropy`, over
``use_fused_linear_cross_entropy``; docs/techniques/fused-cross-entropy.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["FusedCrossEntropy", "causal_lms"]


def causal_lms(model: nn.Module) -> list[str]:
    """The outermost modules of ``model`` that ``use_fused_linear_cross_entropy`` takes (a ``...ForCausalLM`` or
    ``...LMHeadModel`` with an ``nn.Linear`` output head and a ``loss_function``), by name (``""``: the model)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer in found):
            continue
        cls = type(module)
        if not (cls.__name__.endswith("ForCausalLM") or cls.__name__.endswith("LMHeadModel")):
            continue
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if isinstance(head, nn.Linear) and hasattr(cls, "loss_function"):
            found.append(name)
    return found


class FusedCrossEntropy(Intervention):
    """``use_fused_linear_cross_entropy`` on each Hugging Face causal LM of the module: called with ``labels=``, the
    model computes its loss from the hidden states over chunks of tokens and never builds the logits. Offered when
    the doctor's ``large_vocab_loss`` finding fires. The helper's first-batch check (the model's own loss against
    the fused one) runs inside the numerics probe: a model that changes its logits before the loss fails it, and
    the trial is reverted with the helper's error. Rejected without measuring when the model was never called with
    labels (its loss computed outside it)."""

    name = "fused_cross_entropy"
    # the same sums over the vocabulary, in chunks of tokens
    kind = "reorder"
    knobs = ("loss",)

    def _targets(self, run: Run) -> list[str]:
        return list(self.params.get("modules") or causal_lms(run.module))

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.losses.causal_lm import _installed

        names = self._targets(run)
        if not names:
            return (
                "no Hugging Face causal LM in the model (a ...ForCausalLM with an nn.Linear head); a head of your own "
                "takes lightning_accel.linear_cross_entropy(hidden, head.weight, targets) in the training_step"
            )
        modules = dict(run.module.named_modules())
        if all(n in modules and _installed(modules[n]) for n in names):
            return "the loss is already fused (use_fused_linear_cross_entropy was called on the model)"
        soft = [
            n
            for n in names
            if n in modules and getattr(getattr(modules[n], "config", None), "final_logit_softcapping", None)
        ]
        if soft:
            return f"{soft[0] or 'the model'} soft-caps its logits before the loss (the fused loss has no soft-cap)"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.losses import use_fused_linear_cross_entropy

        modules = dict(run.module.named_modules())
        names = self._targets(run)
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(
                f"FusedCrossEntropy(modules={missing!r}): no such module in the model; omit modules= to fuse the "
                "loss of every Hugging Face causal LM in it"
            )
        self.params = {"modules": names}
        self._handles = []
        for name in names:
            handle = use_fused_linear_cross_entropy(modules[name])
            undo.push(handle.remove)
            # a model called without labels is rejected by changed_nothing with the reason; no warning per trial
            handle._warned_no_labels = True
            self._handles.append(handle)

    def changed_nothing(self, run: Run) -> str | None:
        if any(h.fused_calls for h in getattr(self, "_handles", ())):
            return None
        return (
            "the model was never called with labels= (its loss is computed outside it, from the logits): pass "
            "labels= to it, or call lightning_accel.linear_cross_entropy(hidden, lm_head.weight, targets)"
        )

    def describe(self, run: Run) -> str:
        names = self.params.get("modules") or self._targets(run)
        shown = ", ".join(n or "model" for n in names[:2]) + (f" +{len(names) - 2}" if len(names) > 2 else "")
        return f"use_fused_linear_cross_entropy({shown or 'causal LM'})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        names = self.params.get("modules") or self._targets(run)
        return [], [f"la.use_fused_linear_cross_entropy({'.'.join(('model', n)) if n else 'model'})" for n in names]
