"""Activation checkpointing of the repeated blocks paid for by a larger micro-batch
(:class:`ActivationCheckpointingWithLargerBatch`)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_accel.callbacks.autopilot.fixes.base import Intervention
from lightning_accel.callbacks.autopilot.fixes.batch import MicroBatch

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["ActivationCheckpointingWithLargerBatch"]


class ActivationCheckpointingWithLargerBatch(Intervention):
    """Activation checkpointing of the repeated blocks *and* a micro-batch ×f with accumulation ÷f: only when the
    doctor says memory is the limit (peak ≥ 90 % with a small batch) and accumulation leaves room for a larger
    micro-batch — recomputing costs ~20 % more compute, so it only pays through the larger batch."""

    name = "activation_checkpointing"
    kind = "reorder"
    knobs = ("activation_checkpointing", "batch_size", "accumulate_grad_batches")

    def _block_type(self, run: Run) -> type | None:
        counts: collections.Counter[type] = collections.Counter()
        for module in run.module.modules():
            if isinstance(module, nn.ModuleList):
                for child in module:
                    if any(True for _ in child.parameters()):
                        counts[type(child)] += 1
        common = counts.most_common(1)
        return common[0][0] if common and common[0][1] >= 2 else None

    def unavailable(self, run: Run) -> str | None:
        reason = MicroBatch().unavailable(run)
        if reason:
            return reason
        if self._block_type(run) is None:
            return "no repeated block (an nn.ModuleList of 2+ modules of one class) to checkpoint"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        from lightning_accel.core.checkpointing import (
            CHECKPOINT_PREFIX,
            apply_activation_checkpointing,
            clean_module_name,
            remove_activation_checkpointing,
        )

        def wrappers() -> set[str]:
            return {clean_module_name(n) for n, m in run.module.named_modules() if n and hasattr(m, CHECKPOINT_PREFIX)}

        block = self._block_type(run)
        if block is None:
            raise ValueError("no repeated block (an nn.ModuleList of 2+ modules of one class) to checkpoint")
        self._micro = MicroBatch(**{k: v for k, v in self.params.items() if k != "block"})
        self._micro._no_jump = True  # the memory checkpointing frees buys one doubling, not the whole accumulation
        # the micro-batch change's undo goes on the same stack first: if checkpointing raises, it is undone too
        self._micro.change(run, undo)
        self.params = {**self._micro.params, "block": f"{block.__module__}.{block.__qualname__}"}
        already = wrappers()

        def unwrap() -> None:  # every wrapper this change added, also those of a wrap that raised halfway
            added = sorted(wrappers() - already)
            if added:
                remove_activation_checkpointing(run.module, added)

        undo.push(unwrap)
        apply_activation_checkpointing(run.module, [block])

    def describe(self, run: Run) -> str:
        block = self.params.get("block", "blocks").rsplit(".", 1)[-1]
        return f"ActivationCheckpointing({block}) + " + (
            self._micro.describe(run) if hasattr(self, "_micro") else "larger micro-batch"
        )

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        yaml, python = self._micro.config(run)
        block = self.params["block"]
        return (
            [
                *yaml,
                (
                    "trainer.callbacks",
                    [{"class_path": "lightning_accel.ActivationCheckpointing", "init_args": {"modules": [block]}}],
                ),
            ],
            [*python, f"callbacks.append(la.ActivationCheckpointing(modules=[{block.rsplit('.', 1)[-1]}]))"],
        )
