"""What the Autopilot hands back once it searched or replayed: the plan (kept changes, trials, the configuration as
LightningCLI YAML and Python), the ``autopilot/*`` keys, the plan file, the summary line and the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_accel._atomic import atomic_write_text
from lightning_accel.callbacks.autopilot.fixes import Intervention, Run
from lightning_accel.core.autopilot import AutopilotPlan, Outcome, TrialRecord, claim_text, render_python, render_yaml

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["finish", "jsonable", "trials_table"]


def finish(
    run: Run,
    plan: AutopilotPlan,
    *,
    kept: Sequence[Intervention],
    records: Sequence[TrialRecord],
    notes: Sequence[str],
    path: Path | None,
    print_summary: bool,
) -> tuple[str, str]:
    """Fill ``plan`` with the kept changes, the trials and the configuration; log the ``autopilot/*`` keys; write the
    plan to ``path`` (and its YAML beside it); print the summary, the notes and, with ``print_summary``, the table.
    Returns the configuration as (YAML, Python)."""
    yaml_entries: list[tuple[str, Any]] = []
    python_lines: list[str] = []
    for fix in kept:
        y, p = fix.config(run)
        yaml_entries.extend(y)
        python_lines.extend(p)
    yaml, python = render_yaml(yaml_entries), render_python(python_lines)
    plan.kept = [{"name": c.name, "params": jsonable(c.params), "change": c.describe(run)} for c in kept]
    if not plan.trials or not plan.stopped or not plan.stopped.startswith("replayed"):
        plan.trials = [r.to_dict() for r in records]
    plan.yaml, plan.python = yaml, python
    trainer = run.trainer
    _log(trainer, plan, kept, records)
    if path is not None and trainer.is_global_zero:
        plan.save(path)
        if yaml:
            atomic_write_text(path.with_suffix(".yaml"), yaml)
    rank_zero_info(
        f"Autopilot: kept {len(kept)} change(s)"
        + (claim_text(plan) if kept else "")
        + (f" ({plan.stopped})" if plan.stopped else "")
    )
    for note in notes:
        rank_zero_info(f"Autopilot: {note}")
    if print_summary and trainer.is_global_zero and records:
        from rich.console import Console

        console = Console()
        console = Console(width=max(console.width, 130))
        console.print(trials_table(records, plan))
        for title, text in (("LightningCLI YAML", yaml), ("Python", python)):
            if text:
                console.print(f"[bold]Autopilot configuration[/bold] ({title}):", markup=True)
                console.print(text, markup=False, highlight=False)
        if path is not None:
            console.print(
                f"Plan: {path}  (replay without searching: Autopilot(plan={str(path)!r}))",
                markup=False,
                highlight=False,
            )
    return yaml, python


def _log(
    trainer: pl.Trainer, plan: AutopilotPlan, kept: Sequence[Intervention], records: Sequence[TrialRecord]
) -> None:
    if not (plan.baseline_samples_per_sec and plan.final_samples_per_sec):
        return
    trialled = sum(1 for r in records[1:] if r.samples_per_sec is not None or Outcome(r.outcome).trialled)
    metrics = {
        "autopilot/baseline_samples_per_sec": plan.baseline_samples_per_sec,
        "autopilot/final_samples_per_sec": plan.final_samples_per_sec,
        "autopilot/speedup": plan.speedup if plan.speedup is not None and kept else 1.0,
        "autopilot/trials": float(trialled),
        "autopilot/kept": float(len(kept)),
        "autopilot/noise": float(plan.noise or 0.0),
        "autopilot/search_seconds": float(plan.search_seconds or 0.0),
    }
    if plan.speedup_low is not None and plan.speedup_high is not None and kept:
        metrics["autopilot/speedup_low"] = plan.speedup_low
        metrics["autopilot/speedup_high"] = plan.speedup_high
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def trials_table(records: Sequence[TrialRecord], plan: AutopilotPlan | None) -> Any:
    """The rich table of the trials: trial, change, samples/s, × baseline, kept, reason."""
    from rich.table import Table

    title = "Autopilot (rank 0): global samples/s, each change trialled against the configuration before it"
    if plan is not None and plan.stopped:
        title += f"; stopped: {plan.stopped}"
    table = Table(title=title, header_style="bold")
    for col, justify in (
        ("trial", "right"),
        ("change", "left"),
        ("samples/s", "right"),
        ("× baseline", "right"),
        ("kept", "center"),
        ("reason", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in records:
        table.add_row(
            str(r.index),
            r.change if r.index else "baseline (as configured)",
            f"{r.samples_per_sec:,.1f}" if r.samples_per_sec else "—",
            f"{r.vs_baseline:.2f}" if r.vs_baseline else "—",
            "✓" if r.kept and r.index else ("" if r.index else "·"),
            r.reason,
        )
    return table


def jsonable(value: Any) -> Any:
    """``value`` with every leaf JSON can hold as it is, and the others as their ``str``."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
