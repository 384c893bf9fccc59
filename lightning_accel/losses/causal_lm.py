"""A Hugging Face causal LM computes its training loss without its logits: :func:`use_fused_linear_cross_entropy`.

A call with ``labels=`` makes the head hand back its input, and the model's own ``loss_function`` computes the loss
from those hidden states with :func:`~.linear_cross_entropy.linear_cross_entropy`; a check on the first batch
refuses a model that changes its logits before the loss. See docs/techniques/fused-cross-entropy.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from lightning_accel.losses.linear_cross_entropy import linear_cross_entropy

__all__ = ["FusedLinearCrossEntropyHandle", "use_fused_linear_cross_entropy"]


class FusedLinearCrossEntropyHandle:
    """What :func:`use_fused_linear_cross_entropy` installed; :meth:`remove` puts the model back."""

    def __init__(self, model: nn.Module, head: nn.Linear, chunk_tokens: int | None, backend: str) -> None:
        self.model, self.head = model, head
        self.chunk_tokens, self.backend = chunk_tokens, backend
        self.checked = False  # the first call with labels agreed with the model's own loss
        self.fused_calls = 0
        self._active = False
        self._checking = False
        self._warned_no_labels = False
        self._own_loss = model.loss_function
        had_loss = "_loss_function" in vars(model)
        self._restore_loss = (
            (lambda: setattr(model, "_loss_function", self._own_loss))
            if had_loss
            else (lambda: vars(model).pop("_loss_function", None))
        )
        self._hooks = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]
        head.forward = self._head_forward  # type: ignore[method-assign]  # an instance attribute: no new module
        model.loss_function = self._loss  # type: ignore[assignment]

    # ------------------------------------------------------------------ the hooks
    def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._active:
            return hidden
        return nn.Linear.forward(self.head, hidden)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, **kwargs: Any) -> Any:
        if not self._active:
            return self._own_loss(logits, labels, vocab_size, **kwargs)
        return causal_lm_loss(
            logits,
            self.head.weight,
            labels,
            self.head.bias,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            shift_labels=kwargs.get("shift_labels"),
            chunk_tokens=self.chunk_tokens,
            backend=self.backend,
        )

    def _before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._checking:
            return
        if kwargs.get("labels") is None:
            if model.training and torch.is_grad_enabled() and not self._warned_no_labels:
                self._warned_no_labels = True
                warnings.warn(
                    f"use_fused_linear_cross_entropy: {type(model).__name__} was called without labels=, so it "
                    "built its logits as before; pass labels= to the model (its output's loss is then computed "
                    "without the logits), or call linear_cross_entropy(hidden_states, lm_head.weight, targets)",
                    stacklevel=2,
                )
            return
        if not self.checked:
            self._check(model, args, kwargs)
        self._active = True

    def _after(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._active or self._checking:
            return output
        self._active = False
        self.fused_calls += 1
        if hasattr(output, "logits"):
            output.logits = None  # the hidden states stood in for them; they are not logits
        return output

    # ------------------------------------------------------------------ the first-call check
    def _check(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        one_args, one_kwargs = _first_sample(args, kwargs)
        was_training = model.training
        devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
        self._checking = True
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                model.eval()
                own = model(*one_args, **one_kwargs).loss
                self._active = True
                ours = model(*one_args, **one_kwargs).loss
        finally:
            self._active = self._checking = False
            model.train(was_training)
        own_f, ours_f = float(own), float(ours)
        half = self.head.weight.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(
            self.head.weight.device.type
        )
        tolerance = 2e-2 if half else 1e-4
        if not (math.isfinite(own_f) and math.isclose(own_f, ours_f, rel_tol=tolerance, abs_tol=tolerance)):
            self.remove()
            raise ValueError(
                f"use_fused_linear_cross_entropy: {type(model).__name__}'s own loss on the first sample is "
                f"{own_f:.6g}, the fused one {ours_f:.6g} (relative tolerance {tolerance:g}): the model changes "
                "its logits between the head and the loss (a soft-cap or a scale) or computes another loss, so the "
                "fused loss would train something else; the model is put back as it was"
            )
        self.checked = True

    def remove(self) -> None:
        """Put the model back: its head's forward, its loss function, no hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        vars(self.head).pop("forward", None)
        self._restore_loss()
        self._active = False


def _first_sample(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Every tensor argument cut to its first row (the batch dimension of a causal LM's inputs)."""
    labels = kwargs["labels"]
    batch = labels.shape[0] if labels.dim() > 1 else None

    def cut(value: Any) -> Any:
        if batch is not None and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
            return value[:1]
        return value

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items() if k != "num_items_in_batch"}


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (each token predicts the next; a sum over ``num_items_in_batch`` when
    given, else the mean) from the hidden states and the head, without the logits."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(
        hidden,
        weight,
        shift_labels,
        bias,
        ignore_index=ignore_index,
        reduction=reduction,
        chunk_tokens=chunk_tokens,
        backend=backend,
    )
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def use_fused_linear_cross_entropy(
    model: nn.Module, *, chunk_tokens: int | None = None, backend: str = "auto"
) -> FusedLinearCrossEntropyHandle:
    """Make a Hugging Face causal LM (``...ForCausalLM``, ``GPT2LMHeadModel``) compute its loss without its logits
    when it is called with ``labels=`` (docs/techniques/fused-cross-entropy.md). Returns a handle (``.remove()``
    undoes it).

    Refuses (``TypeError``) anything else: a model whose loss is computed outside it, from its logits, takes
    :func:`~.linear_cross_entropy.linear_cross_entropy` on its hidden states instead.
    """
    inner = getattr(model, "module", model) if not hasattr(model, "get_output_embeddings") else model
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")) or not isinstance(head, nn.Linear):
        raise TypeError(
            f"use_fused_linear_cross_entropy takes a Hugging Face causal LM (a ...ForCausalLM with an nn.Linear "
            f"output head), not a {name}: for your own head call lightning_accel.losses.linear_cross_entropy("
            "hidden_states, head.weight, targets) in place of cross_entropy(head(hidden_states), targets)"
        )
    if not hasattr(type(inner), "loss_function"):
        raise TypeError(f"{name} has no loss_function to route (a transformers version before 4.46?)")
    softcap = getattr(getattr(inner, "config", None), "final_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"{name} soft-caps its logits (config.final_logit_softcapping={softcap}) before the loss: the fused "
            "loss has no soft-cap, so it would train another loss; train this model with its own head"
        )
    if any(isinstance(h, FusedLinearCrossEntropyHandle) for h in _installed(inner)):
        raise ValueError(f"use_fused_linear_cross_entropy was already called on this {name}")
    handle = FusedLinearCrossEntropyHandle(inner, head, chunk_tokens, backend)
    inner._lightning_accel_fused_ce = handle  # type: ignore[attr-defined]
    return handle


def _installed(model: nn.Module) -> list[Any]:
    handle = vars(model).get("_lightning_accel_fused_ce")
    return [handle] if handle is not None and handle._hooks else []
