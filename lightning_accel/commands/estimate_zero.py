"""``lightning-accel estimate-zero``: model-state memory per device for every ZeRO stage and offload."""

from __future__ import annotations

import argparse
from typing import Any

ORDER = 30


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _gb(value: float) -> str:
    return "-" if value == 0 else f"{value / 1e9:.2f}"


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lightning_accel.core.memory import zero_memory_table

    if args.params != int(args.params):
        raise ValueError(f"--params must be a whole number of parameters, got {args.params}")
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    rows = zero_memory_table(
        int(args.params),
        args.devices,
        optimizer_bytes_per_param=args.optimizer_bytes,
        param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes,
        activation_bytes_per_sample=args.activation_bytes,
        micro_batch_size=args.micro_batch,
    )
    act = f", activations {args.activation_bytes:g} B/sample x {args.micro_batch}" if args.micro_batch else ""
    table = Table(
        title=f"Model-state memory per device: {int(args.params):,} parameters, {args.devices} data-parallel "
        f"devices, {args.param_bytes:g}+{args.grad_bytes:g}+{args.optimizer_bytes:g} bytes/param "
        f"(params+grads+optimizer, K={args.optimizer_bytes:g}){act}"
    )
    table.add_column("configuration")
    table.add_column("strategy string")
    table.add_column("device GB", justify="right")
    table.add_column("host GB / rank", justify="right")
    table.add_column("NVMe GB / rank", justify="right")
    strings = {
        (1, None, None): "deepspeed_zero1",
        (2, None, None): "deepspeed_zero2",
        (2, "cpu", None): "deepspeed_zero2_offload",
        (3, None, None): "deepspeed_zero3",
        (3, "cpu", "cpu"): "deepspeed_zero3_offload",
        (3, "nvme", "nvme"): "deepspeed_zero3_offload_nvme",
        (0, None, None): "ddp",
    }
    for est in rows:
        key = (est.stage, est.offload_optimizer, est.offload_params)
        table.add_row(
            est.label,
            strings.get(key, "deepspeed_zero3 + overrides"),
            f"{est.device_total / 1e9:.2f}",
            _gb(est.host_total),
            _gb(est.nvme_total),
        )
    console = Console(width=args.width)
    console.print(table)
    console.print(
        "GB = 1e9 bytes. Model states only (ZeRO paper Fig. 1 formulas; offload per ZeRO-Offload): add "
        "activations (--activation-bytes, --micro-batch), buffers and fragmentation; deepspeed_auto keeps "
        "20 % free for them."
    )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "estimate-zero",
        help="memory per device for ZeRO stages 0-3 and offloads",
        description="Per-device (and host/NVMe) bytes of model states for data parallel and ZeRO stages 1-3 with "
        "CPU/NVMe offload, from the ZeRO paper's formulas (mixed-precision Adam: K = 12 by default).",
    )
    parser.add_argument("--params", type=_positive_float, required=True, help="trainable parameters, e.g. 7.5e9")
    parser.add_argument("--devices", type=int, required=True, help="data-parallel devices, e.g. 64")
    parser.add_argument(
        "--optimizer-bytes",
        type=float,
        default=12.0,
        help="K: optimizer-state bytes per parameter (12 = mixed-precision Adam; default %(default)s)",
    )
    parser.add_argument("--param-bytes", type=float, default=2.0, help="bytes per parameter (2 = fp16/bf16)")
    parser.add_argument("--grad-bytes", type=float, default=2.0, help="bytes per gradient element (2 = fp16/bf16)")
    parser.add_argument("--activation-bytes", type=float, default=0.0, help="activation bytes per sample (optional)")
    parser.add_argument("--micro-batch", type=int, default=0, help="samples per device for the activation term")
    parser.add_argument("--width", type=int, default=120, help="table width in characters (default %(default)s)")
    parser.set_defaults(func=_run)
