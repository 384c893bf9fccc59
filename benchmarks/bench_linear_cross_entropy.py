"""linear_cross_entropy against the plain head + F.cross_entropy: peak memory and step time of one forward +
backward of the output head and its loss, at vocabularies of 32k and 128k.

Each measurement runs in its own process (the CPU's peak is the process's peak resident set, reset before the
step: :class:`~lightning_accel.core.memory_probe.PeakMemoryMeter`; on CUDA the allocator's peak), so one variant's
freed memory cannot hide the other's. Variants alternate A B, B A over ``--rounds``; each run times ``--iters``
forward + backward passes after one warm-up and reports their median. The peak is reported above the memory held
before the step (the inputs, the head and its gradient are the same in both).

Run: ``flock /tmp/la-bench.lock python benchmarks/bench_linear_cross_entropy.py [--tokens 2048 --hidden 256]``;
on a GPU: ``python benchmarks/bench_linear_cross_entropy.py --device cuda --dtype bfloat16 --tokens 16384``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from lightning_accel.core.memory_probe import PeakMemoryMeter
    from lightning_accel.losses import linear_cross_entropy

    torch.manual_seed(0)
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    hidden = torch.randn(spec["tokens"], spec["hidden"], device=device, requires_grad=True)
    weight = (0.02 * torch.randn(spec["vocab"], spec["hidden"], device=device)).requires_grad_()
    target = torch.randint(0, spec["vocab"], (spec["tokens"],), device=device)

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if spec["variant"] == "fused":
                loss = linear_cross_entropy(hidden, weight, target, backend=spec["backend"])
            else:
                loss = F.cross_entropy(hidden @ weight.T, target)
        loss.backward()
        return float(loss)

    step()  # the warm-up: the gradients' memory is held from here on, in both variants
    meter = PeakMemoryMeter(device)
    before = meter.current_bytes()
    meter.reset()
    times, loss = [], 0.0
    for _ in range(spec["iters"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {**spec, "seconds": statistics.median(times), "peak_mib": (meter.peak_bytes() - before) / 2**20,
            "loss": loss, "exact_peak": meter.exact}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    rows = []
    for vocab in args.vocab:
        for r in range(args.rounds):
            order = ("plain", "fused") if r % 2 == 0 else ("fused", "plain")
            for variant in order:
                spec = dict(variant=variant, vocab=vocab, tokens=args.tokens, hidden=args.hidden, iters=args.iters,
                            device=args.device, dtype=args.dtype, backend=args.backend)  # fmt: skip
                out = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=True
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"  {vocab} {variant}: {row['seconds'] * 1e3:.0f} ms, +{row['peak_mib']:.0f} MiB", flush=True)
    print(f"\n{args.tokens} tokens x hidden {args.hidden}, {args.dtype} on {args.device}; median of {args.iters} "
          f"forward + backward per run, {args.rounds} runs each (A B, B A)\n")  # fmt: skip
    print(
        "| vocabulary | logits (fp32) | plain: peak above the inputs, ms | fused: peak, ms | peak ratio | time ratio |"
    )
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        p = [r for r in rows if r["vocab"] == vocab and r["variant"] == "plain"]
        f = [r for r in rows if r["vocab"] == vocab and r["variant"] == "fused"]
        logits = args.tokens * vocab * 4 / 2**20

        def cell(rs: list[dict]) -> str:
            return ", ".join(f"{r['peak_mib']:.0f} MiB / {r['seconds'] * 1e3:.0f}" for r in rs)

        peak = statistics.median(r["peak_mib"] for r in f) / statistics.median(r["peak_mib"] for r in p)
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(f, p)]
        print(f"| {vocab:,} | {logits:.0f} MiB | {cell(p)} | {cell(f)} | {peak:.2f} | "
              f"{min(ratios):.2f}–{max(ratios):.2f} |")  # fmt: skip
        gap = abs(f[0]["loss"] - p[0]["loss"]) / abs(p[0]["loss"])
        print(f"<!-- vocab {vocab}: relative loss difference {gap:.1e} -->")


if __name__ == "__main__":
    main()
