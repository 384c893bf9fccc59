"""The demo's progress bar: Lightning's Rich bar, with the epoch total of a run that trains for ``max_steps``.

The demo trains with ``max_steps`` and no ``max_epochs``, which Lightning stores as ``max_epochs=-1``; its Rich
bar prints ``Epoch {current}/{max_epochs - 1}``, so ``Epoch 0/-2``. :class:`StepsProgressBar` prints the last
epoch the steps reach instead (``Epoch 0/0`` for the demo's one epoch). The Trainer's settings are left as they
are: setting ``max_epochs`` would also change the bar's batch total to the whole epoch, and stop the run early
when a tuner changes the epoch's length. See ``docs/getting-started.md``.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepsProgressBar", "last_epoch"]


def last_epoch(
    *, max_steps: int, global_step: int, current_epoch: int, batches_per_epoch: float, accumulate: int = 1
) -> int | None:
    """The index of the epoch the fit ends in when it trains for ``max_steps`` optimizer steps, seen at the start
    of ``current_epoch`` (``global_step`` steps done); ``None`` when the epoch's length is unknown or infinite."""
    if max_steps <= 0 or not math.isfinite(batches_per_epoch) or batches_per_epoch < 1:
        return None
    steps_per_epoch = math.ceil(int(batches_per_epoch) / max(1, accumulate))  # a partial accumulation steps too
    remaining = max(1, math.ceil((max_steps - global_step) / steps_per_epoch))
    return current_epoch + remaining - 1


class StepsProgressBar(RichProgressBar):
    """``RichProgressBar`` whose epoch total follows ``max_steps`` when ``max_epochs`` is unset (see the module)."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer: Any = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        last = last_epoch(
            max_steps=trainer.max_steps,
            global_step=trainer.global_step,
            current_epoch=current_epoch,
            batches_per_epoch=trainer.num_training_batches,
            accumulate=trainer.accumulate_grad_batches,
        )
        description = f"Epoch {current_epoch}" if last is None else f"Epoch {current_epoch}/{last}"
        # padded as Lightning pads it: the validation bar's longer description would make the row flicker
        return f"{description:{len(self.validation_description)}}"
