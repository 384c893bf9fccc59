"""The ``lightning-accel`` command: ``demo | bench | estimate-zero | pack | report | scaling`` as they are built.

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
    modules = [importlib.import_module(f"{commands.__name__}.{m.name}")
               for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")]
    for module in sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__)):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; ``argv=None`` means run as the program (the console script, ``python -m``).

    The process groups a multi-process command started (``demo --devices 2``, ``scaling`` workers) are destroyed
    before it returns. Run as the program, it ends through :func:`~lightning_accel.strategies.shutdown.
    exit_distributed`, which leaves without the interpreter's teardown once a process group was started: that
    teardown, or a group destroyed on its own gloo thread, can abort a finished run with exit -6.
    """
    from lightning_accel.strategies.shutdown import destroy_process_groups, exit_distributed

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
    except (ValueError, FileNotFoundError) as err:  # bad user input: one clear line, no traceback
        print(f"lightning-accel {args.command}: error: {err}", file=sys.stderr)
        code = 2
    finally:
        if argv is not None:  # run as the program, exit_distributed destroys them (keeping the default one's object)
            destroy_process_groups()
    if argv is None:
        exit_distributed(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
