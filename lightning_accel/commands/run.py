"""``lightning-accel run [options] script.py [args...]`` (or ``-m package.module``): the script run exactly as
``python script.py args`` would run it, with lightning-accel attached to every ``Trainer`` it builds (docs/attach.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ORDER = 2

_USAGE = "lightning-accel run [--doctor] [--mfu] [--html] [--autopilot | --plan PLAN] [--report-dir DIR] [--watch] "
_USAGE += "(script.py | -m package.module) [args ...]"


def _options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-accel run",
        usage=_USAGE,
        description="Run a Lightning script unchanged, as `python script.py args` would (its __main__, sys.argv, "
        "sys.path[0] and exit status), with lightning-accel attached to each Trainer it builds, in every process "
        "it starts: by default MFUMonitor and BottleneckDoctor, their reports in the logger's log_dir (else "
        "<default_root_dir>/lightning_accel). Options go before the script; everything after it is the script's.",
    )
    parser.add_argument("--doctor", action="store_true", help="attach BottleneckDoctor (default, with --mfu)")
    parser.add_argument("--mfu", action="store_true", help="attach MFUMonitor (default, with --doctor)")
    parser.add_argument("--html", action="store_true", help="write the doctor's HTML page when the fit ends")
    parser.add_argument(
        "--autopilot",
        action="store_true",
        help="attach the Autopilot: search, train with what it keeps, write the plan",
    )
    parser.add_argument(
        "--plan", type=Path, default=None, metavar="PLAN", help="replay this Autopilot plan (autopilot_plan.json)"
    )
    parser.add_argument("--report-dir", type=Path, default=None, metavar="DIR", help="write every report here")
    parser.add_argument(
        "--watch", action="store_true", help="print how to follow the fit live (`lightning-accel watch`)"
    )
    parser.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module, as `python -m`")
    return parser


def split_command(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The run's options and the child's command line (``[python, script, args...]`` or ``[python, -m, module,
    args...]``): options end at the script (or at ``-m``'s module), everything after belongs to the script."""
    parser = _options()
    cut = len(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("--plan", "--report-dir"):
            i += 2
            continue
        if token == "-m":
            cut = min(i + 2, len(argv))
            break
        if token == "--":
            argv = argv[:i] + argv[i + 1 :]
            cut = i
            break
        if not token.startswith("-"):
            cut = i
            break
        i += 1
    args = parser.parse_args(argv[:cut])
    rest = argv[cut:]
    if args.module is not None:
        return args, [sys.executable, "-m", args.module, *rest]
    if not rest:
        parser.error("give the script to run (script.py [args ...]) or -m package.module")
    return args, [sys.executable, *rest]


def attach_value(args: argparse.Namespace) -> str:
    """The ``LIGHTNING_ACCEL`` value the options stand for."""
    from lightning_accel.attach import AttachSpec

    if args.autopilot and args.plan is not None:
        raise ValueError("--autopilot searches and --plan replays a plan: give one of them")
    if args.plan is not None and not args.plan.is_file():
        raise FileNotFoundError(f"--plan {args.plan}: no such file (a search writes autopilot_plan.json)")
    measuring = args.doctor or args.mfu or args.html
    chosen = args.autopilot or args.plan is not None
    spec = AttachSpec(
        doctor=args.doctor or args.html or not (measuring or chosen),
        mfu=args.mfu or not (measuring or chosen),
        html=args.html,
        autopilot=args.autopilot,
        plan=args.plan.resolve() if args.plan is not None else None,
        report_dir=args.report_dir.resolve() if args.report_dir is not None else None,
    )
    return spec.to_value()


def run(argv: list[str]) -> int:
    """Run the child with the entry point switched on; return its exit status (a child ended by a signal ends this
    process by the same signal, so the caller sees what ``python script.py`` would have shown)."""
    from lightning_accel.attach import ENV_VAR, RECORD_VAR

    args, command = split_command(argv)
    value = attach_value(args)
    fd, record = tempfile.mkstemp(prefix="lightning-accel-run-", suffix=".jsonl")
    os.close(fd)
    env = {**os.environ, ENV_VAR: value, RECORD_VAR: record}
    print(f"lightning-accel run: {ENV_VAR}={value}", file=sys.stderr, flush=True)
    if args.watch:
        where = args.report_dir or Path.cwd()
        print(
            f"lightning-accel run: follow it live from another terminal: lightning-accel watch {where}",
            file=sys.stderr,
            flush=True,
        )
    try:
        status = _wait(command, env)
        _print_record(record)
    finally:
        os.unlink(record)
    if status < 0:  # ended by a signal: end the same way (SIGINT after an uncaught KeyboardInterrupt)
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


def _wait(command: list[str], env: dict[str, str]) -> int:
    """Start the child in this process group (a terminal's Ctrl-C reaches it directly, so this process ignores
    SIGINT rather than sending a second one) and pass SIGTERM and SIGHUP on (a scheduler stopping the job)."""
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: Any) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_record(record: str) -> None:
    try:
        lines = Path(record).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        files = entry.get("files") or []
        if files:
            print(f"lightning-accel run: reports in {entry.get('folder')}:", file=sys.stderr)
            for name in files:
                print(f"  {name}", file=sys.stderr)
        else:
            print(f"lightning-accel run: no report was written (folder {entry.get('folder')})", file=sys.stderr)
    sys.stderr.flush()


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a Lightning script unchanged, with the doctor and MFU (or the Autopilot, or its plan) attached",
        description=_options().description,
        usage=_USAGE,
        add_help=False,
    )
    # ``lightning-accel run ...`` is dispatched before this parser sees it (cli.main): listed here for --help
    parser.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
