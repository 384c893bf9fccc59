"""torch.compile in place (:class:`Compile`), kept only where the compile time pays back within the fit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.interventions.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks._autopilot_trials import Window
    from lightning_accel.callbacks.interventions.base import Run
    from lightning_accel.core.autopilot_search import Undo

__all__ = ["MAX_COMPILE_GAIN", "TYPICAL_COMPILE_SECONDS", "Compile"]

#: the method's upper end of torch.compile's gain on compute-heavy models ("typically 10-30 %")
MAX_COMPILE_GAIN = 0.30
#: seconds a first inductor compile of a small model typically takes (CPU: C++ codegen on few cores — the 2-layer HF
#: GPT-2 script of benchmarks/bench_autopilot_real.py takes 61.7 s on a 2-core CPU; CUDA: triton); used to skip a
#: trial that could not pay back even at MAX_COMPILE_GAIN and to cost a trial against the search's budget — a real
#: trial measures its own
TYPICAL_COMPILE_SECONDS = {False: 60.0, True: 20.0}


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
            # even the method's best case (30 % faster steps) cannot repay a typical first compile in this fit
            saved = MAX_COMPILE_GAIN * window.step_seconds * run.steps_left
            if saved < TYPICAL_COMPILE_SECONDS[run.device.type == "cuda"]:
                return (
                    f"cannot pay back: the {run.steps_left} steps left take ~{window.step_seconds * run.steps_left:.0f} s, "
                    f"so even {MAX_COMPILE_GAIN:.0%} faster steps save ~{saved:.0f} s, less than a typical "
                    f"first compile (~{TYPICAL_COMPILE_SECONDS[run.device.type == 'cuda']:.0f} s)"
                )
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
        from lightning_accel.core.autopilot import compile_pays_back

        if self._callback.fallback_reason:
            return False, self._callback.fallback_reason
        # the trial's first window warmed up with the compile: its warm-up time beyond that of compiled steps
        warmup_steps = run.extras.get("warmup_steps", 0) + self.warmup_steps
        compile_seconds = max(0.0, after.warmup_seconds - warmup_steps * after.step_seconds)
        return compile_pays_back(compile_seconds, before.step_seconds, after.step_seconds, run.steps_left)

    def describe(self, run: Run) -> str:
        return "TorchCompile()" if not self.params else f"TorchCompile({self.params})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        entry: dict[str, Any] = {"class_path": "lightning_accel.TorchCompile"}
        if self.params:
            entry["init_args"] = dict(self.params)
        return [("trainer.callbacks", [entry])], ["callbacks.append(la.TorchCompile())"]
