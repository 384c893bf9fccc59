"""``lightning-accel bench``: vanilla Lightning vs the recommended stack on the demo task, side by side."""

from __future__ import annotations

import argparse
from typing import Any

ORDER = 1


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lightning_accel.demo.bench import bench_table, recommended_stack, run_bench

    results = run_bench(
        steps=args.steps,
        rounds=args.rounds,
        accelerator=args.accelerator,
        batch_size=args.batch_size,
        compile_backend=args.compile_backend,
        seed=args.seed,
        autopilot=args.autopilot,
        autopilot_budget=args.autopilot_budget,
    )
    stack = ", ".join(f"{k}={v}" for k, v in recommended_stack(args.accelerator).items())
    console = Console()
    Console(width=max(console.width, 130)).print(
        bench_table(
            results,
            title=f"demo GPT on {args.accelerator}: vanilla vs recommended stack vs Autopilot "
            f"({stack}); {args.rounds} alternating rounds, medians",
        )
    )
    for r in results:
        print(f"{r.name}: samples/s per round {', '.join(f'{x:,.1f}' for x in r.rounds)}")
        if r.search_seconds is not None:
            print(
                f"{r.name}: search {r.search_seconds:.1f} s before training (not in its samples/s); kept: "
                f"{'; '.join(r.kept) or 'nothing'}"
            )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="vanilla Lightning vs the recommended stack vs the Autopilot on the demo task, side by side",
        description="Train the demo GPT as vanilla Lightning and with the recommended stack for the device "
        "(AutoMixedPrecision, TorchCompile, DevicePrefetcher) and with the Autopilot, alternating runs, "
        "and print samples/s, MFU, stage shares, peak memory and the ratio.",
    )
    parser.add_argument("--steps", type=int, default=120, help="steps per run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per variant, alternating (default %(default)s)")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"), help="default %(default)s")
    parser.add_argument("--batch-size", type=int, default=32, help="per-device batch (default %(default)s)")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the stack (default %(default)s; aot_eager for a quick check)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument(
        "--autopilot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the Autopilot variant (default on)",
    )
    parser.add_argument(
        "--autopilot-budget",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds the Autopilot may search per run (default %(default)s)",
    )
    parser.set_defaults(func=_run)
