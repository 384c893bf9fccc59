"""torch.compile in place (:class:`Compile`), kept only where the compile time pays back within the fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes.base import Intervention
from lightning_accel.core.autopilot.budget import TYPICAL_COMPILE_SECONDS, compile_cannot_pay_back, compile_verdict

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.callbacks.autopilot.windows import Window
    from lightning_accel.core.autopilot import Undo

__all__ = ["Compile"]


class Compile(Intervention):
    """``TorchCompile``: the model's children compiled in place. Kept only if the time it saves over the steps left
    in the fit exceeds the compile time measured in the trial's warm-up."""

    name = "compile"
    kind = "reorder"
    knobs = ("compile",)
    warmup_steps = 3

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.torch_compile import TorchCompile

        if any(isinstance(cb, TorchCompile) for cb in run.trainer.callbacks):
            return "TorchCompile is already in use"
        from lightning_accel._compat import compiled_call

        if any(compiled_call(m) is not None for m in run.module.modules()):
            return "the model is already compiled"
        window = run.current or run.baseline
        if run.steps_left is not None and window is not None and "backend" not in self.params:
            return compile_cannot_pay_back(window.step_seconds, run.steps_left, run.device.type == "cuda")
        return None

    def setup_seconds(self, run: Run) -> float:
        """A first compile, before any window (inductor, the default; a ``backend`` passed in is the user's own
        choice, e.g. ``"eager"`` in a test, and costed at nothing)."""
        return 0.0 if "backend" in self.params else TYPICAL_COMPILE_SECONDS[run.device.type == "cuda"]

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.callbacks.torch_compile import TorchCompile

        callback = self._callback = TorchCompile(**self.params)
        undo.push(callback.uncompile)  # uncompiles whatever setup compiled, also if it raised halfway
        callback.setup(run.trainer, run.module, "fit")
        if callback.fallback_reason:
            raise RuntimeError(callback.fallback_reason)

    def judge(self, run: Run, before: Window, after: Window) -> tuple[bool, str] | None:
        if self._callback.fallback_reason:
            return False, self._callback.fallback_reason
        # the trial's first window warmed up with the compile: its warm-up time beyond that of compiled steps
        return compile_verdict(before, after, run.extras.get("warmup_steps", 0) + self.warmup_steps, run.steps_left)

    def describe(self, run: Run) -> str:
        return "TorchCompile()" if not self.params else f"TorchCompile({self.params})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        entry: dict[str, Any] = {"class_path": "lightning_accel.TorchCompile"}
        if self.params:
            entry["init_args"] = dict(self.params)
        return [("trainer.callbacks", [entry])], ["callbacks.append(la.TorchCompile())"]
