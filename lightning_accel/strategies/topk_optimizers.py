"""``ddp_topk``'s optimizer-dependent parts of Deep Gradient Compression's recipe, set up once the optimizers exist.

Momentum correction for momentum SGD, plain steps first for Adam-family optimizers. See
docs/techniques/ddp-compression.md ("Top-K that converges").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

__all__ = ["configure_topk_for_optimizers", "momentum_off_when_compressed"]

#: id(optimizer) -> [(param group index, its momentum)] that momentum correction switches off per step
MomentumGroups = dict[int, list[tuple[int, float]]]


def _is_adaptive(optimizer: Any) -> bool:
    """Adam-family (per-entry adaptive step sizes): torch's adaptive optimizers, or any with ``betas`` (Adam-like
    third-party ones: fused, 8-bit, LAMB)."""
    adaptive = tuple(
        getattr(torch.optim, name)
        for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam")
        if hasattr(torch.optim, name)
    )
    return isinstance(optimizer, adaptive) or "betas" in getattr(optimizer, "defaults", {})


def configure_topk_for_optimizers(
    state: Any,
    optimizers: Sequence[Any],
    *,
    momentum_correction: bool | None,
    use_error_feedback: bool,
    start_iter: int,
    adaptive_warmup_steps: int,
) -> MomentumGroups:
    """Set ``state``'s momentum and start for ``optimizers``; returns the SGD groups whose momentum the hook keeps.

    Raises:
        ValueError: momentum correction asked for or needed but impossible (several momenta, dampening, mixed
            Nesterov, or no momentum SGD with ``momentum_correction=True``).
    """
    groups: MomentumGroups = {}
    state.momentum, state.nesterov = 0.0, False
    state.start_iter = int(start_iter)
    adaptive = [type(o).__name__ for o in optimizers if _is_adaptive(o)]
    sgd = [(o, i, g) for o in optimizers if isinstance(o, torch.optim.SGD) for i, g in enumerate(o.param_groups)]
    all_momentum_sgd = bool(optimizers) and all(isinstance(o, torch.optim.SGD) for o in optimizers)
    momenta = sorted({float(g.get("momentum", 0.0)) for _, _, g in sgd})
    # without error feedback there is no residual to accumulate the velocity in: no correction (True is refused
    # at construction)
    correct = momentum_correction is not False and bool(use_error_feedback)
    if correct and all_momentum_sgd and momenta != [0.0]:
        if len(momenta) > 1:
            raise ValueError(
                f"ddp_topk: momentum correction needs one momentum for all parameters; the SGD param groups "
                f"have momentum {momenta}: use one value, or momentum_correction=False"
            )
        dampening = sorted({float(g.get("dampening", 0.0)) for _, _, g in sgd})
        if dampening != [0.0]:
            raise ValueError(
                f"ddp_topk: momentum correction with SGD dampening={dampening} is not DGC's momentum; use "
                "dampening=0, or momentum_correction=False"
            )
        nesterov = {bool(g.get("nesterov", False)) for _, _, g in sgd}
        if len(nesterov) > 1:
            raise ValueError(
                "ddp_topk: momentum correction needs nesterov the same in every SGD param group; make it so, or "
                "use momentum_correction=False"
            )
        state.momentum, state.nesterov = momenta[0], nesterov.pop()
        for o, i, _g in sgd:
            groups.setdefault(id(o), []).append((i, momenta[0]))
        rank_zero_info(
            f"ddp_topk: momentum correction and factor masking for SGD momentum {momenta[0]}"
            f"{' (Nesterov)' if state.nesterov else ''}: the hook keeps the velocity; SGD steps without "
            "momentum on compressed steps"
        )
    elif momentum_correction:
        names = [type(o).__name__ for o in optimizers]
        raise ValueError(
            f"ddp_topk: momentum_correction=True needs torch.optim.SGD with momentum > 0 as every optimizer; "
            f"the optimizers are {names} (momenta {momenta}): use momentum_correction=None (automatic) or False"
        )
    if adaptive:
        state.start_iter = max(state.start_iter, int(adaptive_warmup_steps))
        rank_zero_warn(
            f"ddp_topk with {', '.join(adaptive)}: adaptive optimizers on sparsified gradients can diverge or "
            f"converge worse; plain all-reduce for the first {state.start_iter} steps (adaptive_warmup_steps="
            f"{adaptive_warmup_steps}), then Top-K",
            category=UserWarning,
        )
    return groups


def momentum_off_when_compressed(
    state: Any, optimizer: Any, closure: Callable[[], Any], groups: list[tuple[int, float]]
) -> Callable[[], Any]:
    """``closure`` followed by setting the momentum-corrected groups' momentum for the update that follows: 0
    when the hook compressed this backward (it already applied momentum), else the optimizer's own. Runs after
    the backward (inside ``optimizer.step`` with automatic optimization; after ``manual_backward`` otherwise)."""

    def then_momentum() -> Any:
        out = closure()
        for i, momentum in groups:
            optimizer.param_groups[i]["momentum"] = 0.0 if state.last_compressed else momentum
        return out

    return then_momentum
