"""The input-pipeline fixes: more loader workers (:class:`DataLoaderSettings`), pinned memory (:class:`PinMemory`),
background prefetch (:class:`Prefetch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.autopilot.fixes.base import Intervention
from lightning_accel.core.autopilot.budget import (
    FEED_MARGIN,
    feasible_worker_counts,
    main_process_load_seconds,
    step_consumption,
    worker_search_seconds,
)

if TYPE_CHECKING:
    from lightning_accel.callbacks.autopilot.fixes.base import Run
    from lightning_accel.core.autopilot import Undo

__all__ = ["DataLoaderSettings", "PinMemory", "Prefetch"]


class DataLoaderSettings(Intervention):
    """More loader workers: the cheapest setting that feeds the measured step, found by DataLoaderTuner's search
    (``choose_loader_setting``) over 0, 1, 2, 4, … workers × prefetch 2 and 4 with persistent workers."""

    name = "dataloader"
    kind = "data"
    knobs = ("num_workers", "prefetch_factor", "persistent_workers")

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.dataloader_tuner import default_worker_counts
        from lightning_accel.core.utilisation import usable_cores_per_rank

        if self.params:
            return None
        current = run.source.current()["num_workers"]
        if max(default_worker_counts(usable_cores_per_rank(run.trainer.num_devices))) <= current:
            return f"num_workers={current} already uses every core of this rank"
        return None

    def _search_grid(self, run: Run) -> tuple[list[tuple[int, int]], float]:
        """The (workers, prefetch) settings the worker search walks, cheapest first, and the batches/s the step
        consumes (steps/s of everything but the data wait, × the micro-batches of a step)."""
        from lightning_accel.callbacks.dataloader_tuner import default_worker_counts
        from lightning_accel.core.utilisation import usable_cores_per_rank

        window = run.current or run.baseline
        assert window is not None
        consumption = step_consumption(window, run.config.accumulate)
        current = run.source.current()["num_workers"]
        counts = [w for w in default_worker_counts(usable_cores_per_rank(run.trainer.num_devices)) if w > current]
        if not counts:
            raise ValueError(f"no worker count above the current {current} fits this rank's cores")
        counts = feasible_worker_counts(counts, window, run.config.accumulate, consumption, current)
        return [(w, pf) for w in counts for pf in (2, 4)], consumption

    def setup_seconds(self, run: Run) -> float:
        """The worker search the trial runs before its windows (:func:`worker_search_seconds`), from the main
        process's measured load time; nothing for a replayed setting, or a loader with workers already (its data
        wait is no load time)."""
        from lightning_accel.core.utilisation import usable_cores_per_rank

        window = run.current or run.baseline
        if self.params or window is None or not window.steps or run.source.current()["num_workers"] != 0:
            return 0.0
        per_batch = main_process_load_seconds(window, run.config.accumulate)
        if per_batch <= 0:
            return 0.0
        grid, consumption = self._search_grid(run)
        return worker_search_seconds(grid, per_batch, consumption, usable_cores_per_rank(run.trainer.num_devices))

    def _choose(self, run: Run) -> dict[str, Any]:
        from lightning_accel.callbacks.dataloader_tuner import (
            LoaderSetting,
            choose_loader_setting,
            loader_batches_per_sec,
        )

        pairs, consumption = self._search_grid(run)
        pin = bool(run.source.current()["pin_memory"])
        grid = [LoaderSetting(w, pf, True, pin) for w, pf in pairs]

        def measure(setting: LoaderSetting) -> float:
            values = {
                "num_workers": setting.num_workers,
                "prefetch_factor": setting.prefetch_factor,
                "persistent_workers": True,
            }
            loader = run.source.build(values)
            run.runner.state.track_loader(loader)
            try:
                return loader_batches_per_sec(loader, 2, 20, setting.num_workers, setting.prefetch_factor)
            finally:
                run.runner.state.restore()

        index, _ = choose_loader_setting(grid, measure, consumption, margin=FEED_MARGIN)
        chosen = grid[index]
        return {
            "num_workers": chosen.num_workers,
            "prefetch_factor": chosen.prefetch_factor,
            "persistent_workers": True,
        }

    def change(self, run: Run, undo: Undo) -> None:
        if not self.params:
            chosen = self._choose(run)
            if run.trainer.world_size > 1:  # each rank timed its own loader: rank 0's choice for every rank
                chosen = run.trainer.strategy.broadcast(chosen, src=0)
            self.params = chosen
        before = {k: run.source.current()[k] for k in self.params}
        undo.push(lambda: run.source.set(before))
        run.source.set(self.params)

    def describe(self, run: Run) -> str:
        p = self.params
        if not p:
            return "DataLoader workers (searched)"
        return f"num_workers={p['num_workers']}, prefetch_factor={p['prefetch_factor']}, persistent_workers=True"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return run.source.config_entries()


class PinMemory(Intervention):
    """``pin_memory=True``: page-locked host batches, so the host→device copy is a DMA that can overlap."""

    name = "pin_memory"
    kind = "data"
    knobs = ("pin_memory",)

    def unavailable(self, run: Run) -> str | None:
        if run.device.type != "cuda":
            return "pinned memory only speeds host-to-GPU copies; this run is on " + run.device.type
        if run.source.current()["pin_memory"]:
            return "the loader already pins memory"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = run.source.current()["pin_memory"]
        undo.push(lambda: run.source.set({"pin_memory": before}))
        run.source.set({"pin_memory": True})

    def describe(self, run: Run) -> str:
        return "pin_memory=True"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return run.source.config_entries()


class Prefetch(Intervention):
    """``DevicePrefetcher``: batches fetched ahead in a thread (on CUDA pinned and copied on a side stream)."""

    name = "prefetch"
    kind = "data"
    knobs = ("prefetch",)

    def unavailable(self, run: Run) -> str | None:
        from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

        if run.config.prefetch or any(isinstance(cb, DevicePrefetcher) for cb in run.trainer.callbacks):
            return "DevicePrefetcher is already in use"
        if run.device.type not in ("cpu", "cuda"):
            return f"no prefetching on {run.device.type}"
        return None

    def change(self, run: Run, undo: Undo) -> None:
        before = run.config.prefetch
        undo.push(lambda: setattr(run.config, "prefetch", before))
        run.config.prefetch = True

    def describe(self, run: Run) -> str:
        return "DevicePrefetcher (batches fetched ahead in a thread)"

    def config(self, run: Run) -> tuple[list[tuple[str, Any]], list[str]]:
        return (
            [("trainer.callbacks", [{"class_path": "lightning_accel.DevicePrefetcher"}])],
            ["callbacks.append(la.DevicePrefetcher())"],
        )
