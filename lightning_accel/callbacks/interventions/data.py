"""The input-pipeline fixes: more loader workers (:class:`DataLoaderSettings`), pinned memory (:class:`PinMemory`),
background prefetch (:class:`Prefetch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks.interventions.base import Intervention

if TYPE_CHECKING:
    from lightning_accel.callbacks.interventions.base import Run
    from lightning_accel.core.autopilot_search import Undo

__all__ = [
    "DataLoaderSettings",
    "PinMemory",
    "Prefetch",
    "feasible_worker_counts",
    "main_process_load_seconds",
    "worker_search_seconds",
]


#: A loader worker is taken to load a batch at most this many times faster than the main process did when it
#: loaded alone (``num_workers=0``, its data wait): on a 2-core CPU a worker of the sleeping dataset of
#: ``bench_autopilot.py`` takes 29 ms a batch against 24 ms in the main process (it shares the cores with the step).
WORKER_SPEEDUP_BOUND = 2.0
#: prior seconds to start one loader worker (a fork of the training process and its first batch); each setting the
#: worker search measures starts a fresh loader
WORKER_START_SECONDS = 0.2
#: batches each measured setting iterates beyond its workers' queue: ``loader_batches_per_sec(loader, 2, 20, ...)``
#: (2 untimed + 21 stamps)
SEARCH_BATCHES = 23
#: the rate a setting must exceed the step's consumption by to feed it (``choose_loader_setting``'s margin)
FEED_MARGIN = 0.2


def main_process_load_seconds(window: Any, accumulate: int) -> float:
    """Seconds the training process took to load one batch, from a window of a loader without workers (its data
    wait per optimizer step spread over the step's micro-batches)."""
    return window.stage_seconds.get("data", 0.0) / (window.steps * max(1, accumulate))


def feasible_worker_counts(
    counts: list[int], window: Any, accumulate: int, consumption: float, current_workers: int
) -> list[int]:
    """The worker counts worth measuring: from a loader without workers, whose data wait per batch is the load time
    of one batch, a count that could not feed ``consumption`` batches/s even at :data:`WORKER_SPEEDUP_BOUND` times
    that speed is left out (at least the largest count stays). On the 300-step data-bound fit of
    ``bench_autopilot_real.py --short`` the walk measured one worker twice (prefetch 2 and 4) before two: 1.2 s of
    a 3.7 s search, for a count that loads 41 batches/s where the step takes 111."""
    if current_workers != 0 or window is None or not window.steps:
        return counts
    per_batch = main_process_load_seconds(window, accumulate)
    if per_batch <= 0:
        return counts
    return [w for w in counts if w * WORKER_SPEEDUP_BOUND / per_batch >= consumption] or counts[-1:]


def worker_search_seconds(grid: list[tuple[int, int]], per_batch: float, consumption: float, cores: int) -> float:
    """Seconds the worker search (``choose_loader_setting`` over ``grid``, (workers, prefetch) cheapest first) is
    expected to take when the main process loads a batch in ``per_batch`` seconds: each setting starts its workers
    and iterates :data:`SEARCH_BATCHES` + its queue with up to ``cores`` of them loading at once; the first setting
    expected to feed ``consumption`` batches/s is measured twice and ends the walk. On the real-model scripts of
    ``bench_autopilot_real.py`` the walk takes 4-11 s, against ~3-4 s for the trial's windows alone."""
    from lightning_accel.callbacks.dataloader_tuner import loader_feeds

    total = 0.0
    for workers, prefetch in grid:
        parallel = max(1, min(workers, cores))
        one = workers * WORKER_START_SECONDS + (SEARCH_BATCHES + workers * prefetch) * per_batch / parallel
        if loader_feeds(workers, parallel / max(per_batch, 1e-12), consumption, FEED_MARGIN):
            return total + 2 * one
        total += one
    return total


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
        busy = max(window.step_seconds - window.stage_seconds.get("data", 0.0) / max(window.steps, 1), 1e-9)
        consumption = run.config.accumulate / busy
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
