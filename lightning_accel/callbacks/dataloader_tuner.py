"""DataLoaderTuner: the cheapest DataLoader setting (workers, prefetch) that keeps the training step fed."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from typing_extensions import override

from lightning_accel._checks import check_int, is_int
from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource, fit_data_holder
from lightning_accel.callbacks._fit.step_runner import (
    StepRunner,
    TrainingState,
    iterate_batches,
    missing_attribute_error,
)
from lightning_accel.callbacks._fit.trainer_state import agree_across_ranks, rank_zero_print
from lightning_accel.core.utilisation import usable_cores_per_rank
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DataLoaderTuner", "LoaderSetting", "choose_loader_setting", "loader_batches_per_sec", "loader_feeds"]


@dataclass(frozen=True)
class LoaderSetting:
    """One point of the grid, cheapest first: fewer workers, then a smaller prefetch queue."""

    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    pin_memory: bool

    def label(self) -> str:
        if self.num_workers == 0:
            return "0 workers (main process)"
        return f"{self.num_workers} workers, prefetch {self.prefetch_factor}" + (", pinned" if self.pin_memory else "")


def default_worker_counts(cores: int) -> list[int]:
    """0, 1, 2, 4, ... up to ``cores``, plus ``cores`` itself (the method page: start near ¼–½ of the cores, tune up)."""
    counts, w = [0], 1
    while w <= cores:
        counts.append(w)
        w *= 2
    if cores >= 1 and counts[-1] != cores:
        counts.append(cores)
    return counts


#: with ``num_workers=0`` loading is serial with the step; at most this share of the step time may go to it (the same
#: 10 % above which ``BottleneckDoctor`` reports a data wait)
SERIAL_DATA_SHARE = 0.10


class DataLoaderTuner(Callback):
    """Picks ``num_workers`` / ``prefetch_factor`` (with ``persistent_workers``, and ``pin_memory`` on GPU) at the start
    of ``fit``: the cheapest setting whose measured batches/s feeds the training step with a margin.

    1. **Consumption**: the training step (forward + backward + optimizer step, no data loading) is timed on a few
       real batches already on the device; ``1 / median step time`` is the rate the loader must sustain. The step is
       undone bit for bit (parameters, optimizer, RNG — see :class:`~lightning_accel.BatchSizeTuner`).
    2. **Supply**: for each grid point, cheapest first (0 workers; then 1, 2, 4, … up to this rank's share of the
       CPU cores, each with ``prefetch_factors``), the user's ``train_dataloader()`` is rebuilt with those
       attributes set and timed in steady state: the first ``trial_warmup_batches`` batches plus the prefetch queue
       (workers × prefetch) are skipped, so worker start-up and pre-filled queues do not inflate the rate.
    3. **Decision**: the first setting that feeds the step in two consecutive measurements (the lower one counts)
       wins and the search stops there. Workers load in parallel with the step, so their rate must be ≥
       consumption × (1 + ``margin``); with 0 workers loading is serial and adds to every step, so it passes only
       if it costs at most 10 % of the step (rate ≥ 9 × consumption, the doctor's data-wait threshold);
       if none does, the cheapest within 5 % of the fastest (the data stage stays the bottleneck: see the table).
       Under DDP every rank measures, and all ranks adopt the most generous choice among them (one
       ``all_gather``).

    The choice is applied by setting the attributes on the LightningModule / datamodule (looked up like Lightning's
    ``batch_size``: module, hparams, datamodule) before the fit loop builds its dataloader, so the user's
    ``train_dataloader()`` must read them. Settings whose attribute is absent are left alone (only ``num_workers`` is
    required). A ``DataLoader`` passed straight to ``trainer.fit(model, loader)`` has no attributes: it is re-created
    from its own constructor arguments with each setting (every setting is tuned), and the fit trains on the re-created
    loader with the choice, the way the Autopilot does (``callbacks/_fit/loader_source.py``). The sequence of samples is
    unchanged: the tuner's iterations draw from the global RNGs and any ``torch.Generator`` on the loader or its
    sampler, and all are restored, so a seeded run sees the same batches in the same order with or without the tuner
    (PyTorch keeps batch order with any number of workers). Only randomness drawn *inside workers* (augmentations seeded
    per worker: ``base_seed + worker_id``) follows the worker count, as with any change of ``num_workers``.

    Caveat: on a CPU-only run the loader is measured alone, while in training its workers share the cores with the
    step's intra-op threads; ``margin`` absorbs part of that.

    Logged once through every logger (``logger.log_metrics``):

    ========================================  ============  ==============================================
    key                                       unit          scope
    ========================================  ============  ==============================================
    ``dataloader/num_workers``                workers       per rank (adopted by all ranks)
    ``dataloader/prefetch_factor``            batches       per worker (0 when num_workers is 0)
    ``dataloader/loader_batches_per_sec``     batches/s     this rank's loader with the chosen setting
    ``dataloader/step_batches_per_sec``       batches/s     this rank's training step (consumption)
    ``dataloader/speedup_vs_initial``         ratio         chosen ÷ the user's initial setting (loader)
    ========================================  ============  ==============================================

    Args:
        num_workers: worker counts to try (default: 0, 1, 2, 4, … up to this rank's cores).
        prefetch_factors: ``prefetch_factor`` values tried for each worker count > 0 (the method's 2–8 range).
        margin: required headroom of supply over consumption (0.2 = 20 %).
        batches_per_trial: batches timed per setting (after warm-up).
        trial_warmup_batches: batches skipped per setting before timing (plus the prefetch queue).
        consumption_steps: training steps timed to measure consumption (the first is warm-up).
        num_workers_attr: attribute holding ``num_workers``; ``prefetch_factor_attr``, ``persistent_workers_attr``,
            ``pin_memory_attr`` likewise (optional).
        print_summary: print the decision table on rank 0.

    After the search, :attr:`table` holds the measured rows (dicts) and :attr:`decision` the chosen setting and rates.
    """

    def __init__(
        self,
        *,
        num_workers: Sequence[int] | None = None,
        prefetch_factors: Sequence[int] = (2, 4),
        margin: float = 0.2,
        batches_per_trial: int = 20,
        trial_warmup_batches: int = 2,
        consumption_steps: int = 6,
        num_workers_attr: str = "num_workers",
        prefetch_factor_attr: str = "prefetch_factor",
        persistent_workers_attr: str = "persistent_workers",
        pin_memory_attr: str = "pin_memory",
        print_summary: bool = True,
    ) -> None:
        if num_workers is not None:
            num_workers = sorted(set(num_workers))
            if not num_workers or any(not is_int(w) or w < 0 for w in num_workers):
                raise ValueError(
                    f"DataLoaderTuner(num_workers={num_workers!r}): give worker counts >= 0, e.g. "
                    "(0, 2, 4), or None for 0..cores"
                )
        prefetch_factors = sorted(set(prefetch_factors))
        if not prefetch_factors or any(not is_int(p) or p < 1 for p in prefetch_factors):
            raise ValueError(f"DataLoaderTuner(prefetch_factors={prefetch_factors!r}): give ints >= 1, e.g. (2, 4)")
        if not isinstance(margin, (int, float)) or margin < 0:
            raise ValueError(f"DataLoaderTuner(margin={margin!r}): give a fraction >= 0, e.g. 0.2")
        for name, value, low in (
            ("batches_per_trial", batches_per_trial, 2),
            ("trial_warmup_batches", trial_warmup_batches, 0),
            ("consumption_steps", consumption_steps, 2),
        ):
            check_int("DataLoaderTuner", name, value, minimum=low)
        self.num_workers = num_workers
        self.prefetch_factors = tuple(prefetch_factors)
        self.margin = float(margin)
        self.batches_per_trial = batches_per_trial
        self.trial_warmup_batches = trial_warmup_batches
        self.consumption_steps = consumption_steps
        self.attrs = {
            "num_workers": num_workers_attr,
            "prefetch_factor": prefetch_factor_attr,
            "persistent_workers": persistent_workers_attr,
            "pin_memory": pin_memory_attr,
        }
        self.print_summary = print_summary
        self.table: list[dict[str, Any]] = []
        self.decision: dict[str, Any] = {}
        self._not_a_dataloader: str | None = None  # the pipeline's name when the train data is not a DataLoader

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        holder = fit_data_holder(trainer)  # None: a DataLoader passed to fit(), rebuilt with each setting
        pipeline = getattr(holder, "pipeline_settings", None)
        self._not_a_dataloader = None
        if isinstance(pipeline, Mapping):  # e.g. DALIImageDataModule: threads in one process, no workers to tune
            loader = pipeline.get("loader", type(holder).__name__)
            self._not_a_dataloader = loader
            rank_zero_warn(
                f"DataLoaderTuner: the training data comes from {loader}, not a DataLoader, so there are "
                f"no workers to tune and the tuner does nothing; that pipeline's knobs are num_threads "
                f"and prefetch_queue_depth (BottleneckDoctor's data finding names them when data is slow)"
            )
            return
        if holder is not None and not lightning_hasattr(pl_module, self.attrs["num_workers"]):
            raise missing_attribute_error(
                trainer,
                pl_module,
                "DataLoaderTuner",
                self.attrs["num_workers"],
                "Add `self.num_workers = 0` and build the train DataLoader from it, or "
                "pass num_workers_attr='<your attribute>'",
            )
        from lightning_accel.callbacks.batch_size_tuner import BatchSizeTuner

        callbacks = trainer.callbacks
        mine = callbacks.index(self)
        if any(isinstance(cb, BatchSizeTuner) for cb in callbacks[mine + 1 :]):
            rank_zero_warn(
                "DataLoaderTuner runs before BatchSizeTuner in the callback list, so it tunes for the old "
                "batch size: put BatchSizeTuner first"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._not_a_dataloader is None:
            self.tune(trainer, pl_module)

    # ------------------------------------------------------------------ the search
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)

    def _source(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainLoaderSource:
        return TrainLoaderSource(trainer, pl_module, attribute_names=self.attrs, require_dataloader=False)

    def _present(self, source: TrainLoaderSource) -> dict[str, bool]:
        """Per setting, whether the tuner varies it: through its attribute, or any of them for a fit() loader."""
        return {k: source.holder is None or source.attributes[k] for k in self.attrs}

    def _grid(self, trainer: pl.Trainer, present: dict[str, bool]) -> list[LoaderSetting]:
        pin = trainer.strategy.root_device.type == "cuda" and present["pin_memory"]
        counts = (
            self.num_workers
            if self.num_workers is not None
            else default_worker_counts(usable_cores_per_rank(trainer.num_devices))
        )
        grid = []
        for w in counts:
            if w == 0:
                grid.append(LoaderSetting(0, None, False, pin))
                continue
            for pf in self.prefetch_factors if present["prefetch_factor"] else (None,):
                grid.append(LoaderSetting(w, pf, present["persistent_workers"], pin))
        return grid

    @staticmethod
    def _settable(setting: LoaderSetting | dict[str, Any], present: dict[str, bool]) -> dict[str, Any]:
        values = asdict(setting) if isinstance(setting, LoaderSetting) else setting
        return {key: value for key, value in values.items() if present[key]}

    def _feeds(self, num_workers: int | None, rate: float, consumption: float) -> bool:
        return loader_feeds(num_workers, rate, consumption, self.margin)

    def tune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LoaderSetting | None:
        """Measure, decide, apply; returns the chosen setting (the same on every rank), or ``None`` when the train
        loader is too short to time (a warning says so and the settings stay as they are)."""
        source = self._source(trainer, pl_module)
        present = self._present(source)
        initial = {
            k: lightning_getattr(pl_module, name) if source.holder is not None else source.initial[k]
            for k, name in self.attrs.items()
            if present[k]
        }
        grid = self._grid(trainer, present)
        # every rank's loader has the same length (DistributedSampler), so every rank takes the same branch
        try:
            length = len(source.build())
        except TypeError:  # an iterable without len(): measure and let the trial say if it ran out
            length = None
        needed = (
            self.trial_warmup_batches
            + self.batches_per_trial
            + 1
            + max(s.num_workers * (s.prefetch_factor or 2) for s in grid)
        )
        if length is not None and length < needed:
            rank_zero_warn(
                f"DataLoaderTuner: the train loader has {length} batches, fewer than the {needed} the "
                f"largest trial needs ({self.trial_warmup_batches} warm-up + the workers' prefetch "
                f"queue + {self.batches_per_trial} timed); keeping the current settings {initial}. Use "
                "more data or lower batches_per_trial / trial_warmup_batches."
            )
            self.decision = {
                "skipped": f"train loader has {length} batches, a trial needs {needed}",
                "initial": initial,
            }
            return None
        state = TrainingState(trainer, pl_module)
        self.table = []
        error: BaseException | None = None
        chosen_index = -1
        try:
            consumption = self._consumption(trainer, pl_module, state, source)
            initial_rate = self._loader_rate(source, state, initial, present)
            self.table.append(
                {
                    "setting": "initial: " + _describe(initial, trainer),
                    "batches_per_sec": initial_rate,
                    "feeds": self._feeds(initial.get("num_workers", 0), initial_rate, consumption),
                    "chosen": False,
                }
            )
            chosen_index, rows = choose_loader_setting(
                grid,
                lambda setting: self._loader_rate(source, state, asdict(setting), present),
                consumption,
                self.margin,
            )
            self.table.extend(rows)
        except BaseException as err:  # noqa: BLE001 - every rank must reach the collective below before raising
            error = err
        finally:
            state.restore()
        choices = agree_across_ranks(trainer, float(chosen_index), error, "DataLoaderTuner measurement")
        adopted = int(choices.max())  # the most generous setting any rank needed (the grids are identical)
        setting = grid[adopted]
        source.set(self._settable(setting, present))
        source.install()  # the attributes the fit's train_dataloader() reads, or the fit() loader re-created
        own = math.nan  # this rank's rate for the adopted setting (nan if this rank stopped before measuring it)
        for row in self.table[1:]:
            row["chosen"] = row["setting"] == setting.label()
            if row["chosen"]:
                own = row["batches_per_sec"]
        self.decision = {
            **asdict(setting),
            "loader_batches_per_sec": own,
            "step_batches_per_sec": consumption,
            "initial": initial,
            "initial_batches_per_sec": initial_rate,
            "speedup_vs_initial": own / initial_rate if initial_rate > 0 else math.nan,
            "fed": self._feeds(setting.num_workers, own, consumption),
            "margin": self.margin,
        }
        metrics = {
            "dataloader/num_workers": setting.num_workers,
            "dataloader/prefetch_factor": setting.prefetch_factor or 0,
            "dataloader/loader_batches_per_sec": own,
            "dataloader/step_batches_per_sec": consumption,
            "dataloader/speedup_vs_initial": self.decision["speedup_vs_initial"],
        }
        for logger in trainer.loggers:
            logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)
        verdict = "feeds" if self.decision["fed"] else "does NOT feed (data-bound; see the table)"
        rank_zero_info(
            f"DataLoaderTuner: {setting.label()} -> {own:,.1f} batches/s, {verdict} the step's "
            f"{consumption:,.1f} batches/s with {self.margin:.0%} margin "
            f"(initial setting: {initial_rate:,.1f} batches/s)"
        )
        if self.print_summary:
            rank_zero_print(trainer, self._rich_table(consumption))
        return setting

    def _consumption(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: TrainingState, source: TrainLoaderSource
    ) -> float:
        """Training steps per second on real batches already on the device (no data loading timed)."""
        loader = source.build()
        state.track_loader(loader)
        runner = StepRunner(trainer, pl_module)
        batches = []
        for batch in iterate_batches(loader):
            batches.append(runner.to_device(batch))
            if len(batches) == self.consumption_steps:
                break
        if not batches:
            raise ValueError("train_dataloader() yielded no batches")
        steps = iter(batches * math.ceil(self.consumption_steps / len(batches)))
        try:
            with runner.quiet():
                pl_module.train()
                _, seconds = runner.timed_steps(steps, self.consumption_steps)
        finally:
            state.restore()
        return 1.0 / max(seconds or 0.0, 1e-9)

    def _loader_rate(
        self, source: TrainLoaderSource, state: TrainingState, values: dict[str, Any], present: dict[str, bool]
    ) -> float:
        """Steady-state batches/s of the train loader built with ``values``."""
        loader = source.build(self._settable(values, present))
        state.track_loader(loader)
        workers = values.get("num_workers", 0)
        got = getattr(loader, "num_workers", workers)
        if got != workers:
            raise ValueError(
                f"train_dataloader() built a DataLoader with num_workers={got} after "
                f"`{self.attrs['num_workers']}` was set to {workers}: build it from that attribute "
                f"(DataLoader(..., num_workers=self.{self.attrs['num_workers']}))"
            )
        try:
            return loader_batches_per_sec(
                loader, self.trial_warmup_batches, self.batches_per_trial, workers, values.get("prefetch_factor")
            )
        finally:
            del loader  # shuts the workers down (persistent ones too: the loader goes away)

    def _rich_table(self, consumption: float) -> Any:
        from rich.table import Table

        need = consumption * (1 + self.margin)
        table = Table(
            title=f"DataLoaderTuner (rank 0): the step consumes {consumption:,.1f} batches/s; "
            f"feeding it with {self.margin:.0%} margin needs {need:,.1f}",
            header_style="bold",
        )
        table.add_column("setting")
        table.add_column("batches/s", justify="right")
        table.add_column("feeds the step", justify="center")
        table.add_column("chosen", justify="center")
        for row in self.table:
            table.add_row(
                row["setting"],
                f"{row['batches_per_sec']:,.1f}",
                "yes" if row["feeds"] else "no",
                "◀" if row["chosen"] else "",
            )
        return table


def loader_feeds(num_workers: int | None, rate: float, consumption: float, margin: float) -> bool:
    """Whether a loader delivering ``rate`` batches/s keeps a step consuming ``consumption`` batches/s busy.

    Workers load in parallel with the step, so their rate must exceed the step's with ``margin``. With
    ``num_workers=0`` loading runs serially in the training process and always adds to the step: it passes only
    when it costs at most :data:`SERIAL_DATA_SHARE` of the step time (the doctor's data-wait threshold).
    """
    if not num_workers:
        return rate >= consumption * (1 - SERIAL_DATA_SHARE) / SERIAL_DATA_SHARE
    return rate >= consumption * (1 + margin)


def choose_loader_setting(
    grid: Sequence[LoaderSetting], measure: Callable[[LoaderSetting], float], consumption: float, margin: float
) -> tuple[int, list[dict[str, Any]]]:
    """Walk ``grid`` cheapest first and stop at the first setting whose measured rate feeds the step in two
    consecutive measurements (the lower one counts: a busy machine can flatter one window); if none does, the
    cheapest within 5 % of the fastest (closer than that is measurement noise). Returns the index in ``grid`` and
    one table row per measured setting. Shared by :class:`DataLoaderTuner` and the Autopilot."""
    rates: list[float] = []
    rows: list[dict[str, Any]] = []
    for setting in grid:
        rate = measure(setting)
        feeds = loader_feeds(setting.num_workers, rate, consumption, margin)
        if feeds:
            rate = min(rate, measure(setting))
            feeds = loader_feeds(setting.num_workers, rate, consumption, margin)
        rates.append(rate)
        rows.append(
            {"setting": setting.label(), "batches_per_sec": rate, "feeds": feeds, "chosen": False, **asdict(setting)}
        )
        if feeds:
            break
    if not rates:
        raise ValueError("choose_loader_setting: the grid of DataLoader settings is empty")
    fed = [i for i, r in enumerate(rates) if loader_feeds(grid[i].num_workers, r, consumption, margin)]
    return (fed[0] if fed else next(i for i, r in enumerate(rates) if r >= 0.95 * max(rates))), rows


def loader_batches_per_sec(
    loader: Any, warmup_batches: int, batches: int, num_workers: int, prefetch_factor: int | None
) -> float:
    """Steady-state batches/s of iterating ``loader``: the first ``warmup_batches`` plus the queue the workers fill
    before the first batch is consumed (DataLoader's default ``prefetch_factor`` is 2) are not timed."""
    skip = warmup_batches + num_workers * (prefetch_factor or (2 if num_workers else 0))
    stamps: list[float] = []
    it = iter(iterate_batches(loader))
    try:
        for i, _batch in enumerate(it):
            if i >= skip:
                stamps.append(time.perf_counter())
            if len(stamps) > batches:
                break
    finally:
        it.close()  # type: ignore[attr-defined]
        del it
    if len(stamps) < 3:
        raise ValueError(
            f"the train dataloader has too few batches to time ({skip} warm-up + "
            f"{batches}); lower trial_warmup_batches / batches_per_trial"
        )
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    # mean over the window (a median would hide periodic stalls, e.g. one slow worker every N batches)
    return len(gaps) / max(sum(gaps), 1e-9) if statistics.fmean(gaps) > 0 else math.inf


def _describe(values: dict[str, Any], trainer: pl.Trainer) -> str:
    workers = int(values.get("num_workers") or 0)
    return LoaderSetting(
        workers,
        values.get("prefetch_factor") or (2 if workers else None),
        bool(values.get("persistent_workers")),
        bool(values.get("pin_memory")),
    ).label()
