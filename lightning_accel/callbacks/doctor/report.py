"""The doctor's files (rank 0): where they go, the window log's place, and the JSON report with its PNG at the end of
``fit``. See ``docs/measuring/doctor.md``, "Reports"."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_accel.callbacks._fit.trainer_state import rank_zero_print
from lightning_accel.core.html_report import write_html
from lightning_accel.core.report import DoctorReport, plot_timeline, run_name
from lightning_accel.core.window_log import WINDOW_LOG_SUFFIX

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["report_dir", "report_file", "run_identity", "window_log_file", "write_report_files"]


def report_dir(trainer: pl.Trainer) -> Path:
    """``trainer.log_dir`` without its broadcast (only rank 0 writes): the first logger's directory, else
    ``default_root_dir`` (the same choice as Lightning 2.6's ``Trainer.log_dir``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = trainer.loggers
    if loggers:
        first = loggers[0]
        where = first.log_dir if isinstance(first, (TensorBoardLogger, CSVLogger)) else first.save_dir
        if where:
            return Path(where)
    return Path(trainer.default_root_dir)


def report_file(trainer: pl.Trainer, report_path: str | Path | None) -> Path:
    """The report's path: ``report_path``, else ``bottleneck_report.json`` in :func:`report_dir`."""
    return Path(report_path) if report_path else report_dir(trainer) / "bottleneck_report.json"


def window_log_file(trainer: pl.Trainer, window_log: str | Path | bool | None, report_path: Any) -> Path | None:
    """Where the live window log goes: ``window_log``, else beside the report as ``<report stem>.windows.jsonl``;
    ``None`` for none (``window_log=False``, or no report files)."""
    if window_log is False or (window_log is None and report_path is False):
        return None
    if window_log is None:
        report = report_file(trainer, report_path)
        return report.with_name(report.stem + WINDOW_LOG_SUFFIX)
    return Path(window_log)


def run_identity(trainer: pl.Trainer) -> dict[str, str]:
    """``DoctorReport.run``: the LightningModule's class name and the run folder's name (:func:`report_dir`, the
    logger's ``log_dir``, named by :func:`~lightning_accel.core.report.run_name`)."""
    run: dict[str, str] = {}
    module = trainer.lightning_module
    if module is not None:
        run["model"] = type(module).__name__
    name = run_name(report_dir(trainer))
    if name:
        run["name"] = name
    return run


def write_report_files(
    trainer: pl.Trainer, report: DoctorReport, report_path: str | Path | None, *, plot: bool, files: list[Path]
) -> None:
    """Write the JSON at ``report_path`` (``None``: ``bottleneck_report.json`` in :func:`report_dir`; a path ending
    in ``.html``: the self-contained HTML page there, the JSON beside it) and, with
    ``plot``, the PNG of the timeline next to it; ``files`` gets the paths written (the JSON first). A missing
    matplotlib is a note in the report; a write that fails warns."""
    path = report_file(trainer, report_path)
    page = None
    if path.suffix.lower() in (".html", ".htm"):  # the page at that path, the JSON beside it
        page, path = path, path.with_suffix(".json")
    try:
        if plot and report.timeline:
            png = path.with_suffix(".png")
            try:
                files.append(plot_timeline(report, png))
            except ImportError as err:
                report.notes.append(f"no PNG: {err}")
        if page is not None:
            try:
                files.append(write_html(report, page))
            except ImportError as err:
                report.notes.append(f"no HTML page: {err}")
                warnings.warn(f"BottleneckDoctor: no HTML page at {page}: {err}", stacklevel=2)
        files.insert(0, report.save(path))
    except OSError as err:
        warnings.warn(f"BottleneckDoctor: could not write the report to {path} ({err})", stacklevel=2)
        return
    rank_zero_print(trainer, f"BottleneckDoctor: report written to {', '.join(str(f) for f in files)}")
