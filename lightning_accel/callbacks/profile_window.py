"""ProfileWindow: a short ``torch.profiler`` trace of a few training steps, at a chosen step or on request (from a
person, or from ``BottleneckDoctor`` when a finding fires). Its files and schedule: ``docs/measuring/traces.md``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._atomic import atomic_path, atomic_write_text
from lightning_accel._checks import check_int
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ProfileWindow"]


class ProfileWindow(Callback):
    """Records a ``torch.profiler`` trace of ``active`` training steps at step ``at_step`` and/or on request.

    ``Trainer(callbacks=[ProfileWindow(at_step=100, active=5)])`` writes a Chrome trace and a top-ops table of
    global steps 102..106 (after ``wait=1`` + ``warmup=1`` steps) into ``<default_root_dir>/profile``.
    ``window.request("data stage 60% of the step")`` (e.g. from ``BottleneckDoctor``) opens a window at the next
    training batch instead.

    Args:
        dirpath: directory for the files (created); default ``<trainer.default_root_dir>/profile``.
        at_step: open a window when ``trainer.global_step`` reaches this; ``None``: only on :meth:`request`.
        wait: steps after the window opens that are not recorded at all.
        warmup: steps the profiler runs but discards (its start-up cost settles).
        active: steps recorded into the trace.
        max_windows: windows per ``fit`` at most (requests beyond it are refused); keeps a chatty trigger from
            profiling the whole run.
        row_limit: rows in the top-ops table.
        record_shapes: record input shapes of ops (bigger trace; lets the table group by shape).
        with_stack: record Python stacks (much bigger trace, more overhead).
        profile_memory: record tensor allocations.

    After each window, :attr:`windows` holds a dict per window: ``reason``, ``start_step``, ``steps_recorded``,
    ``trace`` and ``table`` (paths).
    """

    def __init__(
        self,
        *,
        dirpath: str | os.PathLike | None = None,
        at_step: int | None = None,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        max_windows: int = 1,
        row_limit: int = 25,
        record_shapes: bool = False,
        with_stack: bool = False,
        profile_memory: bool = False,
    ) -> None:
        if at_step is not None:
            check_int("ProfileWindow", "at_step", at_step, minimum=0, example=100)
        self.wait = check_int("ProfileWindow", "wait", wait, minimum=0, example=1)
        self.warmup = check_int("ProfileWindow", "warmup", warmup, minimum=0, example=1)
        self.active = check_int("ProfileWindow", "active", active, example=3)
        self.max_windows = check_int("ProfileWindow", "max_windows", max_windows, example=1)
        self.row_limit = check_int("ProfileWindow", "row_limit", row_limit, example=25)
        self.at_step = at_step
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.record_shapes, self.with_stack, self.profile_memory = record_shapes, with_stack, profile_memory
        self.windows: list[dict[str, Any]] = []
        self._pending: str | None = None
        self._profiler: torch.profiler.profile | None = None
        self._current: dict[str, Any] | None = None
        self._steps_in_window = 0
        self._at_step_done = False
        self._dir: Path | None = None
        self._rank = 0
        self._cuda = False

    @property
    def active_window(self) -> bool:
        """Whether a window is being profiled now."""
        return self._profiler is not None

    def request(self, reason: str) -> bool:
        """Open a window at the next training batch. Returns False (and does nothing) when one is open or pending,
        or ``max_windows`` were taken already.

        Args:
            reason: why; written at the top of the top-ops table (e.g. the finding that fired).
        """
        if self._profiler is not None or self._pending is not None or len(self.windows) >= self.max_windows:
            return False
        self._pending = str(reason)
        return True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._dir = self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "profile"
        self._rank = trainer.global_rank
        self._cuda = trainer.strategy.root_device.type == "cuda"

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is not None:
            return
        from lightning_accel.callbacks.doctor.attribution import profiling

        if profiling():  # another profiler (the doctor's attribution window) records: open after it
            return
        if (
            self.at_step is not None
            and not self._at_step_done
            and trainer.global_step >= self.at_step
            and len(self.windows) < self.max_windows
        ):
            self._at_step_done = True
            self._open(trainer, f"at_step={self.at_step}")
        elif self._pending is not None:
            reason, self._pending = self._pending, None
            self._open(trainer, reason)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None:
            return
        self._steps_in_window += 1
        self._profiler.step()
        if self._steps_in_window >= self.wait + self.warmup + self.active:
            self._close()  # the trace was written by step(); this drops the profiler

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profiler is not None:
            done = max(0, self._steps_in_window - self.wait - self.warmup)
            rank_zero_warn(
                f"ProfileWindow: training ended {done} of {self.active} recorded steps into the window; "
                "the trace holds only those (open the window earlier or lower `active`)."
            )
            self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)
        if self._profiler is not None:  # fit failed mid-window: stop profiling, keep what was recorded
            self._close()
        self._pending = None

    def _open(self, trainer: pl.Trainer, reason: str) -> None:
        assert self._dir is not None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._current = {
            "reason": reason,
            "start_step": trainer.global_step,
            "steps_recorded": 0,
            "trace": None,
            "table": None,
        }
        self._steps_in_window = 0
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
            profile_memory=self.profile_memory,
        )
        self._profiler.start()

    def _close(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # writes a partial window if recording had begun (torch calls on_trace_ready)
        if self._current is not None:
            self.windows.append(self._current)
            self._current = None

    def _write(self, profiler: torch.profiler.profile) -> None:
        assert self._dir is not None and self._current is not None
        self._dir.mkdir(parents=True, exist_ok=True)
        stem = f"step{self._current['start_step']}_rank{self._rank}"
        trace = self._dir / f"trace_{stem}.json"
        table = self._dir / f"top_ops_{stem}.txt"
        recorded = max(0, min(self.active, self._steps_in_window - self.wait - self.warmup))
        first = self._current["start_step"] + self.wait + self.warmup
        with atomic_path(trace) as tmp:
            profiler.export_chrome_trace(str(tmp))
        sort_by = "self_device_time_total" if self._cuda else "self_cpu_time_total"
        text = (
            f"ProfileWindow trace: {trace.name}\nreason: {self._current['reason']}\n"
            f"recorded global steps {first}..{first + recorded - 1} ({recorded} steps, after {self.wait} wait + "
            f"{self.warmup} warm-up), rank {self._rank}; sorted by {sort_by}\n\n"
            + profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
            + "\n"
        )
        atomic_write_text(table, text)
        self._current.update(steps_recorded=recorded, trace=str(trace), table=str(table))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"windows": list(self.windows), "at_step_done": self._at_step_done}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.windows = list(state_dict.get("windows", []))
        self._at_step_done = bool(state_dict.get("at_step_done", False))
