"""The doctor's code smells: found before the first step, the unused-parameter check after the first backward, and
held until the first window's shares say which are worth a warning (``core.smells``: ``find_smells`` /
``gate_smells``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.core.rules import Diagnosis, Finding, RunContext

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DoctorSmells"]


class DoctorSmells:
    """One fit's smells: :attr:`diagnosis` (for the report) and the findings not warned yet."""

    def __init__(self, *, check_gradients: bool) -> None:
        self.diagnosis = Diagnosis()
        self.pending: list[Finding] = []  # found, not yet warned (waiting for the first window's shares)
        self.grads_checked = not check_gradients
        self._find_unused: bool | None = None

    def find(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loader: Any, ctx: RunContext) -> None:
        """Look for smells before the first step (the optimizer preview and one batch's loading are timed)."""
        from lightning_accel.core.smells import find_smells

        model = trainer.strategy.model
        find_unused = getattr(model, "find_unused_parameters", None)
        self._find_unused = find_unused if isinstance(find_unused, bool) else None
        self.diagnosis = find_smells(
            pl_module,
            trainer.optimizers,
            loader=loader,
            device_type=ctx.device_type,
            device_capability=ctx.device_capability,
            compute_dtype=ctx.compute_dtype,
            accumulate_grad_batches=ctx.accumulate_grad_batches or 1,
            find_unused_parameters=self._find_unused,
            cpu_count=ctx.cpu_count,
        )
        # warned once the first window's shares say what each is worth (gate_smells: < 3 % goes to the report only)
        self.pending.extend(self.diagnosis.findings)

    def check_unused_parameters(self, pl_module: pl.LightningModule) -> None:
        """After the first backward: with find_unused_parameters=True, did every parameter get a gradient?"""
        self.grads_checked = True
        if not self._find_unused:
            return
        from lightning_accel.core.smells import find_smells

        every = all(p.grad is not None for p in pl_module.parameters() if p.requires_grad)
        found = find_smells(
            pl_module,
            (),
            find_unused_parameters=True,
            every_param_got_grad=every,
            rules=("ddp_find_unused_parameters",),
        )
        self.diagnosis.skipped = [s for s in self.diagnosis.skipped if s.rule != "ddp_find_unused_parameters"]
        self.diagnosis.findings.extend(found.findings)
        self.diagnosis.skipped.extend(found.skipped)
        self.pending.extend(found.findings)

    def take_live(self, shares: dict[str, float]) -> list[Finding]:
        """The pending smells worth a warning at these shares (the rest stay in the report only); none pend after."""
        from lightning_accel.core.smells import gate_smells

        live, _report_only = gate_smells(self.pending, shares)
        self.pending = []
        return live
