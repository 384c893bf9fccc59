"""BatchSizeTuner: the largest (or the most efficient) batch that fits, found in a few real steps before training."""

from __future__ import annotations

import ctypes
import gc
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from typing_extensions import override

from lightning_accel import _compat
from lightning_accel._checks import check_int, is_int
from lightning_accel.callbacks._fit.loader_source import TrainLoaderSource, fit_data_holder
from lightning_accel.callbacks._fit.step_runner import (
    StepRunner,
    TrainingState,
    iterate_batches,
    missing_attribute_error,
    reload_train_dataloader,
)
from lightning_accel.callbacks._fit.trainer_state import agree_across_ranks, rank_zero_print
from lightning_accel.core.batch_size_search import (
    LR_RULES,
    BatchSizeSearch,
    find_batch_size,
    find_throughput_batch_size,
    lr_scale,
    split_global_batch,
)
from lightning_accel.core.memory_probe import PeakMemoryMeter, device_memory_capacity
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

_compat.require_versions("BatchSizeTuner")

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BatchSizeTuner"]

_MODES = ("max_fit", "throughput")
# param-group keys that hold a learning rate (torch schedulers: `initial_lr`; OneCycleLR: `max_lr`, `min_lr`)
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")


class BatchSizeTuner(Callback):
    """Sets the batch size before training from a memory model fitted to a few real training steps.

    At the start of ``fit`` (and at the start of any later epoch listed in ``epochs``) it runs the LightningModule's
    own ``training_step`` + backward + optimizer step on real batches from the user's ``train_dataloader()`` at a
    few batch sizes, measures each step's peak memory (CUDA allocator peak on GPU; the process's peak resident set
    on CPU, see :class:`~lightning_accel.core.memory_probe.PeakMemoryMeter`), fits ``fixed + per_sample × batch``
    and jumps to the largest batch the line puts under the budget, verifying it
    (:func:`~lightning_accel.core.batch_size_search.find_batch_size`: 3 probes on a linear memory curve where Lightning's
    ``BatchSizeFinder(mode="binsearch")`` takes ~20). Then it writes the batch size into the module's or
    datamodule's ``batch_size`` attribute (as ``BatchSizeFinder`` does), so the fit loop builds its dataloader with
    it. A ``DataLoader`` passed straight to ``trainer.fit(model, loader)`` (which ``BatchSizeFinder`` refuses) is
    re-created from its own constructor arguments at each probed size, and the fit trains on the re-created loader
    with the chosen size, the way the Autopilot does (``callbacks/_fit/loader_source.py``); a loader that batches with
    a custom batch sampler is refused (its batch size cannot be changed from outside).

    * ``mode="max_fit"``: the largest batch within the budget. ``mode="throughput"``: doubling from
      ``init_batch_size``, the largest batch that still raises samples/s by ``throughput_threshold`` (on CPUs and
      launch-bound GPUs a bigger batch stops paying off long before memory runs out).
    * Budget: ``memory_budget`` bytes if given, else ``memory_fraction`` × capacity (GPU: device memory; CPU: this
      process's RSS + the RAM the OS reports available). On CPU the budget bounds the whole process's peak RSS.
    * DDP: every rank searches on its own device and data; all ranks then adopt the smallest result (one
      ``all_gather`` through ``trainer.strategy``; no files). Probes bypass the DDP wrapper, so no gradient
      all-reduce runs and a rank that runs out of memory cannot hang the others.
    * ``target_global_batch_size``: sets ``trainer.accumulate_grad_batches`` so that micro-batch × devices ×
      accumulation equals the target exactly (the micro-batch is the largest divisor that fits).
    * ``lr_scaling``: when the effective batch (micro × devices × accumulation) changes, multiplies every learning
      rate of every optimizer (and the schedulers' base rates) by the ratio (``"linear"``, Goyal et al. 2017,
      arXiv:1706.02677) or its square root (``"sqrt"``, the rule the method page gives for accumulation; Krizhevsky
      2014, arXiv:1404.5997), and prints old → new.

    The search leaves no trace: parameters, buffers, gradients, optimizer and scheduler state, the AMP scaler, every
    RNG and the loop progress are restored bit for bit from an in-memory snapshot (Lightning's finder writes a
    checkpoint to disk instead); its steps are not counted as training and log nothing. A probe that fails for a
    reason other than out-of-memory is re-raised unchanged after the restore. Supported strategies: single device
    and DDP (and its subclasses, e.g. ``ddp_powersgd``); not DeepSpeed or FSDP.

    Logged once per search through every logger (``logger.log_metrics``, at the current ``global_step``):

    ==================================  =================  ================================================
    key                                 unit               scope
    ==================================  =================  ================================================
    ``tuner/batch_size``                samples            per device (micro-batch), adopted by all ranks
    ``tuner/accumulate_grad_batches``   micro-batches      per optimizer step
    ``tuner/global_batch_size``         samples            per optimizer step, all ranks
    ``tuner/lr_scale``                  ratio              new ÷ old learning rate (1.0 when unchanged)
    ``tuner/probes``                    probes             on this rank
    ``tuner/search_seconds``            s                  wall time of the search on this rank
    ``tuner/memory_budget_gb``          GB (1e9 bytes)     per device
    ==================================  =================  ================================================

    Args:
        mode: ``"max_fit"`` or ``"throughput"``.
        batch_arg_name: attribute holding the batch size, looked up like Lightning does: the module, its
            ``hparams``, the datamodule (and its ``hparams``).
        memory_fraction: fraction of capacity used as the budget (0.8: the method's "~80 % of the device").
        memory_budget: explicit budget in bytes per device (overrides ``memory_fraction``).
        init_batch_size: first size probed (halved on failure).
        max_batch_size: never probe above this (also capped at the per-rank dataset length).
        multiple_of: round to multiples of this (e.g. 8 for tensor cores).
        steps_per_trial: training steps per probe (default 2 for ``max_fit``, 4 for ``throughput``; the first step
            creates optimizer state, so one step underestimates the peak).
        max_probes: limit on probes per search.
        tolerance: stop when the model says less than this fraction is left to gain.
        throughput_threshold: ``throughput`` mode: minimum samples/s gain for a doubling to be taken.
        target_global_batch_size: keep micro × devices × accumulation equal to this.
        lr_scaling: ``"linear"``, ``"sqrt"`` or ``"none"``.
        epochs: epochs at whose start to search (0 = before training).
        memory_meter: an object with ``reset()`` and ``peak_bytes()`` measuring one step (default:
            :class:`~lightning_accel.core.memory_probe.PeakMemoryMeter` of the device). For allocators it does not
            know, or a simulated device in tests and benchmarks.
        print_summary: print the probe table on rank 0.

    After a search, :attr:`result` holds the :class:`~lightning_accel.core.batch_size_search.BatchSizeSearch` of this rank
    and :attr:`summary` a dict of the decision.
    """

    def __init__(
        self,
        *,
        mode: str = "max_fit",
        batch_arg_name: str = "batch_size",
        memory_fraction: float = 0.8,
        memory_budget: int | None = None,
        init_batch_size: int = 2,
        max_batch_size: int | None = None,
        multiple_of: int | None = None,
        steps_per_trial: int | None = None,
        max_probes: int = 10,
        tolerance: float = 0.02,
        throughput_threshold: float = 0.05,
        target_global_batch_size: int | None = None,
        lr_scaling: str = "none",
        epochs: Sequence[int] = (0,),
        memory_meter: Any = None,
        print_summary: bool = True,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"BatchSizeTuner(mode={mode!r}): use one of {_MODES}")
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(
                f"BatchSizeTuner(batch_arg_name={batch_arg_name!r}): give the attribute name, e.g. 'batch_size'"
            )
        if not isinstance(memory_fraction, (int, float)) or not 0 < memory_fraction <= 1:
            raise ValueError(
                f"BatchSizeTuner(memory_fraction={memory_fraction!r}): give a fraction in (0, 1], e.g. 0.8"
            )
        if memory_budget is not None and (not isinstance(memory_budget, (int, float)) or memory_budget <= 0):
            raise ValueError(
                f"BatchSizeTuner(memory_budget={memory_budget!r}): give bytes > 0 (e.g. 8 * 2**30) "
                "or None to use memory_fraction"
            )
        for name, value in (
            ("init_batch_size", init_batch_size),
            ("max_batch_size", max_batch_size),
            ("multiple_of", multiple_of),
            ("steps_per_trial", steps_per_trial),
            ("target_global_batch_size", target_global_batch_size),
        ):
            check_int("BatchSizeTuner", name, value, optional=True)
        check_int("BatchSizeTuner", "max_probes", max_probes, minimum=2, example=10)
        if not 0 < tolerance < 0.5:
            raise ValueError(f"BatchSizeTuner(tolerance={tolerance!r}): give a fraction in (0, 0.5), e.g. 0.02")
        if not isinstance(throughput_threshold, (int, float)) or throughput_threshold < 0:
            raise ValueError(
                f"BatchSizeTuner(throughput_threshold={throughput_threshold!r}): give a fraction >= 0, e.g. 0.05"
            )
        if memory_meter is not None and not (
            callable(getattr(memory_meter, "reset", None)) and callable(getattr(memory_meter, "peak_bytes", None))
        ):
            raise ValueError(
                f"BatchSizeTuner(memory_meter={memory_meter!r}): give an object with reset() and "
                "peak_bytes() methods (see PeakMemoryMeter), or None for the device's own"
            )
        if lr_scaling not in LR_RULES:
            raise ValueError(f"BatchSizeTuner(lr_scaling={lr_scaling!r}): use one of {LR_RULES}")
        epochs = tuple(epochs)
        if not epochs or any(not is_int(e) or e < 0 for e in epochs):
            raise ValueError(f"BatchSizeTuner(epochs={epochs!r}): give epoch numbers >= 0, e.g. (0,) or (0, 10)")
        self.mode = mode
        self.batch_arg_name = batch_arg_name
        self.memory_fraction = float(memory_fraction)
        self.memory_budget = memory_budget
        self.init_batch_size = init_batch_size
        self.max_batch_size = max_batch_size
        self.multiple_of = multiple_of
        self.steps_per_trial = steps_per_trial or (2 if mode == "max_fit" else 4)
        self.max_probes = max_probes
        self.tolerance = tolerance
        self.throughput_threshold = float(throughput_threshold)
        self.target_global_batch_size = target_global_batch_size
        self.lr_scaling = lr_scaling
        self.epochs = tuple(sorted(set(epochs)))
        self.memory_meter = memory_meter
        self.print_summary = print_summary
        self.result: BatchSizeSearch | None = None
        self.summary: dict[str, Any] = {}
        self._applied: dict[str, Any] | None = None  # what a resumed run re-applies

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or "DeepSpeed" in type(strategy).__name__:
            raise ValueError(
                f"BatchSizeTuner supports single-device and DDP strategies, not "
                f"{type(strategy).__name__}: remove the tuner or pass the batch size yourself"
            )
        if fit_data_holder(trainer) is None:  # a DataLoader passed to fit(): re-created at each size
            reason = self._source(trainer, pl_module).can_set("batch_size")
            if reason is not None:
                raise ValueError(
                    f"BatchSizeTuner: the DataLoader passed to trainer.fit cannot be re-created with "
                    f"another batch size: {reason}; pass a DataLoader with batch_size=... or build it "
                    f"in train_dataloader() from `self.{self.batch_arg_name}`"
                )
        elif not lightning_hasattr(pl_module, self.batch_arg_name):
            raise missing_attribute_error(
                trainer,
                pl_module,
                "BatchSizeTuner",
                self.batch_arg_name,
                f"Add `self.{self.batch_arg_name} = ...` and build the train DataLoader "
                "from it, or pass batch_arg_name='<your attribute>'",
            )
        if self.target_global_batch_size is not None and self.target_global_batch_size % trainer.world_size:
            raise ValueError(
                f"BatchSizeTuner(target_global_batch_size={self.target_global_batch_size}) is not a "
                f"multiple of the {trainer.world_size} devices: pick a multiple of {trainer.world_size}"
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._applied is not None:  # resumed from a checkpoint of a tuned run: re-apply, do not search again
            self._adopt(self._source(trainer, pl_module), self._applied["batch_size"])
            trainer.accumulate_grad_batches = self._applied["accumulate_grad_batches"]
            rank_zero_info(
                f"BatchSizeTuner: resumed run, using the tuned batch size {self._applied['batch_size']} "
                f"× accumulation {self._applied['accumulate_grad_batches']} from the checkpoint"
            )
            return
        if trainer.fast_dev_run:
            rank_zero_warn("BatchSizeTuner: skipped because fast_dev_run is on")
            return
        if 0 in self.epochs:
            self.tune(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 in self.epochs and not trainer.should_stop and not trainer.fast_dev_run:
            self.tune(trainer, pl_module)
            reload_train_dataloader(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self._applied) if self._applied is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._applied = dict(state_dict) if state_dict else None

    # ------------------------------------------------------------------ the train loader
    def _source(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainLoaderSource:
        return TrainLoaderSource(
            trainer, pl_module, attribute_names={"batch_size": self.batch_arg_name}, require_dataloader=False
        )

    def _batch_size(self, source: TrainLoaderSource) -> int:
        if source.holder is None:
            return int(source.current()["batch_size"])
        return int(lightning_getattr(source.module, self.batch_arg_name))

    def _adopt(self, source: TrainLoaderSource, batch_size: int) -> None:
        """The fit trains at ``batch_size``: the attribute is set, or the fit() loader re-created with it."""
        if source.holder is not None:
            lightning_setattr(source.module, self.batch_arg_name, batch_size)
            return
        source.set({"batch_size": batch_size})
        source.install()

    # ------------------------------------------------------------------ the search
    def tune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Search, adopt the minimum over ranks, set batch size / accumulation / learning rate; returns the size."""
        device = trainer.strategy.root_device
        source = self._source(trainer, pl_module)
        old_batch = self._batch_size(source)
        old_accum = int(trainer.accumulate_grad_batches)
        cap = self._dataset_cap(trainer, source)
        budget = (
            float(self.memory_budget)
            if self.memory_budget is not None
            else self.memory_fraction * device_memory_capacity(device)
        )
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            result = self._search(trainer, pl_module, source, device, budget, cap)
        except BaseException as err:  # noqa: BLE001 - every rank must reach the collective below before raising
            error, result = err, None
        seconds = time.perf_counter() - started
        sizes = agree_across_ranks(
            trainer, float(result.batch_size) if result else math.nan, error, "BatchSizeTuner search"
        )
        assert result is not None
        self.result = result
        chosen = int(sizes.min())
        per_rank = [int(x) for x in sizes.tolist()]
        if cap is not None and chosen >= cap:
            rank_zero_warn(
                f"BatchSizeTuner: the dataset has only {cap} samples per rank; the batch size is clamped "
                f"to {cap} (more would not fit in one batch)"
            )
        micro, accum = chosen, old_accum
        if self.target_global_batch_size is not None:
            micro, accum = split_global_batch(self.target_global_batch_size, trainer.world_size, chosen)
        self._adopt(source, micro)
        trainer.accumulate_grad_batches = accum
        old_global = old_batch * trainer.world_size * old_accum
        new_global = micro * trainer.world_size * accum
        lr_scale = self._rescale_lr(trainer, old_global, new_global)
        self._applied = {"batch_size": micro, "accumulate_grad_batches": accum}
        self.summary = {
            "mode": self.mode,
            "batch_size": micro,
            "largest_fit": chosen,
            "per_rank": per_rank,
            "accumulate_grad_batches": accum,
            "global_batch_size": new_global,
            "previous_batch_size": old_batch,
            "previous_global_batch_size": old_global,
            "lr_scale": lr_scale,
            "budget_bytes": budget,
            "probes": result.num_probes,
            "search_seconds": seconds,
            "stop_reason": result.stop_reason,
            "memory_source": getattr(
                self.memory_meter or PeakMemoryMeter(device), "source", type(self.memory_meter).__name__
            ),
        }
        metrics = {
            "tuner/batch_size": micro,
            "tuner/accumulate_grad_batches": accum,
            "tuner/global_batch_size": new_global,
            "tuner/lr_scale": lr_scale,
            "tuner/probes": result.num_probes,
            "tuner/search_seconds": seconds,
            "tuner/memory_budget_gb": budget / 1e9,
        }
        for logger in trainer.loggers:
            logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=trainer.global_step)
        rank_zero_info(
            f"BatchSizeTuner: batch size {old_batch} -> {micro} per device "
            f"(largest {'fitting' if self.mode == 'max_fit' else 'paying'}: {chosen}, "
            f"{result.num_probes} probes, {seconds:.1f} s), accumulation {old_accum} -> {accum}, "
            f"global batch {old_global} -> {new_global}"
        )
        if self.print_summary:
            rank_zero_print(trainer, _probe_table(self.mode, result, self.summary))
        return micro

    def _search(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        source: TrainLoaderSource,
        device: torch.device,
        budget: float,
        cap: int | None,
    ) -> BatchSizeSearch:
        meter = self.memory_meter if self.memory_meter is not None else PeakMemoryMeter(device)
        if not getattr(meter, "exact", True):
            rank_zero_warn(f"BatchSizeTuner: {meter.source}; leave a larger margin (memory_fraction)")
        runner = StepRunner(trainer, pl_module)
        original = self._batch_size(source)
        state = TrainingState(trainer, pl_module)
        # the snapshot is resident on the CPU and counted by the process-RSS meter; training will not hold it
        offset = state.bytes_on(device) if self.memory_meter is None else 0
        max_size = min(x for x in (self.max_batch_size, cap) if x is not None) if (self.max_batch_size or cap) else None

        def probe(size: int) -> tuple[float, float]:
            if source.holder is not None:  # the probed size stays visible to the module while it steps
                lightning_setattr(pl_module, self.batch_arg_name, size)
            batches = _cycle(lambda: _tracked(state, source.build({"batch_size": size})))
            failed = True
            try:
                with runner.quiet():
                    pl_module.train()
                    peak, seconds = runner.timed_steps(batches, self.steps_per_trial, meter, expect_size=size)
                failed = False
            finally:
                batches.close()
                state.restore()
                _release_memory(device, collect=failed)
            return float(peak) - offset, float(seconds)  # type: ignore[arg-type]

        try:
            init = min(self.init_batch_size, max_size) if max_size else self.init_batch_size
            if self.mode == "max_fit":
                return find_batch_size(
                    probe,
                    budget_bytes=budget,
                    init_batch_size=init,
                    max_batch_size=max_size,
                    multiple_of=self.multiple_of,
                    max_probes=self.max_probes,
                    tolerance=self.tolerance,
                )
            return find_throughput_batch_size(
                probe,
                budget_bytes=budget,
                init_batch_size=init,
                max_batch_size=max_size,
                multiple_of=self.multiple_of,
                max_probes=self.max_probes,
                threshold=self.throughput_threshold,
            )
        finally:
            state.restore()
            if source.holder is not None:
                lightning_setattr(pl_module, self.batch_arg_name, original)

    @staticmethod
    def _dataset_cap(trainer: pl.Trainer, source: TrainLoaderSource) -> int | None:
        """Samples per rank in the train dataset (a batch cannot be larger), or ``None`` if unsized."""
        dataset = getattr(source.build(), "dataset", None)
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
        return max(1, math.ceil(n / trainer.world_size))

    def _rescale_lr(self, trainer: pl.Trainer, old_global: int, new_global: int) -> float:
        scale = lr_scale(self.lr_scaling, old_global, new_global)
        if scale == 1.0:
            return 1.0
        for i, opt in enumerate(trainer.optimizers):
            for j, group in enumerate(opt.param_groups):
                old = group["lr"]
                for key in _LR_KEYS:
                    if isinstance(group.get(key), (int, float)):
                        group[key] = group[key] * scale
                rank_zero_info(
                    f"BatchSizeTuner: optimizer {i} group {j} lr {old:.6g} -> {group['lr']:.6g} "
                    f"({self.lr_scaling} rule, effective batch {old_global} -> {new_global})"
                )
        for cfg in trainer.lr_scheduler_configs:
            sched = cfg.scheduler
            if hasattr(sched, "base_lrs"):
                sched.base_lrs = [lr * scale for lr in sched.base_lrs]
            _compat.set_scheduler_last_lr(sched, [g["lr"] for g in sched.optimizer.param_groups])
        return scale

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)


def _tracked(state: TrainingState, loader: Any) -> Any:
    state.track_loader(loader)
    return loader


def _cycle(make_loader: Any) -> Iterator[Any]:
    """Batches from fresh loaders, re-created when one is exhausted (a probe may need more batches than it has)."""
    while True:
        loader = make_loader()
        empty = True
        for batch in iterate_batches(loader):
            empty = False
            yield batch
        if empty:
            raise ValueError(
                "train_dataloader() yielded no batches at this batch size (drop_last=True with fewer "
                "samples than one batch?)"
            )


def _release_memory(device: torch.device, collect: bool) -> None:
    """Return what a probe freed: the CUDA cache, or glibc's heap to the OS (so the next RSS baseline is honest).

    ``collect``: run the garbage collector first (after a failed probe, whose traceback may hold tensors in reference
    cycles; otherwise reference counting has freed everything and a full collection costs ~0.5 s for nothing).
    """
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _probe_table(mode: str, result: BatchSizeSearch, summary: dict[str, Any]) -> Any:
    """The rich table of rank 0's probes, its caption the decision of ``summary`` (``BatchSizeTuner.summary``)."""
    from rich.table import Table

    s = summary
    table = Table(
        title=f"BatchSizeTuner ({mode}, budget {s['budget_bytes'] / 2**30:.2f} GiB per device, rank 0's probes)",
        header_style="bold",
    )
    for col in ("batch", "outcome", "peak MiB", "ms/step", "samples/s"):
        table.add_column(col, justify="right" if col != "outcome" else "left")
    for p in result.probes:
        table.add_row(
            str(p.batch_size),
            p.outcome,
            "—" if p.peak_bytes is None else f"{p.peak_bytes / 2**20:,.1f}",
            "—" if p.seconds_per_step is None else f"{1e3 * p.seconds_per_step:,.1f}",
            "—" if p.samples_per_sec is None else f"{p.samples_per_sec:,.1f}",
        )
    model = result.model
    table.caption = (
        f"chosen {s['batch_size']} × {s['accumulate_grad_batches']} accumulation "
        f"(global {s['global_batch_size']}); stop: {s['stop_reason']}"
        + (
            ""
            if model is None
            else f"; fit: {model.fixed_bytes / 2**20:,.0f} MiB + {model.bytes_per_sample / 2**10:,.1f} KiB/sample"
        )
        + f"; memory: {s['memory_source']}"
    )
    return table
