"""Model FLOPs: counted from a real step with torch's ``FlopCounterMode``, or from the transformer formula.

MFU counts *model* FLOPs: the matrix multiplications, convolutions and attention products the model needs for a
step (forward + backward), not the element-wise work and not recomputation (activation checkpointing does not
raise model FLOPs). torch's ``FlopCounterMode`` counts exactly the first kind at dispatch time: ``mm``/``addmm``/
``bmm``/``baddbmm`` as ``2·m·n·k``, convolutions, and scaled-dot-product attention (forward and backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FlopCounter", "count_flops", "new_flop_counter_mode", "transformer_flops_per_token"]


def _extra_flop_formulas() -> dict[Any, Any]:
    """Attention formulas that make the count *model* FLOPs, for every SDPA kernel.

    Two corrections to torch's registry (checked on torch 2.13):

    - the CPU flash kernel that ``F.scaled_dot_product_attention`` dispatches to on CPU is not registered, so
      attention would count as 0 FLOPs there; it computes the same products as the CUDA kernels;
    - torch's SDPA backward formula includes the recomputation of the score matrix that flash kernels do
      (5 products, 2.5× the forward). Model FLOPs, the numerator of MFU, exclude recomputation (PaLM,
      Appendix B: backward = 2× forward), so the backward is counted as its 4 gradient products.
    """
    from torch.utils import flop_counter

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_flop_count(query, key, value))

    def backward(
        grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
    ) -> int:
        b, h_q, s_q, d_q = query
        s_k = key[2]
        recomputed_scores = flop_counter.bmm_flop((b * h_q, s_q, d_q), (b * h_q, d_q, s_k))
        return int(flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)) - int(recomputed_scores)

    aten = torch.ops.aten
    formulas = {
        "_scaled_dot_product_flash_attention_for_cpu": forward,
        "_scaled_dot_product_flash_attention_for_cpu_backward": backward,
        "_scaled_dot_product_flash_attention_backward": backward,
        "_scaled_dot_product_efficient_attention_backward": backward,
        "_scaled_dot_product_cudnn_attention_backward": backward,
    }
    return {getattr(aten, name): f for name, f in formulas.items() if hasattr(aten, name)}


def new_flop_counter_mode() -> Any:
    """A silent ``FlopCounterMode`` counting model FLOPs of every SDPA kernel (see :func:`_extra_flop_formulas`),
    per device under tensor parallelism (:class:`~lightning_accel.core.sharded_flops.ShardedFlopCounterMode`)."""
    from lightning_accel.core.sharded_flops import ShardedFlopCounterMode

    return ShardedFlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())


class FlopCounter:
    """A ``FlopCounterMode`` that can be started and stopped from two different places (two Lightning hooks).

    Example::

        counter = FlopCounter()
        counter.start()
        loss = model(x).sum(); loss.backward()
        flops = counter.stop()
    """

    def __init__(self) -> None:
        self._mode: Any = None
        self.total: int | None = None

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is not None:
            raise RuntimeError("FlopCounter.start() called twice without stop()")
        self._mode = new_flop_counter_mode()
        self._mode.__enter__()

    def stop(self) -> int:
        """Leave the counting mode and return the FLOPs counted since :meth:`start`."""
        if self._mode is None:
            raise RuntimeError("FlopCounter.stop() called before start()")
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.total = int(mode.get_total_flops())
        return self.total


def _default_forward(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


def _to_loss(output: Any) -> torch.Tensor:
    """The scalar to call ``backward`` on: a scalar output, ``output["loss"]``, or the first tensor's sum."""
    if isinstance(output, torch.Tensor):
        return output if output.ndim == 0 else output.float().sum()
    if isinstance(output, Mapping):
        if "loss" in output and isinstance(output["loss"], torch.Tensor):
            return _to_loss(output["loss"])
        output = list(output.values())
    if isinstance(output, Sequence) and not isinstance(output, str):
        for item in output:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                return _to_loss(item)
    raise TypeError(
        f"count_flops could not find a tensor to backpropagate in the module output of type {type(output).__name__}; "
        "pass loss_fn=lambda output: <scalar tensor>, or backward=False to count the forward only"
    )


@contextlib.contextmanager
def _preserved_training_state(module: nn.Module, devices: list[int]) -> Iterator[None]:
    """Restore grads, buffers (e.g. BatchNorm running stats) and RNG states after a throw-away step."""
    params = [p for p in module.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for p in params:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for buf, copy in saved_buffers:
                buf.copy_(copy)


def count_flops(
    module: nn.Module,
    batch: Any,
    *,
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool = True,
) -> int:
    """FLOPs of one training step (forward + backward) of ``module`` on a real ``batch``.

    The step is run once under ``torch.utils.flop_counter.FlopCounterMode``. Parameters are not updated (no
    optimizer step), and the gradients, buffers (BatchNorm statistics) and CPU/CUDA RNG states that training
    relies on are restored afterwards, so calling this never changes what training does next.

    Args:
        module: the model, in the train/eval mode it should be counted in.
        batch: one batch as the model takes it: a tensor, a tuple/list (``module(*batch)``) or a mapping
            (``module(**batch)``), unless ``forward_fn`` says otherwise.
        forward_fn: ``forward_fn(module, batch) -> output``, for models called differently.
        loss_fn: ``loss_fn(output) -> scalar`` to backpropagate; by default a scalar output, ``output["loss"]``,
            or the sum of the first tensor that requires grad.
        backward: count the backward pass too (default). ``False`` counts the forward only.

    Returns:
        The number of floating-point operations (a multiply-add counts as 2).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"count_flops needs an nn.Module, got {type(module).__name__}")
    forward_fn = forward_fn or _default_forward
    cuda_devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with _preserved_training_state(module, cuda_devices):
        counter = new_flop_counter_mode()
        with counter:
            with torch.enable_grad() if backward else torch.no_grad():
                output = forward_fn(module, batch)
                if backward:
                    loss = loss_fn(output) if loss_fn is not None else _to_loss(output)
                    loss.backward()
    return int(counter.get_total_flops())


def transformer_flops_per_token(num_params: int, num_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder-only transformer: ``6·N + 12·L·d·T``.

    ``6·N``: each parameter does one multiply-add (2 FLOPs) per token in the forward pass and two in the backward
    pass (gradients for activations and for weights). ``12·L·d·T``: the attention score and value products,
    ``2·2·T·d`` per token and layer in the forward pass, times 3 for forward + backward, counted over the full
    ``T×T`` score matrix. Source: PaLM (Chowdhery et al., 2022), Appendix B; the same as nanoGPT's
    ``estimate_mfu``. ``num_params`` should exclude position embeddings (a lookup does no FLOPs); with a tied
    input/output embedding count the token embedding once, since the output projection is a matmul.

    Args:
        num_params: number of parameters N (see above).
        num_layers: transformer blocks L.
        d_model: hidden size d.
        seq_len: tokens per sequence T (the context the attention spans).
    """
    for name, value in (
        ("num_params", num_params),
        ("num_layers", num_layers),
        ("d_model", d_model),
        ("seq_len", seq_len),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"transformer_flops_per_token: {name} must be a positive number, got {value!r}")
    return 6.0 * num_params + 12.0 * num_layers * d_model * seq_len
