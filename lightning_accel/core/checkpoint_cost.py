"""What checkpoint saving costs a fit, and whether writing checkpoints in the background is worth a trial.

A save blocks the training thread for the whole write (state collection, serialisation, the disk). Written by a
background thread (``OrderedAsyncCheckpointIO``), the training thread pays only the clone of the checkpoint's
tensors; the write overlaps the next steps (and competes with them for CPU and memory bandwidth, which is why the
Autopilot keeps it only when a paired measurement says so).

The share of the fit a save costs is ``save_s / (save_s + n × step_s)`` for one save every ``n`` optimizer steps
(:func:`checkpoint_share`). Below :data:`MIN_SHARE` (the doctor's fit-level target is checkpoints at ~2 % of the
fit, ``core/phases.py``) the best a background write can return does not pay for the four measured periods of a
trial (A B B A), nor when fewer than :data:`MIN_SAVES_LEFT` saves remain.
"""

from __future__ import annotations

import math

__all__ = ["MIN_SAVES_LEFT", "MIN_SHARE", "checkpoint_share", "steps_between_saves", "why_not_trial"]

#: a save's share of the fit below which a background write is not trialled
MIN_SHARE = 0.05
#: saves the fit must have left to repay a trial of four periods (each one save plus its steps)
MIN_SAVES_LEFT = 8


def steps_between_saves(every_n_train_steps: int | None, every_n_epochs: int | None,
                        steps_per_epoch: int | None) -> int | None:
    """Optimizer steps between two saves of a ``ModelCheckpoint``: its step cadence, else its epoch cadence ×
    steps per epoch; ``None`` when it saves on neither (only by time, or never during the fit)."""
    if every_n_train_steps:
        return int(every_n_train_steps)
    if every_n_epochs and steps_per_epoch:
        return int(every_n_epochs) * int(steps_per_epoch)
    return None


def checkpoint_share(save_seconds: float, steps_between: int, step_seconds: float) -> float:
    """One save's share of the wall time of its period (the save plus the steps up to the next one)."""
    period = save_seconds + steps_between * step_seconds
    return save_seconds / period if period > 0 else 0.0


def why_not_trial(share: float, steps_between: int, steps_left: int | None) -> str | None:
    """``None`` when a background write is worth trialling, else the reason (one line)."""
    if share < MIN_SHARE:
        return (f"saving is {100 * share:.1f} % of the fit (one save every {steps_between} steps), under the "
                f"{100 * MIN_SHARE:.0f} % worth a trial")
    if steps_left is not None:
        saves = math.floor(steps_left / max(1, steps_between))
        if saves < MIN_SAVES_LEFT:
            return f"{saves} save(s) left in the fit, fewer than the {MIN_SAVES_LEFT} that repay a trial"
    return None
