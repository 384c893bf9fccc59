"""``lightning-accel demo``: train the demo GPT on CPU (or GPU) with the collection's measuring callbacks on.

The demo is assembled from small builders (:func:`build_callbacks`, :func:`build_trainer`) so each feature of
the collection adds its switch here and in :func:`add_demo_arguments` without touching the rest.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel._checks import check_int

__all__ = ["DemoConfig", "add_demo_arguments", "build_callbacks", "build_precision", "build_trainer", "run_demo"]


@dataclass
class DemoConfig:
    """Everything the demo run depends on; the CLI flags map one to one onto these fields."""

    steps: int = 400
    devices: int = 1
    accelerator: str = "cpu"
    precision: str = "32-true"
    batch_size: int = 32
    seq_len: int = 64
    n_layer: int = 4
    d_model: int = 128
    seed: int = 0
    num_workers: int = 0
    window: int = 10
    val_every: int = 50
    progress_bar: bool = True
    output_dir: str | None = None
    data: str = "tokens"
    doctor: bool = True
    slow_data: bool = False
    doctor_report: str | None = None
    compile: bool = False
    checkpointing: bool = False
    tune_batch_size: str | None = None
    tune_dataloader: bool = False
    strategy: str | None = None
    prefetch: bool = False
    profile_at_step: int | None = None
    compile_backend: str = "inductor"
    autopilot: bool = False
    autopilot_budget: float = 30.0
    autopilot_plan: str | None = None
    quiet: bool = False
    extra_callbacks: list[Any] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("steps", "devices", "batch_size", "seq_len", "n_layer", "d_model", "window", "val_every"):
            value = getattr(self, name)
            check_int("demo", name, value, flag=True)
        if self.tune_batch_size not in (None, "max_fit", "throughput"):
            raise ValueError(f"demo: --tune-batch-size must be max_fit or throughput, got {self.tune_batch_size!r}")
        if self.strategy is not None:
            from lightning.pytorch.strategies import StrategyRegistry

            import lightning_accel  # noqa: F401  (registers the strategy strings)

            if self.strategy not in StrategyRegistry and self.strategy not in ("auto", "ddp_spawn"):
                raise ValueError(
                    f"demo: --strategy {self.strategy!r} is not a registered strategy; use e.g. ddp, "
                    "ddp_bf16_compress, ddp_powersgd, deepspeed_zero2 (see the DDP compression and ZeRO pages of the docs)"
                )
        if self.precision.startswith("amp:") and self.precision[4:] not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"demo: --precision {self.precision!r}: use amp:auto, amp:fp32, amp:bf16 or amp:fp16")
        if self.num_workers < 0:
            raise ValueError(f"demo: --num-workers must be >= 0, got {self.num_workers!r}")
        if self.data not in ("tokens", "images"):
            raise ValueError(f"demo: --data must be 'tokens' or 'images', got {self.data!r}")
        if self.slow_data and self.data != "tokens":
            raise ValueError("demo: --slow-data plants its delay in the token pipeline; use it with --data tokens")
        if self.checkpointing and self.data != "tokens":
            raise ValueError("demo: --checkpointing wraps the GPT's transformer blocks; use it with --data tokens")
        if not isinstance(self.autopilot_budget, (int, float)) or self.autopilot_budget < 0:
            raise ValueError(f"demo: --autopilot-budget must be seconds >= 0, got {self.autopilot_budget!r}")
        if self.profile_at_step is not None and (not isinstance(self.profile_at_step, int) or self.profile_at_step < 0):
            raise ValueError(f"demo: --profile-at-step must be a step number >= 0, got {self.profile_at_step!r}")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps to train (default %(default)s)")
    parser.add_argument(
        "--devices",
        type=int,
        default=d.devices,
        help="processes/devices; >1 runs Lightning DDP (on CPU: gloo) (default %(default)s)",
    )
    parser.add_argument("--accelerator", default=d.accelerator, help="cpu, gpu or auto (default %(default)s)")
    parser.add_argument(
        "--precision",
        default=d.precision,
        help="Lightning precision string (32-true, bf16-mixed, 16-mixed), 'auto': AutoMixedPrecision "
        "picks the dtype for the device, or amp:<dtype> for AutoMixedPrecision(dtype=...) "
        "(amp:fp32 lets --autopilot trial the dtype) (default %(default)s)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model (TorchCompile callback, inductor)"
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing of every transformer block (ActivationCheckpointing)",
    )
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="per-device batch (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--n-layer", type=int, default=d.n_layer, help="transformer blocks (default %(default)s)")
    parser.add_argument("--d-model", type=int, default=d.d_model, help="hidden size (default %(default)s)")
    parser.add_argument("--num-workers", type=int, default=d.num_workers, help="DataLoader workers (default 0)")
    parser.add_argument("--window", type=int, default=d.window, help="batches per measuring window (default 10)")
    parser.add_argument("--val-every", type=int, default=d.val_every, help="validate every N steps (default 50)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for data, weights and order (default 0)")
    parser.add_argument(
        "--tune-batch-size",
        choices=("max_fit", "throughput"),
        default=None,
        help="pick the per-device batch with BatchSizeTuner before training (throughput suits CPUs)",
    )
    parser.add_argument(
        "--tune-dataloader", action="store_true", help="pick num_workers with DataLoaderTuner before training"
    )
    parser.add_argument("--output-dir", default=None, help="where logs (CSV) go; none are written by default")
    parser.add_argument(
        "--strategy",
        default=None,
        help="Lightning strategy string, e.g. ddp_bf16_compress, ddp_powersgd, deepspeed_zero2, "
        "deepspeed_auto (with --devices 2 on CPU); default: ddp if --devices > 1",
    )
    parser.add_argument("--no-progress-bar", dest="progress_bar", action="store_false", help="hide the progress bar")
    parser.add_argument(
        "--data",
        choices=("tokens", "images"),
        default=d.data,
        help="tokens: the GPT on a Markov token stream (packed with pack_memmap, read with "
        "TokenMemmapDataset); images: a small CNN on generated JPEGs through "
        "DALIImageDataModule (needs the dali extra) (default %(default)s)",
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="DevicePrefetcher: fetch (and on GPU copy) the next batches while the step runs",
    )
    parser.add_argument(
        "--profile-at-step",
        type=int,
        default=None,
        help="ProfileWindow: torch.profiler trace of 3 steps from this step (into <output-dir or cwd>/profile)",
    )
    parser.add_argument(
        "--autopilot",
        action="store_true",
        help="Autopilot: before training, trial the fixes for the slowest stage on this run and keep "
        "the measured gains (table, plan and config printed)",
    )
    parser.add_argument(
        "--autopilot-budget",
        type=float,
        default=d.autopilot_budget,
        metavar="SECONDS",
        help="seconds the Autopilot may search (default %(default)s; the demo's fit is too short "
        "for the default 5 %% share)",
    )
    parser.add_argument(
        "--autopilot-plan",
        default=None,
        metavar="PATH",
        help="replay an Autopilot plan (JSON) instead of searching; with --autopilot the plan is "
        "written to OUTPUT_DIR/autopilot_plan.json",
    )
    parser.add_argument(
        "--doctor",
        action=argparse.BooleanOptionalAction,
        default=d.doctor,
        help="run BottleneckDoctor: stage breakdown, findings with fixes, report (default on)",
    )
    parser.add_argument(
        "--slow-data",
        action="store_true",
        help="plant a data bottleneck (the dataset sleeps 2 ms per sample) to see the doctor's "
        "finding; then try --num-workers 2",
    )
    parser.add_argument(
        "--doctor-report",
        default=None,
        metavar="PATH",
        help="write the doctor's JSON report (and PNG) here (default: OUTPUT_DIR/"
        "bottleneck_report.json with --output-dir, else no file); compare two runs with "
        "`lightning-accel report NEW.json --baseline OLD.json`",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    fields = DemoConfig.__dataclass_fields__
    return DemoConfig(**{k: v for k, v in vars(args).items() if k in fields})


def build_callbacks(cfg: DemoConfig) -> list[Any]:
    from lightning_accel.callbacks.mfu_monitor import MFUMonitor

    callbacks: list[Any] = []
    if cfg.autopilot or cfg.autopilot_plan:  # first: everything after it measures the tuned run
        from lightning_accel.callbacks.autopilot import Autopilot

        plan_out: Any = str(Path(cfg.output_dir) / "autopilot_plan.json") if cfg.output_dir else False
        callbacks.append(
            Autopilot(
                budget_seconds=cfg.autopilot_budget,
                plan=cfg.autopilot_plan,
                save_plan=plan_out,
                print_summary=not cfg.quiet,
            )
        )
    if cfg.tune_batch_size is not None:  # before DataLoaderTuner: the loader is tuned for the new batch size
        from lightning_accel.callbacks.batch_size_tuner import BatchSizeTuner

        callbacks.append(BatchSizeTuner(mode=cfg.tune_batch_size, max_batch_size=1024))
    if cfg.tune_dataloader:
        from lightning_accel.callbacks.dataloader_tuner import DataLoaderTuner

        callbacks.append(DataLoaderTuner())
    callbacks.append(MFUMonitor(window=cfg.window, print_summary=not cfg.quiet))
    if cfg.compile:
        from lightning_accel.callbacks.torch_compile import TorchCompile

        callbacks.append(TorchCompile(backend=cfg.compile_backend))
    if cfg.checkpointing:
        from lightning_accel.callbacks.activation_checkpointing import ActivationCheckpointing
        from lightning_accel.demo.model import Block

        callbacks.append(ActivationCheckpointing(modules=[Block]))
    if cfg.prefetch:
        from lightning_accel.callbacks.device_prefetcher import DevicePrefetcher

        callbacks.append(DevicePrefetcher())
    if cfg.profile_at_step is not None:
        from lightning_accel.callbacks.profile_window import ProfileWindow

        callbacks.append(
            ProfileWindow(at_step=cfg.profile_at_step, dirpath=f"{cfg.output_dir}/profile" if cfg.output_dir else None)
        )
    if cfg.doctor:  # last: its report prints after MFUMonitor's summary
        from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

        report: Any = cfg.doctor_report or (
            str(Path(cfg.output_dir) / "bottleneck_report.json") if cfg.output_dir else False
        )
        callbacks.append(
            BottleneckDoctor(window=cfg.window, report_path=report, print_report=not cfg.quiet, warn=not cfg.quiet)
        )
    return [*callbacks, *cfg.extra_callbacks]


def build_precision(cfg: DemoConfig) -> dict[str, Any]:
    """``Trainer`` keywords for ``--precision``: a Lightning string, or ``auto`` -> ``AutoMixedPrecision()``."""
    if cfg.precision == "auto" or cfg.precision.startswith("amp:"):
        from lightning_accel.precision.auto_mixed_precision import AutoMixedPrecision

        return {"plugins": [AutoMixedPrecision(dtype=cfg.precision.removeprefix("amp:"))]}
    return {"precision": cfg.precision}


def build_trainer(cfg: DemoConfig) -> Any:
    import lightning.pytorch as pl

    logger: Any = False
    if cfg.output_dir:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(cfg.output_dir, name="demo")
    return pl.Trainer(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        strategy=cfg.strategy or ("ddp" if cfg.devices > 1 else "auto"),
        **build_precision(cfg),
        max_steps=cfg.steps,
        val_check_interval=min(cfg.val_every, cfg.steps),
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        callbacks=[*build_callbacks(cfg), *_progress_bar(cfg)],
        logger=logger,
        log_every_n_steps=cfg.window,
        enable_checkpointing=False,
        enable_progress_bar=cfg.progress_bar,
        enable_model_summary=False,
    )


def _progress_bar(cfg: DemoConfig) -> list[Any]:
    """The bar whose epoch total follows ``--steps`` (Lightning's reads ``Epoch 0/-2`` without ``max_epochs``),
    unless the bar is off or the caller brought one."""
    from lightning.pytorch.callbacks.progress import ProgressBar

    from lightning_accel.demo.progress import StepsProgressBar

    if not cfg.progress_bar or any(isinstance(cb, ProgressBar) for cb in cfg.extra_callbacks):
        return []
    return [StepsProgressBar()]


def run_demo(cfg: DemoConfig | None = None) -> dict[str, Any]:
    """Train the demo task; returns the MFUMonitor summary, the BottleneckDoctor report (``None`` with
    ``doctor=False``) and the final losses (on every rank)."""
    import lightning.pytorch as pl

    from lightning_accel.callbacks.mfu_monitor import MFUMonitor

    cfg = cfg or DemoConfig()
    cfg.validate()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task, data = _image_task(cfg) if cfg.data == "images" else _token_task(cfg)
    trainer = build_trainer(cfg)
    trainer.fit(task, datamodule=data)
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train_loss", "val_loss", "val_acc")}
    from lightning_accel.callbacks.autopilot import Autopilot
    from lightning_accel.callbacks.doctor.bottleneck_doctor import BottleneckDoctor

    doctor = next((cb for cb in trainer.callbacks if isinstance(cb, BottleneckDoctor)), None)
    autopilot = next((cb for cb in trainer.callbacks if isinstance(cb, Autopilot)), None)
    return {
        "mfu_monitor": monitor.summary,
        "doctor": doctor.report if doctor is not None else None,
        **metrics,
        "autopilot": autopilot.plan if autopilot is not None else None,
        "trainer": trainer,
    }


def _data_dir(cfg: DemoConfig, name: str) -> Path | None:
    return Path(cfg.output_dir) / "data" / name if cfg.output_dir else None


def _token_task(cfg: DemoConfig) -> tuple[Any, Any]:
    from lightning_accel.demo.model import GPTConfig
    from lightning_accel.demo.task import DemoDataModule, GPTTask

    model_cfg = GPTConfig(seq_len=cfg.seq_len, n_layer=cfg.n_layer, d_model=cfg.d_model)
    task = GPTTask(model_cfg)
    # enough windows for every step of every rank, without repeating data within the run
    tokens = max(400_000, (cfg.steps + 1) * cfg.batch_size * cfg.devices * (cfg.seq_len + 1))
    data_kwargs = dict(
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        train_tokens=tokens,
        num_workers=cfg.num_workers,
        seed=cfg.seed,
        data_dir=_data_dir(cfg, "tokens"),
    )
    if cfg.slow_data:
        from lightning_accel.demo.slow_data import SlowDemoDataModule

        return task, SlowDemoDataModule(seconds_per_sample=0.002, **data_kwargs)
    return task, DemoDataModule(**data_kwargs)


def _image_task(cfg: DemoConfig) -> tuple[Any, Any]:
    import tempfile

    from lightning_accel.demo.images import DemoImageDataModule, ImageTask

    root = _data_dir(cfg, "images") or Path(tempfile.gettempdir()) / "lightning-accel-demo" / f"images-s{cfg.seed}"
    # 10 classes x 64 training JPEGs of 64 px, random-resized-cropped to 32 px by DALI
    data = DemoImageDataModule(root, seed=cfg.seed, image_size=32, batch_size=cfg.batch_size, last_batch="pad")
    return ImageTask(num_classes=10), data
