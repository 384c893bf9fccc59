"""A larger micro-batch with the global batch held fixed (:class:`MicroBatch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.interventions.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.interventions.base import Run
    from lightning_accel.core.autopilot_search import Undo

__all__ = ["MicroBatch"]


def _smallest_factor(n: int) -> int:
    for f in range(2, n + 1):
        if n % f == 0:
            return f
    return 1


class MicroBatch(Intervention):
    """A larger micro-batch with the global batch held fixed (Composer's rule): micro-batch ×f and
    ``accumulate_grad_batches`` ÷f, so every optimizer step sees the same samples; only possible with
    accumulation > 1. The learning rate needs no change."""

    name = "micro_batch"
    kind = "reorder"
    knobs = ("batch_size", "accumulate_grad_batches")
    repeatable = True

    def unavailable(self, run: Run) -> str | None:
        accumulate = run.config.accumulate
        if accumulate <= 1:
            return ("accumulate_grad_batches is 1: a larger micro-batch would change the global batch (and the "
                    "training); use BatchSizeTuner(target_global_batch_size=...) to trade it for accumulation")
        if not run.module.automatic_optimization:
            return "manual optimization: the LightningModule does its own accumulation"
        reason = run.source.can_set("batch_size")
        if reason:
            return reason
        if not run.source.current().get("batch_size"):
            return "the loader's batch size is unknown"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        current = run.source.current()
        if not self.params:
            factor = _smallest_factor(run.config.accumulate)
            self.params = {"batch_size": int(current["batch_size"]) * factor,
                           "accumulate_grad_batches": run.config.accumulate // factor}
        global_before = int(current["batch_size"]) * run.config.accumulate
        global_after = self.params["batch_size"] * self.params["accumulate_grad_batches"]
        if global_before != global_after:
            raise ValueError(f"micro_batch {self.params} changes the global batch per device from {global_before} "
                             f"to {global_after}; the plan was made for another batch size or accumulation")
        batch_size, accumulate = current["batch_size"], run.config.accumulate
        undo.push(lambda: run.source.set({"batch_size": batch_size}))
        run.source.set({"batch_size": self.params["batch_size"]})
        undo.push(lambda: setattr(run.config, "accumulate", accumulate))
        run.config.accumulate = self.params["accumulate_grad_batches"]

    def describe(self, run: Run) -> str:
        p = self.params
        if not p:
            return "larger micro-batch, same global batch"
        return (f"batch_size={p['batch_size']} × accumulate_grad_batches={p['accumulate_grad_batches']} "
                "(same global batch)")

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        yaml, python = run.source.config_entries()
        yaml = [e for e in yaml if e[0].endswith(".batch_size")]
        python = [line for line in python if "batch_size" in line]
        acc = run.config.accumulate  # the final value (a repeated micro-batch change supersedes this one's)
        return ([*yaml, ("trainer.accumulate_grad_batches", acc)],
                [*python, f"trainer_kwargs['accumulate_grad_batches'] = {acc}"])
