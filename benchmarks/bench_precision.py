"""Precision and compute plugins on the demo GPT: step time and activation memory, measured side by side.

Part 1 — step time (forward + backward + AdamW step) of the same model and batch in four variants, alternating
A B C D A B C D ... and taking the median step time of each:

* fp32 eager;
* ``AutoMixedPrecision(dtype="auto")`` — what the plugin chose on this machine, and why;
* ``AutoMixedPrecision(dtype="auto")`` + ``TorchCompile`` (inductor by default; compilation is timed separately
  and left out of the step times);
* ``AutoMixedPrecision(dtype="bf16")`` forced, to show what "auto" avoided (or took).

Part 2 — activation memory with and without ``ActivationCheckpointing`` (every transformer block wrapped): the peak
resident memory of one forward + backward, measured exactly on Linux by resetting the peak (``5`` into
``/proc/self/clear_refs``), running the step and reading ``VmHWM`` from ``/proc/self/status``. It runs in a child
interpreter with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed activations return to the OS and each step's peak is its
own (that setting slows allocation, so part 1 runs without it). Linux-only. Also printed: the callback's own
estimate of the memory saved and the FLOPs added (``FlopCounterMode``), and the measured step-time cost.

    python benchmarks/bench_precision.py                  # both parts, ~1-2 min on a 2-core CPU
    python benchmarks/bench_precision.py --backend aot_eager --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_accel.callbacks.torch_compile import TorchCompile
from lightning_accel.core.checkpointing import apply_activation_checkpointing, saved_activation_bytes
from lightning_accel.core.flops import count_flops
from lightning_accel.core.memory_probe import peak_rss_bytes, reset_peak_rss
from lightning_accel.demo.model import Block, GPTConfig
from lightning_accel.demo.task import GPTTask
from lightning_accel.precision import AutoMixedPrecision


def batch(cfg: GPTConfig, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_step(task: GPTTask, plugin: AutoMixedPrecision | None) -> Callable[[Any], None]:
    opt = task.configure_optimizers()
    scaler = plugin.scaler if plugin is not None else None

    def step(b: Any) -> None:
        if plugin is not None:
            with plugin.forward_context():
                loss = task._loss(b)
        else:
            loss = task._loss(b)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def part_speed(args: argparse.Namespace) -> None:
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len)
    b = batch(cfg, args.batch_size)

    def task() -> GPTTask:
        torch.manual_seed(0)
        return GPTTask(cfg)

    variants: dict[str, Callable[[Any], None]] = {"fp32 eager": make_step(task(), None)}
    auto = AutoMixedPrecision(dtype="auto")
    t_auto = task()
    auto.convert_module(t_auto)
    variants[f"AutoMixedPrecision(auto) -> {auto.precision}"] = make_step(t_auto, auto)
    auto_c = AutoMixedPrecision(dtype="auto")
    t_comp = task()
    auto_c.convert_module(t_comp)
    compiler = TorchCompile(backend=args.backend)
    compiler.setup(None, t_comp, "fit")  # type: ignore[arg-type]  # setup only reads the module
    comp_step = make_step(t_comp, auto_c)
    start = time.perf_counter()
    comp_step(b)  # compiles forward and backward
    compile_s = time.perf_counter() - start
    variants[f"AutoMixedPrecision(auto) + TorchCompile({args.backend})"] = comp_step
    bf16 = AutoMixedPrecision(dtype="bf16")
    t_bf16 = task()
    bf16.convert_module(t_bf16)
    variants["AutoMixedPrecision(bf16) forced"] = make_step(t_bf16, bf16)

    for step in variants.values():  # warm-up: allocator, kernels, a possible recompile
        for _ in range(2):
            step(b)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            step = variants[name]
            step(b)  # untimed: the first step after switching pays for the other variant's memory churn
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(b)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["fp32 eager"])
    print(
        f"\nPart 1: step time, demo GPT ({args.n_layer} layers, d{args.d_model}, seq {args.seq_len}, batch "
        f"{args.batch_size}), {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps "
        "alternating (order rotated each round, one untimed step after each switch), median"
    )
    print(f"AutoMixedPrecision(auto) chose {auto.compute_dtype}: {auto.reason}")
    print(f"TorchCompile first step (compilation + 1 step): {compile_s:.1f} s; fallback: {compiler.fallback_reason}")
    print("\n| variant | median step (ms) | speed vs fp32 |\n|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1e3:.1f} | {base / med:.2f}x |")


MEMORY_CHILD = "--memory-child"


def part_memory(args: argparse.Namespace) -> None:
    if not sys.platform.startswith("linux"):
        print("\nPart 2 skipped: peak RSS via /proc/self/clear_refs and VmHWM is Linux-only")
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, MEMORY_CHILD, *[a for a in sys.argv[1:] if a != MEMORY_CHILD]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    mb = 1e6
    print(
        f"\nPart 2: activation memory of one forward + backward, demo GPT ({args.n_layer} layers, "
        f"d{args.d_model}, seq {args.seq_len}, batch {args.mem_batch_size}), fp32, peak RSS above the "
        f"pre-step RSS (VmHWM after a reset), {args.rounds} alternating rounds, median"
    )
    print(
        "(peak memory is exact; step times here come from few steps and are only indicative — part 1 times "
        "steps properly)"
    )
    print("\n| variant | peak activation memory (MB) | step time (ms) |\n|---|---|---|")
    print(f"| plain | {r['plain_mb']:.1f} | {r['plain_ms']:.1f} |")
    print(f"| ActivationCheckpointing(modules=[Block]) | {r['ckpt_mb']:.1f} | {r['ckpt_ms']:.1f} |")
    saved = r["plain_mb"] - r["ckpt_mb"]
    print(
        f"\nmeasured saving {saved:.1f} MB ({saved / r['plain_mb']:.0%}); callback's estimate "
        f"{r['estimate_bytes'] / mb:.1f} MB. Compute added: {r['flops_added']:.1%} in FLOPs (FlopCounterMode), "
        f"{r['ckpt_ms'] / r['plain_ms'] - 1:.1%} in measured step time."
    )


def memory_child(args: argparse.Namespace) -> None:
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len)
    b = batch(cfg, args.mem_batch_size)
    torch.manual_seed(0)
    plain = GPTTask(cfg)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, [Block])

    # the callback's estimate: each block's saved activations, on its real input
    inputs: list[Any] = []
    hooks = [blk.register_forward_pre_hook(lambda m, a: inputs.append((m, a))) for blk in plain.model.blocks]
    with torch.no_grad():
        plain._loss(b)
    for h in hooks:
        h.remove()
    per_block = [saved_activation_bytes(m, a, {}) for m, a in inputs]
    estimate = sum(per_block) - max(per_block)  # what ActivationCheckpointing reports
    flops_plain = count_flops(plain, b, forward_fn=lambda m, x: m._loss(x))
    flops_ckpt = count_flops(ckpt, b, forward_fn=lambda m, x: m._loss(x))

    def step(task: GPTTask) -> tuple[int, float]:
        task.zero_grad(set_to_none=False)  # grads exist already: their memory is not activation memory
        reset_peak_rss()
        base = peak_rss_bytes()
        t0 = time.perf_counter()
        task._loss(b).backward()
        return peak_rss_bytes() - base, time.perf_counter() - t0

    for task in (plain, ckpt):
        step(task)
    res: dict[str, list[Any]] = {"plain": [], "ckpt": []}
    for r in range(args.rounds):
        for name, task in (("plain", plain), ("ckpt", ckpt)) if r % 2 == 0 else (("ckpt", ckpt), ("plain", plain)):
            step(task)  # untimed warm-in after switching
            res[name].append(step(task))
    out = {f"{k}_mb": statistics.median(m for m, _ in v) / 1e6 for k, v in res.items()}
    out.update({f"{k}_ms": statistics.median(t for _, t in v) * 1e3 for k, v in res.items()})
    out.update(estimate_bytes=estimate, flops_added=flops_ckpt / flops_plain - 1)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--batch-size", type=int, default=16, help="batch for the step-time part (default 16)")
    parser.add_argument("--mem-batch-size", type=int, default=32, help="batch for the memory part (default 32)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(MEMORY_CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    if not args.skip_speed:
        part_speed(args)
    if not args.skip_memory:
        part_memory(args)


if __name__ == "__main__":
    main()
