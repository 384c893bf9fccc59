"""TorchCompile by region against whole-model compile and eager: the cold start (the first training step beyond a
steady one: compilation) and the steady step time of the demo GPT with many layers.

Each run is its own process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh directory), so every
compile is cold. Variants alternate (eager, whole, regions, then the reverse) over ``--rounds``; a run times one
first step and then the median of ``--steps`` steps (AdamW, cross-entropy on the logits).

Run: ``flock /tmp/la-bench.lock python benchmarks/bench_compile_regions.py [--layers 12 --d-model 256]``;
on a GPU: ``python benchmarks/bench_compile_regions.py --device cuda --dtype bfloat16 --layers 24 --d-model 1024``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager", "whole", "regions")


def child(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_accel.callbacks.torch_compile import TorchCompile
    from lightning_accel.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    cfg = GPTConfig(vocab_size=spec["vocab"], seq_len=spec["seq"], n_layer=spec["layers"], n_head=spec["heads"],
                    d_model=spec["d_model"])  # fmt: skip
    holder = nn.Module()  # TorchCompile's targets are the children of the module it is given
    holder.model = GPT(cfg).to(device)
    callback = None
    if spec["variant"] != "eager":
        callback = TorchCompile(regions=spec["variant"] == "regions", backend=spec.get("backend", "inductor"))
        callback.setup(None, holder, "fit")  # type: ignore[arg-type]
    opt = torch.optim.AdamW(holder.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"] + 1), generator=g).to(device)

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = holder.model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = step()
    step()  # a second call may still compile (the backward's graph of a recompiled shape)
    steady = statistics.median(step() for _ in range(spec["steps"]))
    if callback is not None and callback.fallback_reason:
        raise SystemExit(f"{spec['variant']}: {callback.fallback_reason}")
    return {**spec, "first": first, "steady": steady, "cold": first - steady,
            "compiled": len(callback.compiled_names) if callback else 0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    rows = []
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            spec = dict(variant=variant, layers=args.layers, d_model=args.d_model, heads=args.heads, seq=args.seq,
                        batch=args.batch, vocab=args.vocab, steps=args.steps, device=args.device,
                        dtype=args.dtype)  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="la-inductor-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                     text=True, check=True, env=env)  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  {variant}: first step {row['first']:.1f} s, steady {row['steady'] * 1e3:.0f} ms", flush=True)
    print(f"\nDemo GPT, {args.layers} layers, d_model {args.d_model}, seq {args.seq}, batch {args.batch}, "
          f"{args.dtype} on {args.device}; {args.rounds} runs each, alternating; cold inductor cache per run\n")  # fmt: skip
    print("| variant | modules compiled | cold start (first step − steady), s | steady step, ms | steady vs eager |")
    print("|---|---|---|---|---|")
    eager = statistics.median(r["steady"] for r in rows if r["variant"] == "eager")
    for variant in VARIANTS:
        rs = [r for r in rows if r["variant"] == variant]
        cold = ", ".join(f"{r['cold']:.1f}" for r in rs)
        steady = ", ".join(f"{r['steady'] * 1e3:.0f}" for r in rs)
        ratio = eager / statistics.median(r["steady"] for r in rs)
        print(f"| {variant} | {rs[0]['compiled']} | {cold} | {steady} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
