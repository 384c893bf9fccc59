"""The ``lightning-accel`` command: ``demo | bench | run | estimate-zero | pack | report | scaling | watch``.

Each subcommand lives in :mod:`lightning_accel.commands` (one module per command, found by listing the package).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    import lightning_accel.commands as commands

    parser = argparse.ArgumentParser(
        prog="lightning-accel",
        description="Measure, find the slowest stage, fix it, measure again: PyTorch Lightning acceleration tools.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [
        importlib.import_module(f"{commands.__name__}.{m.name}")
        for m in pkgutil.iter_modules(commands.__path__)
        if not m.name.startswith("_")
    ]
    for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
        module.register(sub)
    return parser


def parser_run(args: argparse.Namespace) -> int:
    from lightning_accel.commands.run import run

    return run(list(args.argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand and return its exit status (``python -m`` and the console script exit with it)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its options end at the script: everything after is the script's own (commands/run.py)
        args = argparse.Namespace(command="run", argv=argv[1:], func=parser_run)
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as err:  # bad user input: one clear line, no traceback
        print(f"lightning-accel {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
