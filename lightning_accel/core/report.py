"""The BottleneckDoctor report: stage breakdown, verdict, findings; JSON round-trip, terminal table, before/after.

:class:`DoctorReport` is plain data (no Lightning), written by the callback at the end of ``fit`` and read back by
``lightning-accel report``. :func:`compare` turns a baseline and a new report into the before/after lines
("data 46.0 % → 4.0 %; the run is now compute-bound").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_accel._atomic import atomic_path, atomic_write_text
from lightning_accel.core.rules import STAGES, Finding, RunContext, SkippedRule

__all__ = ["DoctorReport", "compare", "plot_timeline", "run_name"]

REPORT_VERSION = 1
_COMPUTE = ("forward", "backward")


@dataclass
class DoctorReport:
    """What the doctor measured over a run.

    Attributes:
        bottleneck: the stage that holds the run back (one of ``STAGES``): the stage of the first finding, or with no
            finding the largest stage (then forward/backward: compute-bound); ``None`` when too little was measured
            (see ``notes``).
        shares: stage → fraction of the step time (sums to 1), mean over the measured windows and ranks.
        stage_seconds: stage → mean seconds per batch (per device).
        step_seconds: mean wall time of one batch (per device), seconds.
        batches: batches measured (per device, after warm-up).
        windows: measuring windows closed.
        world_size: number of ranks aggregated.
        rank_shares: each rank's own shares (index = global rank), to spot a straggler.
        samples_per_sec: global throughput (all ranks) over the measured windows.
        mfu: model FLOPs utilisation from ``MFUMonitor`` when it ran, else ``None``.
        utilisation: means over windows: ``cpu_process_pct`` / ``cpu_workers_pct`` (% of one core, per rank),
            ``gpu_util_pct`` (%), ``gpu_mem_used_frac`` and ``memory_peak_frac`` (fractions of capacity),
            ``gpu_sm_clock_mhz``.
        findings: diagnosed problems with their fixes, the step's and the fit's reconciled into one list, largest
            ``saving`` first (the first is the fix that saves the most; :func:`~lightning_accel.core.verdict.
            build_report`).
        skipped: rules that could not run and why.
        context: what was known about the run (device, dtype, DataLoader settings, ...).
        precision: ``loss_scale``, ``skipped_steps``, ``total_steps`` of the precision plugin when it has them.
        timeline: one entry per window: ``{"batch": batches measured so far, "shares": {...}, "step_seconds": s,
            "samples_per_sec": global throughput of that window}``.
        notes: caveats (too little data, measuring problems).
        thresholds: the thresholds the rules used.
        rank_stage_seconds: each rank's mean seconds per batch and stage (index = global rank; DDP only).
        variability: per rank, the batch-time statistics of :func:`~lightning_accel.core.variability.
            merge_windows` (``step_p5``, ``step_p50``, ``step_p95`` in seconds, ``spikes``, ``spike_period``, ...).
        fit: the whole fit (:class:`~lightning_accel.core.phases.FitBreakdown` as a dict: ``seconds`` per phase,
            ``wall``, ``counts``, ``sanity_seconds``, ``train_batches``), rank 0's clock.
        fit_findings: findings about the fit outside the step (``validation_heavy``, ``checkpoint_heavy``), also
            in ``findings``.
        smells: code smells found before the first step (:func:`~lightning_accel.core.smells.find_smells`).
        smells_skipped: smells that could not be checked and why.
        attribution: the compute attribution of the profiled window when one ran
            (:meth:`~lightning_accel.core.attribution.Attribution.to_dict`: ``modules`` by time with their costliest
            ``ops``, ``leaves``, ``forward_ms`` / ``backward_ms``, ``measured_ms``, ``ranks``, ``window``,
            ``overhead``, ``notes``); its findings are in ``findings`` (``kind="compute"``, with the ``module``).
        run: what names the run, for the HTML page's title: ``model`` (the LightningModule's class name) and
            ``name`` (its run folder, :func:`run_name`); empty when unknown.
    """

    bottleneck: str | None = None
    shares: dict[str, float] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None
    batches: int = 0
    windows: int = 0
    world_size: int = 1
    rank_shares: list[dict[str, float]] = field(default_factory=list)
    samples_per_sec: float | None = None
    mfu: float | None = None
    utilisation: dict[str, float] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    skipped: list[SkippedRule] = field(default_factory=list)
    context: RunContext = field(default_factory=RunContext)
    precision: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)
    rank_stage_seconds: list[dict[str, float]] = field(default_factory=list)
    variability: list[dict[str, float]] = field(default_factory=list)
    fit: dict[str, Any] = field(default_factory=dict)
    fit_findings: list[Finding] = field(default_factory=list)
    smells: list[Finding] = field(default_factory=list)
    smells_skipped: list[SkippedRule] = field(default_factory=list)
    attribution: dict[str, Any] = field(default_factory=dict)
    run: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "bottleneck": self.bottleneck,
            "shares": dict(self.shares),
            "stage_seconds": dict(self.stage_seconds),
            "step_seconds": self.step_seconds,
            "batches": self.batches,
            "windows": self.windows,
            "world_size": self.world_size,
            "rank_shares": [dict(r) for r in self.rank_shares],
            "samples_per_sec": self.samples_per_sec,
            "mfu": self.mfu,
            "utilisation": dict(self.utilisation),
            "findings": [f.to_dict() for f in self.findings],
            "skipped": [s.to_dict() for s in self.skipped],
            "context": self.context.to_dict(),
            "precision": dict(self.precision),
            "timeline": list(self.timeline),
            "notes": list(self.notes),
            "thresholds": dict(self.thresholds),
            "rank_stage_seconds": [dict(r) for r in self.rank_stage_seconds],
            "variability": [dict(v) for v in self.variability],
            "fit": dict(self.fit),
            "fit_findings": [f.to_dict() for f in self.fit_findings],
            "smells": [f.to_dict() for f in self.smells],
            "smells_skipped": [s.to_dict() for s in self.smells_skipped],
            "attribution": dict(self.attribution),
            "run": dict(self.run),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "report") -> DoctorReport:
        """Rebuild a report; ``source`` (e.g. the file name) is named in errors."""
        if not isinstance(data, Mapping) or "shares" not in data or "bottleneck" not in data:
            raise ValueError(f"{source}: not a BottleneckDoctor report (no 'shares'/'bottleneck' keys)")
        version = data.get("version", REPORT_VERSION)
        if version != REPORT_VERSION:
            raise ValueError(
                f"{source}: report version {version!r}; this lightning-accel reads version {REPORT_VERSION}"
            )
        bottleneck = data["bottleneck"]
        if bottleneck is not None and bottleneck not in STAGES:
            raise ValueError(f"{source}: bottleneck {bottleneck!r} is not a stage ({', '.join(STAGES)})")
        try:
            return cls(
                bottleneck=bottleneck,
                shares={str(k): float(v) for k, v in data["shares"].items()},
                stage_seconds={str(k): float(v) for k, v in data.get("stage_seconds", {}).items()},
                step_seconds=_opt_float(data.get("step_seconds")),
                batches=int(data.get("batches", 0)),
                windows=int(data.get("windows", 0)),
                world_size=int(data.get("world_size", 1)),
                rank_shares=[{str(k): float(v) for k, v in r.items()} for r in data.get("rank_shares", [])],
                samples_per_sec=_opt_float(data.get("samples_per_sec")),
                mfu=_opt_float(data.get("mfu")),
                utilisation={str(k): float(v) for k, v in data.get("utilisation", {}).items()},
                findings=[Finding.from_dict(f) for f in data.get("findings", [])],
                skipped=[SkippedRule(str(s["rule"]), str(s["reason"])) for s in data.get("skipped", [])],
                context=RunContext.from_dict(data.get("context", {})),
                precision=dict(data.get("precision", {})),
                timeline=list(data.get("timeline", [])),
                notes=[str(n) for n in data.get("notes", [])],
                thresholds=dict(data.get("thresholds", {})),
                rank_stage_seconds=[
                    {str(k): float(v) for k, v in r.items()} for r in data.get("rank_stage_seconds", [])
                ],
                variability=[{str(k): float(v) for k, v in r.items()} for r in data.get("variability", [])],
                fit=dict(data.get("fit", {})),
                fit_findings=[Finding.from_dict(f) for f in data.get("fit_findings", [])],
                smells=[Finding.from_dict(f) for f in data.get("smells", [])],
                smells_skipped=[SkippedRule(str(s["rule"]), str(s["reason"])) for s in data.get("smells_skipped", [])],
                attribution=dict(data.get("attribution") or {}),
                run={str(k): str(v) for k, v in (data.get("run") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{source}: malformed BottleneckDoctor report ({err!r})") from err

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON atomically (a temporary file renamed into place: never a half-written report)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DoctorReport:
        """Read a report written by :meth:`save`; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no report at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        return cls.from_dict(data, source=str(path))

    # ------------------------------------------------------------------ terminal
    def table(self) -> Any:
        """A rich renderable: the stage table, throughput, findings with fixes, skipped rules, notes."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        title = "BottleneckDoctor report"
        if self.bottleneck is not None:
            title += f" — bottleneck: {self.bottleneck}"
        table = Table(title=title, show_header=True, header_style="bold")
        table.add_column("stage")
        table.add_column("share of step", justify="right")
        table.add_column("ms / batch", justify="right")
        table.add_column("")
        for stage in STAGES:
            share = self.shares.get(stage)
            if share is None:
                continue
            ms = self.stage_seconds.get(stage)
            bar = "█" * int(round(30 * share))
            style = "bold red" if stage == self.bottleneck else None
            table.add_row(stage, f"{100 * share:.1f} %", "—" if ms is None else f"{1000 * ms:.2f}", bar, style=style)
        if self.step_seconds is not None:
            table.add_row("step", "100 %", f"{1000 * self.step_seconds:.2f}", "per device, mean over ranks")
        parts.append(table)
        facts = [f"measured {self.batches} batches per device in {self.windows} windows on {self.world_size} rank(s)"]
        if self.samples_per_sec is not None:
            facts.append(f"throughput {self.samples_per_sec:,.1f} samples/s (global)")
        if self.mfu is not None:
            facts.append(f"MFU {100 * self.mfu:.1f} %")
        util = self.utilisation
        if "gpu_util_pct" in util:
            facts.append(f"GPU utilisation {util['gpu_util_pct']:.0f} %")
        if "cpu_process_pct" in util and self.context.threaded_pipeline:
            facts.append(
                f"CPU: process {util['cpu_process_pct']:.0f} % (of one core, per rank; "
                f"{self.context.loader}'s threads included)"
            )
        elif "cpu_process_pct" in util:
            facts.append(
                f"CPU: process {util['cpu_process_pct']:.0f} %, DataLoader workers "
                f"{util.get('cpu_workers_pct', 0.0):.0f} % (of one core, per rank)"
            )
        if "memory_peak_frac" in util:
            facts.append(f"device memory peak {100 * util['memory_peak_frac']:.0f} % of capacity")
        if self.precision:
            facts.append("precision plugin: " + ", ".join(f"{k}={v}" for k, v in self.precision.items()))
        parts.append(Text("; ".join(facts)))
        parts.extend(self._rank_parts())
        if self.findings:
            basis = "fit" if self.fit.get("wall") else "step"
            for i, f in enumerate(self.findings, 1):
                saves = f"(saves up to {100 * f.saving:.1f} % of the {basis}) " if f.saving is not None else ""
                where = f"{f.stage}: {f.module}" if f.module else f.stage
                parts.append(Text.assemble((f"{i}. [{where}] ", "bold yellow"), saves, f.evidence))
                parts.append(Text.assemble(("   fix: ", "bold green"), f.fix))
        elif self.bottleneck is not None:
            parts.append(Text("No finding: no stage crosses its threshold.", style="green"))
        if self.skipped:
            parts.append(
                Text("skipped rules: " + "; ".join(f"{s.rule} ({s.reason})" for s in self.skipped), style="dim")
            )
        parts.extend(self._fit_parts())
        parts.extend(self._attribution_parts())
        if self.smells:
            parts.append(Text("code smells (before the first step):", style="bold"))
            for f in self.smells:
                gain = f" (previewed {f.gain:.2f}x)" if f.gain is not None else ""
                parts.append(Text.assemble((f"- {f.rule} [{f.stage}] ", "bold yellow"), f.evidence + gain))
                parts.append(Text.assemble(("   fix: ", "bold green"), f.fix))
        for note in self.notes:
            parts.append(Text(f"note: {note}", style="yellow"))
        return Group(*parts)

    def _rank_parts(self) -> list[Any]:
        """Per-rank table (ms per batch and stage) when there are several ranks."""
        from rich.table import Table

        if len(self.rank_stage_seconds) < 2:
            return []
        table = Table(title="per rank (ms / batch)", show_header=True, header_style="bold")
        table.add_column("rank")
        for stage in STAGES:
            table.add_column(stage, justify="right")
        table.add_column("step", justify="right")
        for rank, seconds in enumerate(self.rank_stage_seconds):
            table.add_row(
                str(rank), *[f"{1000 * seconds.get(s, 0.0):.2f}" for s in STAGES], f"{1000 * sum(seconds.values()):.2f}"
            )
        return [table]

    def _attribution_parts(self) -> list[Any]:
        """The compute attribution's module rows (when a window was profiled)."""
        from rich.table import Table
        from rich.text import Text

        rows = self.attribution.get("modules") or []
        if not rows:
            return []
        steps = self.attribution.get("steps", 0)
        table = Table(
            title=f"compute attribution ({steps} profiled steps; share of forward + backward)",
            show_header=True,
            header_style="bold",
        )
        table.add_column("module")
        for name in ("share", "fwd ms", "bwd ms"):
            table.add_column(name, justify="right")
        table.add_column("costliest operation (input shapes)")
        for row in rows:
            ops = row.get("ops") or []
            top = f"{ops[0]['name']} ({ops[0].get('shapes', '')})" if ops else ""
            indent = "  " if row.get("depth", 0) and rows[0].get("depth") != row.get("depth") else ""
            table.add_row(
                indent + str(row.get("module")),
                f"{100 * float(row.get('share', 0.0)):.1f} %",
                f"{float(row.get('forward_ms', 0.0)):.2f}",
                f"{float(row.get('backward_ms', 0.0)):.2f}",
                top,
            )
        parts: list[Any] = [table]
        overhead = self.attribution.get("overhead") or {}
        if overhead.get("extra_s") is not None:
            parts.append(Text(f"the profiled window cost {overhead['extra_s']:.3f} s of the fit", style="dim"))
        return parts

    def _fit_parts(self) -> list[Any]:
        """The fit-level phases, variability and the fit findings."""
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        seconds, wall = self.fit.get("seconds", {}), self.fit.get("wall", 0.0)
        if wall:
            counts = self.fit.get("counts", {})
            table = Table(title=f"whole fit: {wall:.2f} s (rank 0)", show_header=True, header_style="bold")
            table.add_column("phase")
            table.add_column("seconds", justify="right")
            table.add_column("share of fit", justify="right")
            table.add_column("")
            what = {
                "startup": "set-up + warm-up batches (FLOP counting, compilation)",
                "train": f"{self.batches} measured batches",
                "validation": f"{counts.get('validation', 0)} run(s)"
                + (" + sanity check" if counts.get("sanity_check") else ""),
                "checkpoint": f"{counts.get('checkpoint', 0)} save(s)",
                "other": "epoch ends, logging/callbacks between batches, teardown",
            }
            for phase in ("startup", "train", "validation", "checkpoint", "other"):
                value = seconds.get(phase, 0.0)
                table.add_row(phase, f"{value:.2f}", f"{100 * value / wall:.1f} %", what[phase])
            parts.append(table)
        stats = [(r, v) for r, v in enumerate(self.variability) if v]
        if stats:
            text = "; ".join(
                f"{f'rank {r}: ' if len(stats) > 1 else ''}batch p5 {1e3 * v['step_p5']:.2f} ms, "
                f"p50 {1e3 * v['step_p50']:.2f} ms, p95 {1e3 * v['step_p95']:.2f} ms, "
                f"{int(v.get('spikes', 0))} spike(s)"
                for r, v in stats
            )
            parts.append(Text(f"step-time variability: {text}"))
        listed = [f for f in self.fit_findings if f not in self.findings]  # reports that kept them apart
        for i, f in enumerate(listed, 1):
            parts.append(Text.assemble((f"fit {i}. [{f.stage}] ", "bold yellow"), f.evidence))
            parts.append(Text.assemble(("   fix: ", "bold green"), f.fix))
        return parts


def run_name(folder: str | os.PathLike[str]) -> str:
    """A run's name from its folder: its own name, with the parent's for Lightning's numbered runs
    (``logs/demo/version_3`` → ``demo/version_3``: the loggers number the runs of one name)."""
    path = Path(folder).resolve()
    if path.name.startswith("version_") and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


def compare(new: DoctorReport, baseline: DoctorReport) -> list[str]:
    """Before/after lines: per-stage shares and times, throughput, MFU, and whether the bottleneck moved."""
    lines = []
    if new.bottleneck is None or baseline.bottleneck is None:
        which = "new" if new.bottleneck is None else "baseline"
        lines.append(
            f"the {which} report measured too little to compare stages "
            f"({'; '.join((new if which == 'new' else baseline).notes) or 'no windows'})"
        )
    width = max(len(s) for s in STAGES)
    for stage in STAGES:
        old_s, new_s = baseline.shares.get(stage), new.shares.get(stage)
        if old_s is None and new_s is None:
            continue
        line = f"{stage:<{width}}  {_fmt_pct(old_s):>8} → {_fmt_pct(new_s):>8}"
        old_t, new_t = baseline.stage_seconds.get(stage), new.stage_seconds.get(stage)
        if old_t is not None and new_t is not None:
            line += f"   {1000 * old_t:8.2f} → {1000 * new_t:8.2f} ms/batch"
        lines.append(line)
    if baseline.step_seconds and new.step_seconds:
        speed = baseline.step_seconds / new.step_seconds
        how = f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"
        lines.append(
            f"{'step':<{width}}  {1000 * baseline.step_seconds:.2f} → {1000 * new.step_seconds:.2f} ms/batch "
            f"({how} per batch)"
        )
    if baseline.samples_per_sec and new.samples_per_sec:
        lines.append(
            f"throughput: {baseline.samples_per_sec:,.1f} → {new.samples_per_sec:,.1f} samples/s "
            f"({new.samples_per_sec / baseline.samples_per_sec:.2f}x)"
        )
    else:
        lines.append("throughput: not measured in both reports")
    if baseline.mfu is not None or new.mfu is not None:
        lines.append(f"MFU: {_fmt_pct(baseline.mfu)} → {_fmt_pct(new.mfu)}")
    if new.bottleneck is not None and baseline.bottleneck is not None:
        old_b, new_b = baseline.bottleneck, new.bottleneck
        headline = f"{old_b} {_fmt_pct(baseline.shares.get(old_b))} → {_fmt_pct(new.shares.get(old_b))}"
        if new_b == old_b:
            kind = f"compute-bound ({new_b})" if new_b in _COMPUTE else f"{new_b}-bound"
            lines.append(f"bottleneck unchanged: {headline}; still {kind}")
        else:
            kind = "compute-bound" if new_b in _COMPUTE else f"{new_b}-bound"
            lines.append(
                f"bottleneck moved: {headline}; the run is now {kind} ({new_b} {_fmt_pct(new.shares.get(new_b))})"
            )
    lines.extend(_compare_fit(new, baseline))
    old_rules = {f.rule: f for f in baseline.findings if f.kind != "fit"}  # the fit's: in _compare_fit
    new_rules = {f.rule for f in new.findings if f.kind != "fit"}
    resolved = [old_rules[r] for r in sorted(set(old_rules) - new_rules)]
    if resolved:
        lines.append(
            "resolved findings: "
            + ", ".join(
                f"{f.rule} ({f.stage} {_fmt_pct(baseline.shares.get(f.stage))} → {_fmt_pct(new.shares.get(f.stage))})"
                for f in resolved
            )
        )
    if new_rules - set(old_rules):
        lines.append("new findings: " + ", ".join(sorted(new_rules - set(old_rules))))
    for f in new.findings:
        lines.append(f"  [{f.stage}] {f.evidence} Fix: {f.fix}")
    return lines


def _compare_fit(new: DoctorReport, baseline: DoctorReport) -> list[str]:
    """Fit phases old → new (share of the fit's wall time), and the fit findings and smells that went away."""
    lines = []
    old_wall, new_wall = baseline.fit.get("wall") or 0.0, new.fit.get("wall") or 0.0
    if old_wall > 0 and new_wall > 0:
        old_s, new_s = baseline.fit.get("seconds", {}), new.fit.get("seconds", {})
        parts = [
            f"{p} {_fmt_pct(old_s.get(p, 0.0) / old_wall)} → {_fmt_pct(new_s.get(p, 0.0) / new_wall)}"
            for p in ("startup", "train", "validation", "checkpoint", "other")
            if max(old_s.get(p, 0.0) / old_wall, new_s.get(p, 0.0) / new_wall) >= 0.01
        ]
        lines.append(f"whole fit {old_wall:.2f} s → {new_wall:.2f} s: " + ", ".join(parts))
    for what, old_list, new_list in (
        ("fit findings", baseline.fit_findings, new.fit_findings),
        ("code smells", baseline.smells, new.smells),
    ):
        gone = sorted({f.rule for f in old_list} - {f.rule for f in new_list})
        if gone:
            lines.append(f"resolved {what}: {', '.join(gone)}")
        added = sorted({f.rule for f in new_list} - {f.rule for f in old_list})
        if added:
            lines.append(f"new {what}: {', '.join(added)}")
    return lines


def plot_timeline(report: DoctorReport, path: str | os.PathLike[str]) -> Path:
    """PNG of the stacked stage shares per window over the run (needs matplotlib: the ``plots`` extra)."""
    from lightning_accel._imports import require

    require("matplotlib", "BottleneckDoctor plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching the global backend
    from matplotlib.figure import Figure

    if not report.timeline:
        raise ValueError("no window was measured: nothing to plot")
    x = [w["batch"] for w in report.timeline]
    ys = [[100 * w["shares"].get(s, 0.0) for w in report.timeline] for s in STAGES]
    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if len(x) == 1:  # a stacked area needs two points: draw one bar
        bottom = 0.0
        for stage, y in zip(STAGES, ys):
            ax.bar(x, y, bottom=bottom, label=stage, width=max(1, x[0] * 0.5))
            bottom += y[0]
    else:
        ax.stackplot(x, ys, labels=list(STAGES))
    ax.set_xlabel("batches measured (per device)")
    ax.set_ylabel("share of step time (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Stage breakdown per window — bottleneck: {report.bottleneck}")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
