"""A linear layer and cross-entropy in one, over chunks of tokens: the full ``tokens x vocabulary`` logits are never
held (docs/techniques/fused-cross-entropy.md).

``F.cross_entropy(hidden @ weight.T + bias, target)`` stores the logits for the backward, and often an fp32 copy of
them: at a 128k vocabulary and 16k tokens that is 8 GiB in fp32. Here each chunk's logits are built, turned into
its loss and into its gradient at once, and freed; the forward keeps the gradients of the hidden states and of the
head (one ``tokens x hidden`` tensor and one of the head's size), the backward only scales them. With
``reduction="none"`` the gradient depends on each token's upstream weight, so the forward keeps one log-sum-exp per
token instead and the backward builds each chunk's logits again.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LinearCrossEntropy", "default_chunk_tokens", "linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


#: the fewest logits a chunk holds by default (64 MiB in fp32): below it the chunks' matmuls are too small to run at
#: speed (16-token chunks of a 32k vocabulary measured 4x the plain head's time on a 2-core CPU)
MIN_CHUNK_LOGITS = 2**24


def default_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's logits hold about as many elements as the hidden states (Liger Kernel's rule),
    so the extra memory stays the size of a tensor the model holds anyway, and at least :data:`MIN_CHUNK_LOGITS`."""
    by_hidden = math.ceil(tokens / max(1, math.ceil(vocab / max(1, hidden))))
    return max(1, min(tokens, max(by_hidden, MIN_CHUNK_LOGITS // max(1, vocab))))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # the dtype the matmul of a plain nn.Linear would run in: autocast's when it is on, else the promoted one
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    z = h.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    # the softmax in fp32 at least, as F.cross_entropy upcasts half logits under autocast
    return z.to(torch.promote_types(dtype, torch.float32))


def _chunk_grad(
    z: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, smoothing: float, scale: torch.Tensor
) -> torch.Tensor:
    """d loss / d logits for one chunk, each row times ``scale`` (its token's weight; 0 where ignored)."""
    grad = torch.exp(z - lse[:, None])
    if smoothing:
        grad -= smoothing / z.shape[1]
    rows = torch.arange(z.shape[0], device=z.device)
    grad[rows[valid], y[valid]] -= 1.0 - smoothing
    return grad * scale[:, None]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        ignore_index: int,
        smoothing: float,
        reduction: str,
        chunk: int,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        acc = torch.promote_types(dtype, torch.float32)  # what losses and the head's gradients add up in
        n, vocab = hidden.shape[0], weight.shape[0]
        valid_all = target != ignore_index
        count = valid_all.sum()
        needs_grad = any(ctx.needs_input_grad[:3])
        eager_grads = needs_grad and reduction != "none"
        losses = torch.zeros(n, dtype=acc, device=hidden.device)
        lses = torch.empty(n, dtype=acc, device=hidden.device) if reduction == "none" else None
        # the gradient of each row for a unit upstream gradient: 1 (sum) or 1 / count (mean)
        one = torch.ones((), dtype=acc, device=hidden.device)
        unit = torch.where(valid_all, one / count.clamp(min=1) if reduction == "mean" else one, 0.0)
        grad_hidden = torch.zeros_like(hidden) if eager_grads and ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc, device=weight.device)
            if eager_grads and ctx.needs_input_grad[1]
            else None
        )
        grad_bias = (
            torch.zeros(vocab, dtype=acc, device=weight.device)
            if eager_grads and bias is not None and ctx.needs_input_grad[2]
            else None
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                h, y, valid = hidden[start:stop], target[start:stop], valid_all[start:stop]
                z = _chunk_logits(h, weight, bias, dtype)
                lse = torch.logsumexp(z, dim=1)
                picked = z.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)
                loss = lse - picked
                if smoothing:
                    loss = (1.0 - smoothing) * loss + smoothing * (lse - z.mean(dim=1))
                losses[start:stop] = torch.where(valid, loss, 0.0)
                if lses is not None:
                    lses[start:stop] = lse
                if eager_grads:
                    dz = _chunk_grad(z, lse, y, valid, smoothing, unit[start:stop]).to(dtype)
                    if grad_hidden is not None:
                        grad_hidden[start:stop] = dz @ weight.to(dtype)
                    if grad_weight is not None:
                        grad_weight += (dz.T @ h.to(dtype)).to(acc)
                    if grad_bias is not None:
                        grad_bias += dz.to(acc).sum(0)
                del z
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target, lses)
        else:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.setup = (ignore_index, smoothing, reduction, chunk, dtype, bias is not None)
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        # F.cross_entropy's result dtype: fp32 under autocast (it is on autocast's fp32 list), else the logits'
        result = acc if torch.is_autocast_enabled(hidden.device.type) else dtype
        if reduction == "none":
            return losses.to(result)
        total = losses.sum()
        # 0 / 0 = nan for a mean over no target, as F.cross_entropy gives
        return (total / count if reduction == "mean" else total).to(result)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ignore_index, smoothing, reduction, chunk, dtype, has_bias = ctx.setup
        if reduction != "none":
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            g = grad_out.to(grad_weight.dtype if grad_weight is not None else torch.float64)
            return (
                (grad_hidden.to(g.dtype) * g).to(grad_hidden.dtype) if grad_hidden is not None else None,
                (grad_weight * g).to(ctx.weight_dtype) if grad_weight is not None else None,
                (grad_bias * g).to(ctx.bias_dtype) if grad_bias is not None else None,
                None, None, None, None, None,
            )  # fmt: skip
        hidden, weight, bias, target, lses = ctx.saved_tensors
        acc = lses.dtype
        scale = grad_out.to(acc) * (target != ignore_index)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if has_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                stop = min(hidden.shape[0], start + chunk)
                h, y = hidden[start:stop], target[start:stop]
                z = _chunk_logits(h, weight, bias, dtype)
                dz = _chunk_grad(z, lses[start:stop], y, y != ignore_index, smoothing, scale[start:stop]).to(dtype)
                del z
                if grad_hidden is not None:
                    grad_hidden[start:stop] = dz @ weight.to(dtype)
                grad_weight += (dz.T @ h.to(dtype)).to(acc)
                if grad_bias is not None:
                    grad_bias += dz.to(acc).sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            grad_bias.to(bias.dtype) if grad_bias is not None and ctx.needs_input_grad[2] else None,
            None, None, None, None, None,
        )  # fmt: skip


def _liger_loss(ignore_index: int, smoothing: float, reduction: str) -> Any:
    """Liger Kernel's fused Triton loss, when installed (CUDA only); None otherwise."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # noqa: BLE001 - not installed, or installed without a usable Triton
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` without the full logits.

    Args:
        hidden: ``(..., hidden_size)``; every leading dimension is a token.
        weight: the head's ``(vocab, hidden_size)`` weight (a tied embedding works: it is the same tensor).
        target: class indices of ``hidden``'s leading shape.
        bias: the head's ``(vocab,)`` bias, if it has one.
        ignore_index: a target value that contributes no loss and no gradient, as in ``F.cross_entropy``.
        label_smoothing: as in ``F.cross_entropy``, in [0, 1]; class weights are not supported.
        reduction: ``"mean"`` (over the targets not ignored), ``"sum"`` or ``"none"``, as in ``F.cross_entropy``.
        chunk_tokens: tokens per chunk; by default a chunk's logits are about the size of ``hidden``, and at
            least :data:`MIN_CHUNK_LOGITS`.
        backend: ``"auto"`` uses Liger Kernel's fused kernel on CUDA when ``liger-kernel`` is installed, else this
            module's chunked torch; ``"torch"`` always the chunked torch.

    Returns a scalar (``"mean"``/``"sum"``) or the per-token losses of ``target``'s shape (``"none"``).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {', '.join(map(repr, _REDUCTIONS))}")
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend={backend!r}: use 'auto' (Liger Kernel on CUDA when installed) or 'torch'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: a float in [0, 1], as F.cross_entropy takes")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: the weight is the head's "
            "(vocab, hidden_size) and hidden's last dimension is hidden_size"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if target.dtype.is_floating_point:
        raise ValueError(f"target of dtype {target.dtype}: class indices (an integer tensor), not probabilities")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: a positive number of tokens, or None for the default")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if backend == "auto" and hidden.is_cuda:
        liger = _liger_loss(ignore_index, label_smoothing, reduction)
        if liger is not None:
            out = liger(weight, flat_h, flat_y, bias)
            return out.reshape(target.shape) if reduction == "none" else out
    chunk = chunk_tokens or default_chunk_tokens(flat_h.shape[0], weight.shape[1], weight.shape[0])
    fn: Any = _LinearCrossEntropy
    out = fn.apply(flat_h, weight, bias, flat_y, ignore_index, float(label_smoothing), reduction, chunk)
    return out.reshape(target.shape) if reduction == "none" else out


class LinearCrossEntropy(torch.nn.Module):
    """A model's output head and its loss in one module: ``LinearCrossEntropy(model.lm_head)(hidden, target)``
    equals ``F.cross_entropy(model.lm_head(hidden).flatten(0, -2), target.flatten())`` without the logits.

    The head's parameters are the head's own (shared, not copied): tied weights, optimizers and checkpoints see
    the same tensors.
    """

    def __init__(
        self,
        head: torch.nn.Linear,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        chunk_tokens: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(f"head is a {type(head).__name__}: LinearCrossEntropy takes the output nn.Linear")
        self.head = head
        self.options = dict(
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            chunk_tokens=chunk_tokens,
            backend=backend,
        )
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}: use one of {', '.join(map(repr, _REDUCTIONS))}")

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, self.head.weight, target, self.head.bias, **self.options)


def plain_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> Any:
    """The reference: the full logits, then ``F.cross_entropy`` (for checks and benchmarks)."""
    bias = kwargs.pop("bias", None)
    logits = F.linear(hidden, weight, bias)
    out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), **kwargs)
    return out.reshape(target.shape) if kwargs.get("reduction") == "none" else out
