"""The large linear layers in FP8 through torchao (:class:`Float8`, over ``Float8Training``; docs/techniques/float8.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes.base import Intervention
from lightning_accel.core.autopilot.budget import TYPICAL_COMPILE_SECONDS

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["Float8"]


def _has_torchao_float8() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - a torchao built for another torch fails in other ways than ImportError
        return False
    return True


class Float8(Intervention):
    """``Float8Training``: the linear layers large enough for FP8 (torchao's size rule, the head left out) converted
    with torchao's tensorwise recipe. Offered on a GPU of compute capability >= 8.9 only, and only on top of bf16
    and compile (FP8 without compile is slower than bf16, and it pays on top of bf16, not instead of it): ranked
    after both, it is reached once they are kept. Guarded as a low-precision change; the undo puts the original
    ``nn.Linear`` modules back (they share their parameters with the converted ones, so the optimizer is
    untouched). ``emulate`` and ``min_size`` are for tests on a CPU."""

    name = "float8"
    kind = "low_precision"
    knobs = ("float8",)
    # the compiled graphs are traced again with the converted layers
    warmup_steps = 3

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel._compat import compiled_call
        from lightning_accel.callbacks._fit.trainer_state import compute_dtype
        from lightning_accel.precision.float8 import (
            Float8Training,
            float8_layers,
            fp8_device_problem,
            has_float8_layers,
        )

        if not self.params.get("emulate") and (problem := fp8_device_problem(run.device)) is not None:
            return problem
        if not _has_torchao_float8():
            return "needs torchao: pip install 'lightning-accel[torchao]'"
        if any(isinstance(cb, Float8Training) for cb in run.trainer.callbacks) or has_float8_layers(run.module):
            return "the model already trains in FP8"
        if compute_dtype(run.trainer) != "bf16":
            return "tried on top of bf16 (FP8 pays after bf16 and compile); the run computes in " + compute_dtype(
                run.trainer
            )
        if not any(compiled_call(m) is not None for m in run.module.modules()):
            return "tried on top of compile: FP8 without compile is slower than bf16"
        if not float8_layers(run.module, min_size=self.params.get("min_size", "auto"))[0]:
            return "no linear layer large enough for FP8 (torchao's size rule for the tensorwise recipe)"
        return None

    def setup_seconds(self, run: Run) -> float:
        """The compiled graphs are traced again with the converted layers: a compile's worth."""
        return TYPICAL_COMPILE_SECONDS[run.device.type == "cuda"]

    def change(self, run: Run, undo: Undo) -> None:
        from dataclasses import replace

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from lightning_accel.precision.float8 import float8_layers

        chosen = float8_layers(run.module, min_size=self.params.get("min_size", "auto"))[0]
        if not chosen:
            raise ValueError("Float8: no linear layer of the model is large enough for FP8 (pass min_size=0 to test)")
        modules = dict(run.module.named_modules())
        for name in chosen:  # undone last to first: each parent gets its original linear back
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name] if parent_name else run.module
            undo.push(lambda p=parent, a=attr, m=modules[name]: setattr(p, a, m))
        config = replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=bool(self.params.get("emulate")))
        wanted = set(chosen)
        convert_to_float8_training(run.module, module_filter_fn=lambda _m, fqn: fqn in wanted, config=config)
        self._converted = chosen

    def describe(self, run: Run) -> str:
        converted = getattr(self, "_converted", None)
        return f"Float8Training ({len(converted)} linear layers)" if converted else "Float8Training()"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        entry = {"class_path": "lightning_accel.Float8Training"}
        return [("trainer.callbacks", [entry])], ["callbacks.insert(0, la.Float8Training())  # before TorchCompile"]
