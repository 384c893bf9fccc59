"""``lightning-accel report NEW.json [--baseline OLD.json] [--html OUT.html] [--plan PLAN.json]``: show a
BottleneckDoctor report or what changed, or write it as one self-contained HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ORDER = 40


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_accel.core.report import DoctorReport, compare, run_name

    new = DoctorReport.load(args.report)
    if args.html is not None:
        from lightning_accel.core.autopilot import AutopilotPlan
        from lightning_accel.core.html_report import write_html

        baseline = DoctorReport.load(args.baseline) if args.baseline is not None else None
        plan = AutopilotPlan.load(args.plan).to_dict() if args.plan is not None else None
        # a report that does not name its run is named after its folder: the doctor writes it in the run's folder
        new.run.setdefault("name", run_name(Path(args.report).parent))
        path = write_html(new, args.html, baseline=baseline, plan=plan)
        print(f"report written to {path}")
        return 0
    if args.plan is not None:
        raise SystemExit(
            f"lightning-accel report: --plan {args.plan} is shown in the HTML page only; add --html OUT.html"
        )
    console = Console()
    if args.baseline is None:
        console.print(new.table())
        return 0
    old = DoctorReport.load(args.baseline)
    print(f"{args.baseline} → {args.report}")
    for line in compare(new, old):
        print(line)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="print a BottleneckDoctor report, or compare it with a baseline (before/after a fix)",
        description="Print the stage breakdown and findings of a BottleneckDoctor JSON report; with --baseline, "
        "print per stage what changed, throughput and MFU, and whether the bottleneck moved.",
    )
    parser.add_argument("report", help="the report to show (the new run), e.g. bottleneck_report.json")
    parser.add_argument("--baseline", default=None, help="an earlier report to compare against (the old run)")
    parser.add_argument(
        "--html",
        default=None,
        metavar="OUT.html",
        help="write one self-contained HTML page (plots inline, nothing loaded from the network; "
        "needs matplotlib) instead of printing",
    )
    parser.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="with --html: an Autopilot plan (autopilot_plan.json) whose trials the page shows",
    )
    parser.set_defaults(func=_run)
