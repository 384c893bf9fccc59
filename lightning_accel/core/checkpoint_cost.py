"""What checkpoint saving costs a fit, and whether writing checkpoints in the background is worth a trial.

A save blocks the training thread for the whole write (state collection, serialisation, the disk). Written by a
background thread (``OrderedAsyncCheckpointIO``), the training thread pays only the clone of the checkpoint's
tensors; the write overlaps the next steps (and competes with them for CPU and memory bandwidth, which is why the
Autopilot keeps it only when a paired measurement says so).

The share of the fit a save costs is ``save_s / (save_s + n × step_s)`` for one save every ``n`` optimizer steps
(:func:`checkpoint_share`). A trial measures :data:`TRIAL_PERIODS` periods of one save plus ``k`` steps, all of them
extra time (the steps are undone); it is worth running when saving is at least :data:`MIN_SHARE` of the fit (the
doctor's fit-level target is checkpoints at ~2 %, ``core/phases.py``) and the saves left, each hiding
:data:`HIDDEN_FRACTION` of its write, would repay the trial (:func:`why_not_trial`).
"""

from __future__ import annotations

import math

__all__ = ["HIDDEN_FRACTION", "MIN_SHARE", "TRIAL_PERIODS", "checkpoint_share", "steps_between_saves", "why_not_trial"]

#: a save's share of the fit below which a background write is not trialled
MIN_SHARE = 0.05
#: periods (one save + k steps) a trial runs: A, an untimed warm-up of the background writer, B B A
TRIAL_PERIODS = 5
#: the prior share of a save's time a background write hides from the training thread (it still pays the clone of
#: the checkpoint's tensors; the planted slow disk of the tests hides ~95 %)
HIDDEN_FRACTION = 0.8


def steps_between_saves(
    every_n_train_steps: int | None, every_n_epochs: int | None, steps_per_epoch: int | None
) -> int | None:
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


def why_not_trial(
    save_seconds: float, steps_between: int, step_seconds: float, steps_left: int | None, window_steps: int
) -> str | None:
    """``None`` when a background write is worth trialling, else the reason (one line). ``window_steps``: the steps
    of each measured period; ``steps_left``: ``None`` for a fit of unknown length (always worth it)."""
    share = checkpoint_share(save_seconds, steps_between, step_seconds)
    if share < MIN_SHARE:
        return (
            f"saving is {100 * share:.1f} % of the fit (one save every {steps_between} steps), under the "
            f"{100 * MIN_SHARE:.0f} % worth a trial"
        )
    if steps_left is not None:
        saves = math.floor(steps_left / max(1, steps_between))
        saving = saves * save_seconds * HIDDEN_FRACTION
        cost = TRIAL_PERIODS * (save_seconds + window_steps * step_seconds)
        if saving <= cost:
            return (
                f"the {saves} save(s) left would save ~{saving:.1f} s written in the background, less than the "
                f"~{cost:.1f} s a trial costs"
            )
    return None
