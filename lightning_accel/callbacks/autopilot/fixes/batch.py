"""A larger micro-batch with the global batch held fixed (:class:`MicroBatch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["MicroBatch"]


def _smallest_factor(n: int) -> int:
    for f in range(2, n + 1):
        if n % f == 0:
            return f
    return 1


class MicroBatch(Intervention):
    """A larger micro-batch with the global batch held fixed (Composer's rule): micro-batch ×f and
    ``accumulate_grad_batches`` ÷f, so every optimizer step sees the same samples; only possible with
    accumulation > 1. The learning rate needs no change.

    With an accumulation above 2 the first trial jumps to the whole factor — one micro-batch per optimizer step,
    what a hand-tuner sets (4 × 8 → 32 × 1 in one trial). On the GPT-2 script of benchmarks/bench_autopilot_real.py
    that one knob alone reaches the hand-tuned configuration's rate (micro 32 × 1: 328-359 samples/s, all knobs by
    hand: 328-358, vanilla 226-295 in the same rounds), while a doubling (8 × 4) measures inside the noise and,
    refused, never leads to the jump. A jump that is not kept (slower, or out of memory on a GPU: the trial fails and is
    undone) falls back to one doubling (the smallest factor of the accumulation); after a kept doubling the jump
    is offered again. A target measured no faster than a configuration is not trialled again *from that
    configuration*; from a larger micro-batch kept since, it is a new question (on the demo GPT the jump 8 × 4 →
    32 × 1 measured 1.00 and 1.04 in the noise, then 8 × 4 and 16 × 2 were kept one after the other, and 32 × 1,
    the hand-tuned setting, was never asked again)."""

    name = "micro_batch"
    kind = "reorder"
    knobs = ("batch_size", "accumulate_grad_batches")
    repeatable = True
    #: a fall-back after a refused jump: one doubling, not the jump again
    _no_jump = False
    _target_tried: tuple[tuple[int, int], tuple[int, int]] | None = None  # (from, to)
    _jumped = False
    _refused: set[tuple[tuple[int, int], tuple[int, int]]] | None = None

    def _target(self, run: Run) -> tuple[int, int, bool] | None:
        """(micro-batch, accumulation, whether it is a jump) of the next trial; ``None`` when it was refused."""
        batch_size, accumulate = int(run.source.current()["batch_size"]), run.config.accumulate
        refused = run.extras.get("micro_batch_refused", set())
        here = (batch_size, accumulate)
        if not self._no_jump and accumulate > 2 and (here, (batch_size * accumulate, 1)) not in refused:
            return batch_size * accumulate, 1, True
        factor = _smallest_factor(accumulate)
        target = (batch_size * factor, accumulate // factor)
        return None if (here, target) in refused else (*target, False)

    def unavailable(self, run: Run) -> str | None:
        accumulate = run.config.accumulate
        if accumulate <= 1:
            return (
                "accumulate_grad_batches is 1: a larger micro-batch would change the global batch (and the "
                "training); use BatchSizeTuner(target_global_batch_size=...) to trade it for accumulation"
            )
        if not run.module.automatic_optimization:
            return "manual optimization: the LightningModule does its own accumulation"
        reason = run.source.can_set("batch_size")
        if reason:
            return reason
        if not run.source.current().get("batch_size"):
            return "the loader's batch size is unknown"
        if not self.params and self._target(run) is None:
            factor = _smallest_factor(accumulate)
            return (
                f"batch_size={int(run.source.current()['batch_size']) * factor} × accumulate_grad_batches="
                f"{accumulate // factor} was measured no faster before"
            )
        return None

    def change(self, run: Run, undo: Undo) -> None:
        current = run.source.current()
        if not self.params:
            target = self._target(run)
            if target is None:
                raise ValueError("micro_batch: the next larger micro-batch was measured no faster before")
            self.params = {"batch_size": target[0], "accumulate_grad_batches": target[1]}
            self._jumped = target[2]
        self._target_tried = (
            (int(current["batch_size"]), run.config.accumulate),
            (self.params["batch_size"], self.params["accumulate_grad_batches"]),
        )
        self._refused = run.extras.setdefault("micro_batch_refused", set())
        global_before = int(current["batch_size"]) * run.config.accumulate
        global_after = self.params["batch_size"] * self.params["accumulate_grad_batches"]
        if global_before != global_after:
            raise ValueError(
                f"micro_batch {self.params} changes the global batch per device from {global_before} "
                f"to {global_after}; the plan was made for another batch size or accumulation"
            )
        batch_size, accumulate = current["batch_size"], run.config.accumulate
        undo.push(lambda: run.source.set({"batch_size": batch_size}))
        run.source.set({"batch_size": self.params["batch_size"]})
        undo.push(lambda: setattr(run.config, "accumulate", accumulate))
        run.config.accumulate = self.params["accumulate_grad_batches"]

    def fallback(self) -> MicroBatch | None:
        """After a trial that was not kept: its target is not trialled again; a refused jump falls back to one
        more doubling."""
        if self._refused is not None and self._target_tried is not None:
            self._refused.add(self._target_tried)
        if self._jumped:
            following = MicroBatch()
            following._no_jump = True
            return following
        return None

    def describe(self, run: Run) -> str:
        p = self.params
        if not p:
            return "larger micro-batch, same global batch"
        return (
            f"batch_size={p['batch_size']} × accumulate_grad_batches={p['accumulate_grad_batches']} (same global batch)"
        )

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        yaml, python = run.source.config_entries()
        yaml = [e for e in yaml if e[0].endswith(".batch_size")]
        python = [line for line in python if "batch_size" in line]
        acc = run.config.accumulate  # the final value (a repeated micro-batch change supersedes this one's)
        return (
            [*yaml, ("trainer.accumulate_grad_batches", acc)],
            [*python, f"trainer_kwargs['accumulate_grad_batches'] = {acc}"],
        )
