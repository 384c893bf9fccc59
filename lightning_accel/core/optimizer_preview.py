"""A foreach or fused optimizer step timed against the for-loop one, on clones of the parameters: the measured gain
the ``optimizer_not_foreach`` smell (:mod:`lightning_accel.core.smells`) puts on its finding."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["preview_optimizer_step"]

_PREVIEW_MAX_NUMEL = 50_000_000  # clones + two optimizer states: ~1.2 GB at fp32 for Adam; larger → no preview


def preview_optimizer_step(
    optimizer: Any, candidate: Mapping[str, bool], *, budget_s: float = 0.1, max_numel: int = _PREVIEW_MAX_NUMEL
) -> tuple[float, float]:
    """Seconds of one ``step`` of the optimizer's for-loop implementation and of ``candidate`` (e.g.
    ``{"fused": True}``), on clones of its parameters with random gradients: the real parameters and state are not
    touched. Each arm runs two warm-up steps; then the arms step in turn (A B A B: machine noise hits both) until
    ``budget_s`` is spent, at least 5 and at most 50 steps each; the median of each arm is kept.

    Raises:
        ValueError: more than ``max_numel`` parameters (the clones would need too much memory), or parameters that
            are tensor subclasses (DTensor under FSDP/TP: a step on them may communicate).
    """
    cls = type(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    plain = (torch.Tensor, torch.nn.Parameter)
    if any(type(p) not in plain for p in params):
        # DTensor / FSDP / tensor subclasses: a step on their clones may communicate; never preview those
        raise ValueError("the parameters are tensor subclasses (e.g. DTensor): not previewed")
    numel = sum(p.numel() for p in params)
    if numel > max_numel:
        raise ValueError(f"{numel:,} parameters exceed the preview's limit of {max_numel:,}")
    accepted = inspect.signature(cls.__init__).parameters
    group = optimizer.param_groups[0]
    hyper = {
        k: v
        for k, v in group.items()
        if k in accepted and k not in ("params", "foreach", "fused", "differentiable", "capturable")
    }
    device = params[0].device if params else torch.device("cpu")
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def build(impl: Mapping[str, bool]) -> Any:
        clones = [p.detach().clone() for p in params]
        gen = torch.Generator(device=device).manual_seed(0)
        for c in clones:
            c.grad = torch.randn(c.shape, generator=gen, device=device, dtype=c.dtype) * 1e-3
        opt = cls(clones, **hyper, **impl)
        for _ in range(2):  # state initialisation and first-call costs
            opt.step()
        return opt

    loop_impl = {k: False for k in ("foreach", "fused") if k in accepted}
    arms = [build(loop_impl), build(candidate)]
    sync()
    times: list[list[float]] = [[], []]
    spent = 0.0
    try:
        while len(times[1]) < 5 or (spent < budget_s and len(times[1]) < 50):
            for opt, out in zip(arms, times):  # alternate A B A B: machine noise hits both arms alike
                start = time.perf_counter()
                opt.step()
                sync()
                took = time.perf_counter() - start
                out.append(took)
                spent += took
    finally:
        del arms
        if device.type == "cuda":  # give the clones' and states' memory back before training allocates
            torch.cuda.empty_cache()
    return statistics.median(times[0]), statistics.median(times[1])
