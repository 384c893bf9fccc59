"""``lightning-accel watch DIR``: follow a running fit's window log and redraw the doctor's view every few seconds."""

from __future__ import annotations

import argparse
import time
from typing import Any

ORDER = 45


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from lightning_accel.core.window_log import LiveState, WindowLogReader, find_window_log, render_live

    if args.interval <= 0:
        raise ValueError(f"--interval {args.interval}: use seconds > 0, e.g. 2")
    console = Console()
    deadline = None if args.wait is None else time.monotonic() + args.wait
    path = find_window_log(args.where)
    if path is None:
        console.print(f"waiting for a window log (*.windows.jsonl) under {args.where} ...")
    while path is None:
        if deadline is not None and time.monotonic() > deadline:
            console.print(
                f"no window log appeared under {args.where} within {args.wait:g} s "
                "(is BottleneckDoctor among the fit's callbacks, with report_path not False?)"
            )
            return 1
        time.sleep(min(args.interval, 1.0))
        path = find_window_log(args.where)
    reader, state = WindowLogReader(path), LiveState()
    # a terminal redraws one frame in place; a pipe or a file gets a frame per new window, appended
    live = Live(render_live(state, str(path)), console=console, auto_refresh=False) if console.is_terminal else None
    shown = -1
    try:
        if live is not None:
            live.start()
        while True:
            for event in reader.read_events():
                state.apply(event)
            frame = render_live(state, str(path))
            if live is not None:
                live.update(frame, refresh=True)
            elif len(state.windows) != shown or state.ended:
                console.print(frame)
                shown = len(state.windows)
            if state.ended or args.once or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(args.interval)
    finally:
        if live is not None:
            live.stop()
    if state.ended and state.status and state.status != "finished":
        return 1
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "watch",
        help="follow a running fit: the doctor's stage breakdown, throughput, MFU and findings, live",
        description="Follow the BottleneckDoctor's window log of a running fit (rank 0's, under DDP) and redraw "
        "the stage breakdown, throughput, MFU and the current findings every few seconds; exits when "
        "the fit ends (status 1 when it failed).",
    )
    parser.add_argument(
        "where",
        help="the fit's log folder (searched for the newest *.windows.jsonl, e.g. "
        "lightning_logs/) or a window log file",
    )
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    parser.add_argument(
        "--wait", type=float, default=None, help="give up after this many seconds (default: follow until the fit ends)"
    )
    parser.add_argument("--once", action="store_true", help="draw what the log holds now and exit")
    parser.set_defaults(func=_run)
