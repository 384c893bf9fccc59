"""MFUMonitor: throughput and model FLOPs utilisation, with FLOPs counted automatically."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_accel._checks import check_int
from lightning_accel.callbacks._fit.trainer_state import compute_dtype, gather_floats, rank_zero_print, sync_fn
from lightning_accel.callbacks._fit.window_metrics import log_window
from lightning_accel.core.batch import samples_in_batch, tokens_in_batch
from lightning_accel.core.flops import FlopCounter
from lightning_accel.core.peak import PeakFlops, format_flops, resolve_peak_flops
from lightning_accel.core.throughput import RankWindows, WindowedThroughput
from lightning_accel.strategies.outstanding_work import finish_collectives_at_teardown

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MFUMonitor"]


class MFUMonitor(Callback):
    """Logs throughput and MFU (model FLOPs utilisation) while training, and prints a summary after ``fit``.

    FLOPs per batch are counted on the first training batch by ``torch.utils.flop_counter.FlopCounterMode`` around the
    real step (forward + backward of that batch; no extra step is run), unless ``flops_per_batch`` is given.
    Recomputation is not a model FLOP: what a callback reports as ``recompute_flops`` per micro-batch
    (``ActivationCheckpointing`` does) is subtracted when the warm-up ends.

    The peak comes from ``peak_flops`` if given, else the datasheet table for the GPU and the run's compute dtype,
    else on a CPU the hardware figure (cores x clock x FLOPs per cycle of the ISA, read from ``/proc/cpuinfo`` and
    cpufreq) or a short matmul probe where that ran faster (turbo), else (unknown GPUs, CPUs whose rate is not known)
    the probe alone: :func:`~lightning_accel.core.peak.resolve_peak_flops`; the summary names the source. MFU is a
    fraction by construction: a window whose achieved FLOP/s exceeds the peak proves the peak too low, so the peak is
    raised to that rate (one warning, naming the old and the new peak and the old one's source): that window's MFU is
    1.0 on its fastest rank. On a GPU the datasheet cannot be beaten: the warning then says the FLOP count (or the
    dtype the table was read for) is wrong, with the numbers; the raise keeps ``perf/mfu`` a fraction, the warning and
    the summary keep the inconsistency visible. Each window divides by the peak known when it closed; the summary
    divides every window by the final peak and, when it was raised, says so with the initial peak (windows logged
    before a raise read higher than the same windows against the final peak).

    The first ``warmup_batches`` batches (FLOP counting, allocator and ``torch.compile`` warm-up;
    callbacks can ask for more with a ``warmup_batches`` attribute) and all time spent in validation are left out. Every
    micro-batch of gradient accumulation counts as a batch. The device is synchronised only when a window closes.

    Logged every ``window`` batches, to every logger, ``trainer.callback_metrics`` and the progress bar, as
    ``pl_module.log(on_step=True)`` would, in one call per window (``_fit.window_metrics.log_window``):

    ========================================  ==========  ====================================================
    key                                       unit        scope
    ========================================  ==========  ====================================================
    ``perf/samples_per_sec``                  samples/s   global: all ranks' samples (a batch shared by a
                                                          tensor-parallel group counts once)
    ``perf/tokens_per_sec``                   tokens/s    global; only when the batch has tokens (see below)
    ``perf/batches_per_sec``                  batches/s   per device (mean over ranks)
    ``perf/tflops_per_sec_per_device``        TFLOP/s     per device (mean over ranks), model FLOPs
    ``perf/mfu``                              fraction    per device: achieved ÷ peak FLOP/s (mean over
                                                          ranks), <= 1: a window above the peak raises the
                                                          peak to its rate first
    ``perf/mfu_bf16_peak``                    fraction    per device, FP8 runs (``Float8Training``) only:
                                                          achieved ÷ the bf16 peak (may exceed 1)
    ========================================  ==========  ====================================================

    Tokens per batch: ``tokens_per_batch(batch)`` if given, else the LightningModule's ``tokens_per_batch(batch)``
    method if it has one, else the size of the first integer tensor shaped ``(batch, sequence)``.

    Args:
        window: batches per measuring window (logging interval).
        warmup_batches: batches at the start of ``fit`` that are not measured.
        flops_per_batch: model FLOPs of one batch on one device (forward + backward); skips counting.
        peak_flops: peak FLOP/s of one device; overrides the table, the hardware figure and the probe (and is raised,
            with a warning, if a window runs faster).
        tokens_per_batch: ``fn(batch) -> int`` tokens in a batch.
        prog_bar: show samples/s and MFU in the progress bar.
        print_summary: print the summary table at the end of ``fit`` (rank 0).

    After ``fit``, :attr:`summary` holds the numbers of the table as a dict (with ``peak_flops_initial``,
    ``peak_source_initial`` and ``peak_raises``: the peak before any raise, and how many windows raised it).
    """

    def __init__(
        self,
        *,
        window: int = 20,
        warmup_batches: int = 3,
        flops_per_batch: float | None = None,
        peak_flops: float | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
        prog_bar: bool = True,
        print_summary: bool = True,
    ) -> None:
        check_int("MFUMonitor", "window", window, unit="batches", example=20)
        check_int("MFUMonitor", "warmup_batches", warmup_batches, minimum=0, unit="batches", example=3)
        if flops_per_batch is not None and (not isinstance(flops_per_batch, (int, float)) or flops_per_batch <= 0):
            raise ValueError(
                f"MFUMonitor(flops_per_batch={flops_per_batch!r}): give a positive FLOP count or None "
                "to count automatically"
            )
        if peak_flops is not None and (not isinstance(peak_flops, (int, float)) or peak_flops <= 0):
            raise ValueError(
                f"MFUMonitor(peak_flops={peak_flops!r}): give a positive FLOP/s figure (e.g. 989e12) "
                "or None to look it up / measure it"
            )
        self.window = window
        self.warmup_batches = warmup_batches
        self.flops_per_batch = float(flops_per_batch) if flops_per_batch is not None else None
        self.peak_flops = peak_flops
        self.tokens_per_batch = tokens_per_batch
        self.prog_bar = prog_bar
        self.print_summary = print_summary
        self.summary: dict[str, Any] = {}
        self._reset_run_state()

    @property
    def history(self) -> list[dict[str, float | None]]:
        """One record per measuring window of the last fit: the rates logged, ``seconds``, ``batches`` and ``mfu``."""
        return self._windows.history

    def _reset_run_state(self) -> None:
        self._flops: float | None = self.flops_per_batch
        self._flops_source = "given by the user" if self.flops_per_batch is not None else None
        self._counter = FlopCounter()
        self._counting_done = self.flops_per_batch is not None
        self._peak: PeakFlops | None = None
        self._initial_peak: PeakFlops | None = None
        self._bf16_peak: PeakFlops | None = None  # an FP8 run's second denominator
        self._windows = RankWindows()
        self._peak_raises = 0
        self._dtype = "fp32"
        self._meter: WindowedThroughput | None = None
        self._batches_seen = 0
        self._recompute_pending = False
        self._skip = self.warmup_batches
        self._tokens_fn: Callable[[Any], int | None] = tokens_in_batch

    # ------------------------------------------------------------------ setup
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run_state()
        self.summary = {}
        device = trainer.strategy.root_device
        self._dtype = compute_dtype(trainer)
        from lightning_accel.strategies.model_parallel import batch_replicas

        self._windows.batch_replicas = batch_replicas(trainer.strategy)  # TP ranks share a batch: count it once
        try:
            self._peak = resolve_peak_flops(device, self._dtype, self.peak_flops)
        except ValueError as err:  # e.g. an fp8 run on an unknown device: nothing to probe
            rank_zero_warn(
                f"MFUMonitor: no peak FLOP/s for {device} {self._dtype} ({err}); MFU is not reported. "
                "Pass MFUMonitor(peak_flops=...) to get it."
            )
        self._initial_peak = self._peak
        # FP8 has two honest denominators: its own peak, and the bf16 peak the same FLOPs would run at without it
        if self._dtype == "fp8" and self.peak_flops is None:
            try:
                self._bf16_peak = resolve_peak_flops(device, "bf16", None)
            except ValueError:
                self._bf16_peak = None
        if self._peak is None:
            rank_zero_warn(
                f"MFUMonitor: no peak FLOP/s known for {device} {self._dtype}; MFU is not reported. "
                "Pass MFUMonitor(peak_flops=...) to get it."
            )
        extra = [getattr(cb, "warmup_batches", 0) for cb in trainer.callbacks if cb is not self]
        self._skip = self.warmup_batches + max([int(x) for x in extra if isinstance(x, int)] or [0])
        self._meter = WindowedThroughput(window=self.window, synchronize=sync_fn(device))
        if self.tokens_per_batch is not None:
            self._tokens_fn = self.tokens_per_batch
        elif callable(getattr(pl_module, "tokens_per_batch", None)):
            self._tokens_fn = pl_module.tokens_per_batch

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._counting_done and not self._counter.running:
            self._counter.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter.running:
            self._finish_counting()
        meter = self._meter
        if meter is None:
            return
        self._batches_seen += 1
        if not meter.started:
            if self._batches_seen >= self._skip:
                self._exclude_recomputation(trainer)
                meter.start()
            return
        if self._recompute_pending:  # a recomputation figure measured after the warm-up (warmup_batches <= 2)
            self._exclude_recomputation(trainer)
        rates = meter.update(samples_in_batch(batch), self._tokens_fn(batch), self._flops)
        if rates is not None:
            self._publish(
                trainer, pl_module, rates.samples, rates.tokens, rates.flops, rates.seconds, rates.batches, log=True
            )

    def _exclude_recomputation(self, trainer: pl.Trainer) -> None:
        """Model FLOPs exclude recomputation: subtract what callbacks report recomputing per micro-batch.

        ``ActivationCheckpointing`` re-runs the checkpointed forwards in backward and measures those FLOPs
        (``recompute_flops``) on an early batch; the count of the first batch included them.
        """
        self._recompute_pending = False
        if self._flops is None or self.flops_per_batch is not None:
            return
        sources = [cb for cb in trainer.callbacks if hasattr(cb, "recompute_flops")]
        recomputed = sum(cb.recompute_flops for cb in sources if isinstance(cb.recompute_flops, (int, float)))
        if sources and not recomputed:
            # ActivationCheckpointing measures at the end of an early batch, after this hook: look again at the
            # next batches (a few: one that does not measure never reports), before their FLOPs are counted
            self._recompute_pending = self._batches_seen < self._skip + 4
            return
        if 0 < recomputed < self._flops:
            self._flops -= float(recomputed)
            self._flops_source = (
                f"counted on the first batch (FlopCounterMode), minus {recomputed / 1e9:,.3f} G "
                "recomputed by activation checkpointing"
            )

    def _finish_counting(self) -> None:
        self._counting_done = True
        try:
            flops = self._counter.stop()
        except Exception as err:  # noqa: BLE001 - measuring must never stop training
            rank_zero_warn(
                f"MFUMonitor: FLOP counting failed ({err!r}); reporting throughput without MFU. "
                "Pass MFUMonitor(flops_per_batch=...) to get MFU."
            )
            return
        if flops <= 0:
            rank_zero_warn(
                "MFUMonitor: FlopCounterMode counted no FLOPs on the first batch (no matmul/conv/"
                "attention ran through the dispatcher, e.g. a custom kernel); reporting throughput "
                "without MFU. Pass MFUMonitor(flops_per_batch=...) to get MFU."
            )
            return
        self._flops = float(flops)
        self._flops_source = "counted on the first batch (FlopCounterMode)"

    def _publish(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        samples: float,
        tokens: float | None,
        flops: float | None,
        seconds: float,
        batches: int,
        *,
        log: bool,
    ) -> None:
        peak = self._peak.flops if self._peak is not None else math.nan
        rows = gather_floats(
            trainer,
            trainer.strategy.root_device,
            [
                samples,
                math.nan if tokens is None else tokens,
                math.nan if flops is None else flops,
                seconds,
                batches,
                peak,
            ],
        ).tolist()
        record = self._windows.add(rows, on_raise=lambda *window: self._raise_peak(trainer, *window))
        fps = record["flops_per_sec_per_device"]
        if not log:
            return
        values = {"perf/samples_per_sec": record["samples_per_sec"], "perf/batches_per_sec": record["batches_per_sec"]}
        if record["tokens_per_sec"] is not None:
            values["perf/tokens_per_sec"] = record["tokens_per_sec"]
        if fps is not None:
            values["perf/tflops_per_sec_per_device"] = fps / 1e12
        if record["mfu"] is not None:
            values["perf/mfu"] = record["mfu"]
        if fps is not None and self._bf16_peak is not None:
            values["perf/mfu_bf16_peak"] = fps / self._bf16_peak.flops
        log_window(trainer, pl_module, values, prog_bar=("perf/samples_per_sec", "perf/mfu") if self.prog_bar else ())

    def _raise_peak(
        self, trainer: pl.Trainer, achieved: list[float], peaks: list[float], raised: list[float], seconds: float
    ) -> None:
        """A window ran faster than the peak: that rate is a measured lower bound of the true peak, so it becomes the
        peak (:func:`~lightning_accel.core.throughput.raised_peaks`; every rank computes the same list from the
        gathered rows). Warns once.

        Re-probing instead would run a matmul inside the measured training (its time then counts as the window's),
        and under the load that made the first probe read low it can read low again; the achieved rate cannot.
        """
        rank = max(range(len(peaks)), key=lambda r: achieved[r] / peaks[r])
        window = len(self.history) + 1
        mine = raised[trainer.global_rank]
        if self._peak is not None and mine > self._peak.flops:
            initial = self._initial_peak or self._peak
            who = f" on rank {rank}" if trainer.world_size > 1 else ""
            self._peak = PeakFlops(
                mine,
                "achieved",
                f"achieved by window {window}{who} ({format_flops(mine)}), raised from the "
                f"{initial.source} peak {format_flops(initial.flops)} ({initial.detail})",
            )
        if self._peak_raises == 0:
            self._warn_raised(trainer, window, rank, achieved[rank], peaks[rank], seconds)
        self._peak_raises += 1

    def _warn_raised(
        self, trainer: pl.Trainer, window: int, rank: int, achieved: float, peak: float, seconds: float
    ) -> None:
        initial = self._initial_peak
        source = initial.source if initial is not None else "unknown"
        detail = initial.detail if initial is not None else ""
        who = f" on rank {rank}" if trainer.world_size > 1 else ""
        flops = "" if self._flops is None else f"{self._flops:.4g} FLOP per batch, {self._flops_source}"
        head = (
            f"MFUMonitor: window {window}{who} achieved {format_flops(achieved)} over {seconds:.3g} s, "
            f"{100 * achieved / peak:.1f} % of the peak {format_flops(peak)} ({source}: {detail}). "
        )
        if source == "table":
            why = (
                f"A GPU cannot run faster than its datasheet: the FLOP count ({flops}) overstates the work the "
                "kernels do (a causal or sparse kernel skipping work FlopCounterMode counts, a custom op counted "
                f"twice) or the matmuls run in a faster dtype than {self._dtype}, the one the table was read for. "
            )
            fix = "Pass MFUMonitor(flops_per_batch=...) and/or MFUMonitor(peak_flops=...) with the right figures."
        elif source == "user":
            why = f"The peak_flops given is below what the device ran ({flops}). "
            fix = "Pass the device's real peak as MFUMonitor(peak_flops=...)."
        else:
            why = (
                "The peak read low (a probe disturbed by other load, a clock read below the one the cores ran "
                f"at), or the FLOP count ({flops}) is above the work done. "
            )
            fix = "Pass MFUMonitor(peak_flops=...) to fix the denominator."
        rank_zero_warn(
            f"{head}{why}The peak is raised to {format_flops(achieved)}, the rate achieved, so MFU stays "
            "a fraction (this window's MFU is 1.0); later raises are not warned, and the summary divides "
            f"every window by the final peak. {fix}"
        )

    # ------------------------------------------------------------------ pauses
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None and not trainer.sanity_checking:
            self._meter.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None and not trainer.sanity_checking:
            self._meter.resume()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._counter.running:
            self._counter.stop()
            self._counting_done = True

    # ------------------------------------------------------------------ end
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        meter = self._meter
        if meter is None:
            return
        last = meter.close()
        if last is not None:
            self._publish(
                trainer, pl_module, last.samples, last.tokens, last.flops, last.seconds, last.batches, log=False
            )
        self.summary = self._summarize(trainer)
        if self.print_summary:
            rank_zero_print(trainer, self._summary_table())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_collectives_at_teardown(self, trainer)

    def _summarize(self, trainer: pl.Trainer) -> dict[str, Any]:
        device = trainer.strategy.root_device
        out: dict[str, Any] = {
            "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "devices": trainer.world_size,
            "dtype": self._dtype,
            "flops_per_batch": self._flops,
            "flops_source": self._flops_source,
            "peak_flops": self._windows.mean_peak or (self._peak.flops if self._peak else None),
            "peak_source": self._peak.detail if self._peak else None,
            "peak_flops_initial": self._initial_peak.flops if self._initial_peak else None,
            "peak_source_initial": self._initial_peak.detail if self._initial_peak else None,
            "peak_raises": self._peak_raises,
            "warmup_batches": self._skip,
            "batches_measured": self._windows.batches_measured,
        }
        if not self.history:
            out["note"] = (
                f"too few batches to measure: {self._batches_seen} ran, {self._skip} are warm-up; "
                f"train longer or lower warmup_batches"
            )
            return out
        out.update(self._windows.summary())
        fps = out["flops_per_sec_per_device"]
        if self._bf16_peak is not None and fps is not None:
            out["mfu_bf16_peak"] = fps / self._bf16_peak.flops
            out["peak_flops_bf16"] = self._bf16_peak.flops
        return out

    def _summary_table(self) -> Any:
        from rich.table import Table

        s = self.summary
        table = Table(title="MFUMonitor summary", show_header=True, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("what it is")
        table.add_row("device", f"{s['device']} × {s['devices']}", f"compute dtype {s['dtype']}")
        if "note" in s:
            table.add_row("measured", "—", s["note"])
            return table
        table.add_row("samples/s", f"{s['samples_per_sec']:,.1f}", "global (all ranks), time-weighted mean")
        if s.get("tokens_per_sec") is not None:
            table.add_row("tokens/s", f"{s['tokens_per_sec']:,.0f}", "global (all ranks)")
        if s.get("flops_per_batch") is not None:
            table.add_row(
                "model FLOPs / batch", f"{s['flops_per_batch'] / 1e9:,.3f} G", f"per device, {s['flops_source']}"
            )
        if s.get("flops_per_sec_per_device") is not None:
            table.add_row("achieved", f"{s['flops_per_sec_per_device'] / 1e12:,.4f} TFLOP/s", "per device")
        if s.get("peak_flops") is not None:
            table.add_row("peak", f"{s['peak_flops'] / 1e12:,.4f} TFLOP/s", f"per device, {s['peak_source']}")
        if s.get("peak_raises"):
            table.add_row(
                "peak raised",
                f"{s['peak_raises']} window(s)",
                f"windows ran faster than the initial peak {s['peak_flops_initial'] / 1e12:,.4f} TFLOP/s; "
                "windows logged before a raise divided by a lower peak",
            )
        mfu = s.get("mfu")
        table.add_row("MFU", "n/a" if mfu is None else f"{100 * mfu:.1f} %", "achieved ÷ final peak, per device")
        if s.get("mfu_bf16_peak") is not None:
            table.add_row(
                "MFU (bf16 peak)",
                f"{100 * s['mfu_bf16_peak']:.1f} %",
                f"achieved ÷ the bf16 peak {s['peak_flops_bf16'] / 1e12:,.1f} TFLOP/s the same FLOPs would run at",
            )
        table.add_row(
            "measured over",
            f"{s['batches_measured']} batches / {s['seconds_measured']:.1f} s",
            f"after {s['warmup_batches']} warm-up batches; validation excluded",
        )
        return table
