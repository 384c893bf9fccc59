"""The numeric-format fixes: a mixed-precision dtype (:class:`MixedPrecisionDtype`) and TF32 matmuls for a run
that stays fp32 (:class:`Tf32Matmul`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["MixedPrecisionDtype", "Tf32Matmul"]


class MixedPrecisionDtype(Intervention):
    """Mixed precision chosen by the whole step, not a matmul probe.

    * With Lightning's default ``32-true`` (the plain ``Precision`` plugin): installs ``AutoMixedPrecision`` itself
      with bf16 where the device has it, else fp16 with its ``GradScaler`` (the method's defaults); autocast
      keeps its fp32 op list (softmax, norms, losses) in fp32, and the ``low_precision`` numerics guard checks the
      loss and gradient direction on the probe batches. The plan, YAML and Python snippet carry the plugin.
    * With ``AutoMixedPrecision`` already in ``plugins=``: another dtype (fp32 -> bf16/fp16, or back to fp32 when
      its micro-probe chose a half dtype).

    ``Autopilot(freeze=["precision"])`` opts out. Other precision plugins (the user's own choice) are left alone.
    """

    name = "precision"
    kind = "low_precision"
    knobs = ("precision",)

    @staticmethod
    def _plugin(run: Run) -> Any:
        from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

        plugin = run.trainer.precision_plugin
        return plugin if isinstance(plugin, AutoMixedPrecision) else None

    @staticmethod
    def _default(run: Run) -> bool:
        from lightning.pytorch.plugins.precision import Precision

        return type(run.trainer.precision_plugin) is Precision  # Lightning's 32-true

    def _target(self, run: Run) -> str | None:
        from lightning_accel.core.precision import supported_autocast_dtypes

        plugin = self._plugin(run)
        if plugin is None:
            current = "fp32"
        else:
            current = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(plugin.compute_dtype, "fp32")
        if "dtype" in self.params:
            return self.params["dtype"] if self.params["dtype"] != current else None
        if current != "fp32":
            return "fp32"
        supported = supported_autocast_dtypes(run.device)
        return "bf16" if "bf16" in supported else ("fp16" if "fp16" in supported else None)

    def unavailable(self, run: Run) -> str | None:
        if self._plugin(run) is None and not self._default(run):
            return (
                f"the run's precision plugin is {type(run.trainer.precision_plugin).__name__} (the user's "
                "choice); use Lightning's default or plugins=[la.AutoMixedPrecision()] to let the Autopilot "
                "choose the dtype"
            )
        if self._target(run) is None:
            return "no other autocast dtype on this device"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.core.precision import DtypeChoice, choose_autocast_dtype
        from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

        target = self._target(run)
        if target is None:
            raise ValueError(f"precision: dtype {self.params.get('dtype')!r} is what the run already computes in")
        self.params = {"dtype": target}
        strategy = run.trainer.strategy
        plugin = self._plugin(run)
        if plugin is None:  # Lightning's default: install the plugin (undo puts the user's back)
            original = strategy.precision_plugin
            plugin = AutoMixedPrecision(dtype=target)

            def uninstall() -> None:
                plugin.remove_islands()
                strategy.precision_plugin = original

            undo.push(uninstall)
            strategy.precision_plugin = plugin
            plugin.convert_module(run.module)
            return
        saved = (plugin.choice, plugin.precision, plugin.scaler)
        undo.push(
            lambda: (
                setattr(plugin, "choice", saved[0]),
                setattr(plugin, "precision", saved[1]),
                setattr(plugin, "scaler", saved[2]),
            )
        )
        choice = choose_autocast_dtype(run.device, target)
        plugin.choice = DtypeChoice(choice.dtype, f"{target}: measured faster end to end by the Autopilot")
        plugin.precision = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(choice.dtype, "32-true")
        plugin.scaler = torch.amp.GradScaler(run.device.type, **plugin.scaler_kwargs) if choice.needs_scaler else None

    def describe(self, run: Run) -> str:
        if "dtype" not in self.params:
            return (
                "AutoMixedPrecision (bf16, fp16 + scaler without bf16)"
                if self._plugin(run) is None
                else "another AutoMixedPrecision dtype"
            )
        return f"AutoMixedPrecision(dtype={self.params['dtype']!r})"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        dtype = self.params["dtype"]
        return (
            [
                (
                    "trainer.plugins",
                    [{"class_path": "lightning_accel.AutoMixedPrecision", "init_args": {"dtype": dtype}}],
                )
            ],
            [f"plugins = [la.AutoMixedPrecision(dtype={dtype!r})]"],
        )


class Tf32Matmul(Intervention):
    """TF32 tensor-core matmuls (``torch.set_float32_matmul_precision("high")``) for a run that stays in fp32 on a
    CUDA GPU of compute capability >= 8.0: 10 mantissa bits in the products, fp32 accumulation (the doctor's
    ``tf32_off`` smell). Kind ``reorder``: the numbers move at the level of a reordered sum."""

    name = "tf32"
    kind = "reorder"
    knobs = ("precision",)

    def unavailable(self, run: Run) -> str | None:
        if run.device.type != "cuda":
            return f"TF32 is a mode of CUDA tensor cores; this run is on {run.device.type}"
        major = torch.cuda.get_device_capability(run.device)[0]
        if major < 8:
            return f"compute capability {major}.x has no TF32 (needs >= 8.0)"
        plugin = run.trainer.precision_plugin
        dtype = getattr(plugin, "compute_dtype", None)
        precision = str(getattr(plugin, "precision", "32"))
        if dtype in (torch.bfloat16, torch.float16) or precision.startswith(("16", "bf16")):
            return "the run computes its matmuls in 16 bits"
        if torch.get_float32_matmul_precision() != "highest":
            return f"float32 matmul precision is already {torch.get_float32_matmul_precision()!r}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = torch.get_float32_matmul_precision()
        undo.push(lambda: torch.set_float32_matmul_precision(before))
        torch.set_float32_matmul_precision("high")

    def describe(self, run: Run) -> str:
        return 'torch.set_float32_matmul_precision("high") (TF32 matmuls)'

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return [], ['torch.set_float32_matmul_precision("high")  # TF32 matmuls, before building the Trainer']
