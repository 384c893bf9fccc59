"""The Autopilot's fix outside the step: checkpoints written in a background thread, kept only when measured faster.

After the step search, a fit whose ``ModelCheckpoint`` saves by steps or epochs is checked for what its saves cost
(:mod:`lightning_accel.core.checkpoint_cost`): first from an upper bound of the checkpoint's size at a slow disk's
speed (no measurement; most fits stop here), then from one measured save. Where saving is at least 5 % of the fit
and enough saves are left, the trial measures *periods* — one ``trainer.save_checkpoint`` (the real one: the same
hooks and contents, written next to the user's checkpoints and removed afterwards) plus ``k`` training steps, and
for the background write until the write is done — in the order A B B A (synchronous, background, background,
synchronous; an untimed background period before the first B starts the writer thread; the search's own paired
routine, ``measure_pairs``), the slowest rank's time each; the background write is kept when both paired ratios
exceed 1 and their mean clears the search's noise gate. How often the user checkpoints is never changed.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from lightning_accel.callbacks.autopilot.fixes import AsyncCheckpoint, Run
from lightning_accel.core.autopilot import Outcome, TrialRecord

__all__ = ["trial_async_checkpoint"]

#: a slow disk's write speed (bytes/s) for the no-measurement bound on a save's cost (a network file system or a
#: throttled cloud volume; local NVMe writes 10-30x faster)
SLOW_DISK_BYTES_PER_S = 100e6
#: bytes per parameter byte a checkpoint holds at most before it is measured: the weights and two optimizer
#: moments (Adam); the optimizer's state does not exist yet when the Autopilot runs (it is created at the first step)
CHECKPOINT_BYTES_PER_PARAM_BYTE = 3


# ------------------------------------------------------------------------------------------------ the trial
def _cadence(run: Run) -> int | None:
    """Optimizer steps between two saves of the fit's most frequent step/epoch-cadence ``ModelCheckpoint``."""
    from lightning_accel._compat import checkpoint_every_n_train_steps
    from lightning_accel.callbacks._fit.trainer_state import steps_per_epoch
    from lightning_accel.core.checkpoint_cost import steps_between_saves

    try:
        per_epoch: int | None = steps_per_epoch(run.trainer, run.source.batches(), run.config.accumulate)
    except TypeError:  # an iterable dataset: no length
        per_epoch = None
    cadences = [
        steps_between_saves(checkpoint_every_n_train_steps(cb), cb.every_n_epochs, per_epoch)
        for cb in run.trainer.checkpoint_callbacks
    ]
    known = [c for c in cadences if c]
    return min(known) if known else None


def _checkpoint_bytes_bound(run: Run) -> int:
    module = run.module
    param = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return CHECKPOINT_BYTES_PER_PARAM_BYTE * param + buffers


class _TrialFile:
    """The trial's checkpoint path, next to the user's checkpoints (the same disk), removed afterwards."""

    def __init__(self, run: Run) -> None:
        trainer = run.trainer
        callback = trainer.checkpoint_callback or trainer.checkpoint_callbacks[0]
        directory = Path(callback.dirpath or trainer.default_root_dir)
        token = uuid.uuid4().hex[:8]
        if trainer.world_size > 1:
            token = trainer.strategy.broadcast(token, src=0)
        self.trainer = trainer
        self.directory = directory
        self.created_directory = not directory.exists()
        self.path = directory / f".autopilot-checkpoint-trial-{token}.ckpt"

    def remove(self) -> None:
        if self.trainer.is_global_zero:
            try:
                self.path.unlink(missing_ok=True)
                if self.created_directory and self.directory.exists() and not any(self.directory.iterdir()):
                    self.directory.rmdir()
            except OSError:
                pass
        self.trainer.strategy.barrier("autopilot-checkpoint-trial")


def _period(run: Run, file: _TrialFile, steps: int, weights_only: bool) -> tuple[float, float]:
    """Wall seconds of one save plus ``steps`` training steps (and, written in the background, until the write is
    done), and of the ``save_checkpoint`` call alone (what it blocks the training thread for); the slowest rank's."""
    from lightning_accel.callbacks._fit.trainer_state import gather_floats
    from lightning_accel.checkpoint_io import OrderedAsyncCheckpointIO

    trainer = run.trainer
    io = trainer.strategy.checkpoint_io
    start = time.perf_counter()
    trainer.save_checkpoint(file.path, weights_only=weights_only)
    saved = time.perf_counter()
    run.runner.measure(0, steps)
    if isinstance(io, OrderedAsyncCheckpointIO):
        io.wait()
    local = [time.perf_counter() - start, saved - start]
    rows = gather_floats(trainer, trainer.strategy.root_device, local, what="Autopilot checkpoint trial")
    return float(rows[:, 0].max()), float(rows[:, 1].max())


def trial_async_checkpoint(
    run: Run,
    candidate: AsyncCheckpoint,
    *,
    index: int,
    gate: float,
    steps: int,
    steps_left: int | None,
    step_seconds: float | None,
) -> TrialRecord | None:
    """Trial the background write (see the module docstring): the row for the table, or ``None`` when the fit's
    saves cost too little to ask (no row: most fits) or nothing was measured to say (``step_seconds`` of the
    current configuration: the search's last window, or its estimate when the fit was too short to search).
    ``candidate`` stays applied when the row says kept."""
    from lightning_accel.core.autopilot import measure_pairs
    from lightning_accel.core.checkpoint_cost import checkpoint_share, why_not_trial

    if candidate.unavailable(run) is not None:
        return None
    between = _cadence(run)
    if between is None:
        return None
    if step_seconds is None or step_seconds <= 0:
        return None
    step_s = step_seconds
    k = max(1, min(between, steps))
    if why_not_trial(_checkpoint_bytes_bound(run) / SLOW_DISK_BYTES_PER_S, between, step_s, steps_left, k):
        return None  # even a slow disk would make saving too cheap to be worth a measured save
    record = TrialRecord(index, candidate.name, candidate.describe(run), None, None, False, "")
    weights_only = any(cb.save_weights_only for cb in run.trainer.checkpoint_callbacks)
    file = _TrialFile(run)
    started = time.perf_counter()
    undo = None
    try:
        sync_a, save_s = _period(run, file, k, weights_only)
        # the period's own k steps time the step again: fresher and longer than the few steps of an estimate
        # (a 3-step estimate on a loaded machine can come out at 8x the step, and a 0.15 s save every 10 steps was
        # costed out of its trial)
        if sync_a > save_s:
            step_s = (sync_a - save_s) / k
        share = checkpoint_share(save_s, between, step_s)
        why = why_not_trial(save_s, between, step_s, steps_left, k)
        if why is not None:
            record.outcome = Outcome.NOT_TRIALLED
            record.reason = f"not trialled: one save measured {save_s:.2f} s; {why}"
            return record
        undo = candidate.apply(run)

        def background(first: bool) -> float:
            if first:
                # untimed: the writer thread starts and makes its first save (on a loaded machine the first
                # background period took 4x the next one, 1.0 s against 0.15 s, and the pair came out 0.27x for a
                # real 1.8x gain)
                _period(run, file, k, weights_only)
            return _period(run, file, k, weights_only)[0]

        def switch(on: bool) -> str | None:
            nonlocal undo
            if on:
                undo = candidate.apply(run)
            elif undo is not None:
                undo()
                undo = None
            return None

        # periods are seconds: a pair's speed-up is the synchronous period over the background one
        pairs = measure_pairs(
            sync_a,
            b=background,
            a=lambda: _period(run, file, k, weights_only)[0],
            switch=switch,
            ratio=lambda async_s, sync_s: sync_s / max(async_s, 1e-12),
            gate=gate,
            confirm=lambda ratio: True,  # always both pairs: a save's period is too noisy for one
            third=lambda: False,
        )
        switch(False)
        keep, reason, ratios = pairs.keep, pairs.reason, pairs.ratios
        record.ratio = sum(ratios) / len(ratios)
        sync_s = (sync_a + (pairs.again or sync_a)) / 2
        detail = (
            f"saving measured {100 * share:.1f} % of the fit (one save {save_s:.2f} s every {between} "
            f"steps); one save + {k} steps: {sync_s:.2f} s written on the training thread, "
            f"{sum(pairs.windows) / len(pairs.windows):.2f} s in the background"
        )
        if keep:  # back on for the training (its undo stays with the candidate, as for every kept change)
            candidate.apply(run)
            record.kept = True
        record.reason = f"{reason}; {detail}"
        return record
    except Exception as err:  # noqa: BLE001 - the trial must not cost the user the training
        record.outcome, record.reason = Outcome.FAILED, f"failed during the trial: {type(err).__name__}: {err}"
        record.kept = False
        return record
    finally:
        if undo is not None:
            try:
                undo()
            except Exception:  # noqa: BLE001 - reported through the row's reason already
                pass
        file.remove()
        record.seconds = time.perf_counter() - started
