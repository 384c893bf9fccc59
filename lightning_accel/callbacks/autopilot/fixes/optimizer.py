"""The optimizer-step implementation: ``fused=True`` (:class:`FusedOptimizer`) or ``foreach=True``
(:class:`ForeachOptimizer`), both an :class:`OptimizerImplementation`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["ForeachOptimizer", "FusedOptimizer", "OptimizerImplementation"]


class OptimizerImplementation(Intervention):
    """The multi-tensor (``foreach``) or single-kernel (``fused``) implementation of the optimizer step, set in
    every param group of every optimizer (torch.optim reads the flags at each step)."""

    kind = "exact"
    knobs = ("optimizer",)
    flag: ClassVar[str] = ""

    def unavailable(self, run: Run) -> str | None:
        if not run.trainer.optimizers:
            return "no optimizer"
        for opt in run.trainer.optimizers:
            if self.flag not in opt.defaults:
                return f"{type(opt).__name__} has no `{self.flag}` implementation"
            if all(g.get(self.flag) is True for g in opt.param_groups):
                return f"{type(opt).__name__} already runs with {self.flag}=True"
            if self.flag == "foreach" and all(g.get("fused") is True for g in opt.param_groups):
                return f"{type(opt).__name__} already runs its fused step (one kernel for all tensors)"
        if self.flag == "fused":
            devices = {p.device.type for opt in run.trainer.optimizers for g in opt.param_groups for p in g["params"]}
            from lightning_accel._compat import fused_optimizer_devices

            unsupported = devices - set(fused_optimizer_devices())
            if unsupported:
                return f"no fused optimizer kernels on {sorted(unsupported)}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        for opt in run.trainer.optimizers:
            saved = [_flags(d) for d in (opt.defaults, *opt.param_groups)]
            undo.push(
                lambda opt=opt, saved=saved: [
                    _set_flags(d, f) for d, f in zip((opt.defaults, *opt.param_groups), saved)
                ]
            )
            for group in opt.param_groups:
                if self.flag == "fused":
                    group["fused"] = True
                    if "foreach" in group:
                        group["foreach"] = False
                else:
                    group["foreach"] = True
                    if "fused" in group:
                        group["fused"] = False if group["fused"] else group["fused"]
            opt.defaults[self.flag] = True

    def describe(self, run: Run) -> str:
        names = sorted({type(o).__name__ for o in run.trainer.optimizers})
        return f"{'/'.join(names)}({self.flag}=True)"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        names = sorted({type(o).__name__ for o in run.trainer.optimizers})
        line = f"# in configure_optimizers: torch.optim.{names[0]}(..., {self.flag}=True)"
        return [], [line]


def _flags(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in ("foreach", "fused") if k in d}


def _set_flags(d: dict[str, Any], saved: dict[str, Any]) -> None:
    for k in ("foreach", "fused"):
        if k in saved:
            d[k] = saved[k]
        else:
            d.pop(k, None)


class FusedOptimizer(OptimizerImplementation):
    __doc__ = OptimizerImplementation.__doc__
    name = "optimizer_fused"
    kind = "reorder"
    flag = "fused"


class ForeachOptimizer(OptimizerImplementation):
    __doc__ = OptimizerImplementation.__doc__
    name = "optimizer_foreach"
    kind = "exact"
    flag = "foreach"
