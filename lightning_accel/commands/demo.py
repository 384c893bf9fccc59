"""``lightning-accel demo``: the main job — train the demo GPT with the measuring callbacks on."""

from __future__ import annotations

import argparse
from typing import Any

ORDER = 0


def _run(args: argparse.Namespace) -> int:
    from lightning_accel.demo.run import config_from_args, run_demo

    result = run_demo(config_from_args(args))
    trainer = result["trainer"]
    if trainer.is_global_zero and "val_acc" in result:  # --data images
        print(
            f"demo finished: train_loss {result['train_loss']:.3f}, val_loss {result['val_loss']:.3f} "
            f"(nats/image; a uniform guess over the 10 classes scores 2.303), val_acc {result['val_acc']:.3f}"
        )
    elif trainer.is_global_zero and "train_loss" in result:
        val = f", val_loss {result['val_loss']:.3f}" if "val_loss" in result else ""
        print(
            f"demo finished: train_loss {result['train_loss']:.3f}{val} (nats/token; a uniform guess scores "
            f"5.545, the generating chain's entropy is 1.386)"
        )
    return 0


def register(subparsers: Any) -> None:
    from lightning_accel.demo.run import add_demo_arguments

    parser = subparsers.add_parser(
        "demo",
        help="train a small GPT on generated data with the measuring callbacks on",
        description="Train a small GPT-style model on synthetic tokens it generates itself (nothing is downloaded), "
        "with MFUMonitor on; ends with the throughput/MFU summary. About a minute on a laptop CPU.",
    )
    add_demo_arguments(parser)
    parser.set_defaults(func=_run)
