"""``lightning-accel report NEW.json [--baseline OLD.json]``: show a BottleneckDoctor report, or what changed."""

from __future__ import annotations

import argparse
from typing import Any

ORDER = 40


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_accel.core.report import DoctorReport, compare

    new = DoctorReport.load(args.report)
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
        "report", help="print a BottleneckDoctor report, or compare it with a baseline (before/after a fix)",
        description="Print the stage breakdown and findings of a BottleneckDoctor JSON report; with --baseline, "
                    "print per stage what changed, throughput and MFU, and whether the bottleneck moved.")
    parser.add_argument("report", help="the report to show (the new run), e.g. bottleneck_report.json")
    parser.add_argument("--baseline", default=None, help="an earlier report to compare against (the old run)")
    parser.set_defaults(func=_run)
