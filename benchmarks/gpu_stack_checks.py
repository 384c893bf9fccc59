"""The GPU check's measurements of the stack past bf16 (imported by ``gpu_check.py``; each takes its ``args`` and
returns table rows; ``args.smoke`` runs it at tiny sizes on the CPU):

- a GPT of ~350 M parameters (24 layers, d 1024, sequence 2048) with bf16, compile, SDPA, fused AdamW and the fused
  cross-entropy: MFU against the datasheet peak (goal >= 45 % on an H100);
- FP8 (``Float8Training``) against bf16, both compiled, on a model where it should pay (d 2048): tokens/s and the
  loss over 200 steps;
- the fused cross-entropy's peak memory and time against the plain head on the GPU (128k vocabulary);
- ``TorchCompile(regions=True)`` against whole-model compile: cold start and steady step;
- TF32 paired with and without a warm-up of each side, to explain a paired 0.72x measured once without one.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
Row = tuple[str, str, str]


def _trainer(args: argparse.Namespace, steps: int, callbacks: list, plugins: list | None = None) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu" if args.smoke else "gpu", devices=1, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        plugins=plugins or [], callbacks=callbacks,
    )  # fmt: skip


def _data(cfg: Any, batch: int, steps: int) -> Any:
    from lightning_accel.demo.task import DemoDataModule

    return DemoDataModule(
        seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, batch_size=batch,
        train_tokens=(steps + 2) * batch * (cfg.seq_len + 1), val_tokens=4 * (cfg.seq_len + 1),
        data_dir=Path(tempfile.mkdtemp()) / "tokens",
    )  # fmt: skip


def _fused_task(cfg: Any, fused_optimizer: bool) -> Any:
    """The demo GPT whose loss is the fused linear + cross-entropy on its last hidden states (no logits)."""
    import torch

    import lightning_accel as la
    from lightning_accel.demo.task import GPTTask

    class FusedGPTTask(GPTTask):
        def __init__(self) -> None:
            super().__init__(cfg)
            self.losses: list[float] = []

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            m = self.model
            h = m.tok_emb(x) + m.pos_emb(torch.arange(x.shape[1], device=x.device))
            for block in m.blocks:
                h = block(h)
            loss = la.linear_cross_entropy(m.ln_f(h), m.head.weight, y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=fused_optimizer)

    return FusedGPTTask()


def check_gpt_350m(args: argparse.Namespace) -> list[Row]:
    import lightning_accel as la
    from lightning_accel.demo.model import GPTConfig

    gpu = not args.smoke
    cfg = (
        GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, d_model=1024)
        if gpu
        else GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=2)
    )
    batch, steps = (8, 60) if gpu else (2, 8)
    task = _fused_task(cfg, fused_optimizer=gpu)
    monitor = la.MFUMonitor(window=10 if gpu else 2, print_summary=False)
    compile_ = la.TorchCompile(regions=True, backend="inductor" if gpu else "aot_eager")
    trainer = _trainer(args, steps, [compile_, monitor], [la.AutoMixedPrecision(dtype="bf16" if gpu else "fp32")])
    trainer.fit(task, datamodule=_data(cfg, batch, steps))
    s = monitor.summary
    mfu = "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.1f} %"
    return [
        (
            "GPT-350M MFU (bf16, compile, SDPA, fused AdamW, fused CE)",
            mfu,
            f"{task.model.num_params() / 1e6:.0f} M params, seq {cfg.seq_len}, batch {batch}; "
            f"{s.get('tokens_per_sec') or 0:,.0f} tokens/s; peak {s.get('peak_source')}; goal >= 45 % on an H100",
        )
    ]


def check_float8(args: argparse.Namespace) -> list[Row]:
    import torch

    import lightning_accel as la
    from lightning_accel.demo.model import GPTConfig

    gpu = not args.smoke
    try:
        import torchao.float8  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a torchao built for another torch fails in other ways than ImportError
        return [("FP8 vs bf16", "skipped", f"needs torchao (pip install 'lightning-accel[torchao]'): {err!r}"[:200])]
    if gpu and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        return [("FP8 vs bf16", "skipped", f"{name}: compute capability below 8.9 (no FP8 matmuls)")]
    cfg = (
        GPTConfig(vocab_size=32768, seq_len=2048, n_layer=4, n_head=16, d_model=2048)
        if gpu
        else GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=2)
    )
    batch, steps = (4, 200) if gpu else (2, 8)
    results = {}
    for variant in ("bf16", "fp8"):
        torch.manual_seed(0)
        task = _fused_task(cfg, fused_optimizer=gpu)
        monitor = la.MFUMonitor(window=10 if gpu else 2, print_summary=False)
        callbacks: list = (
            [la.Float8Training(emulate=not gpu, min_size="auto" if gpu else 0)] if variant == "fp8" else []
        )
        callbacks += [la.TorchCompile(regions=True, backend="inductor" if gpu else "aot_eager"), monitor]
        trainer = _trainer(args, steps, callbacks, [la.AutoMixedPrecision(dtype="bf16" if gpu else "fp32")])
        trainer.fit(task, datamodule=_data(cfg, batch, steps))
        tail = task.losses[-max(2, steps // 10) :]
        converted = len(callbacks[0].converted) if variant == "fp8" else 0
        results[variant] = (monitor.summary, statistics.mean(tail), converted)
    (b, b_loss, _), (f, f_loss, n) = results["bf16"], results["fp8"]
    speed = (f.get("tokens_per_sec") or 0) / max(b.get("tokens_per_sec") or 1e-9, 1e-9)
    gap = abs(f_loss - b_loss) / b_loss
    mfu = f.get("mfu_bf16_peak")
    return [
        ("FP8 vs bf16 tokens/s (both compiled)", f"{speed:.2f}x",
         f"{n} layers in FP8; d {cfg.d_model}, seq {cfg.seq_len}, batch {batch}, {steps} steps; "
         f"MFU {100 * (f.get('mfu') or 0):.1f} % of the {f.get('dtype')} peak, "
         f"{'n/a' if mfu is None else f'{100 * mfu:.1f} %'} of bf16's"),
        ("FP8 vs bf16 loss (mean of the last tenth)", f"{100 * gap:.2f} % apart",
         f"bf16 {b_loss:.4f}, fp8 {f_loss:.4f}; goal within 1 %"),
    ]  # fmt: skip


def _child(script: str, spec: dict, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--child", json.dumps(spec)],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_fused_ce_memory(args: argparse.Namespace) -> list[Row]:
    gpu = not args.smoke
    spec = dict(vocab=128256 if gpu else 4096, tokens=16384 if gpu else 256, hidden=2048 if gpu else 64,
                iters=3 if gpu else 1, device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                backend="auto")  # fmt: skip
    plain = _child("bench_linear_cross_entropy.py", {**spec, "variant": "plain"})
    fused = _child("bench_linear_cross_entropy.py", {**spec, "variant": "fused"})
    return [
        ("fused CE peak memory", f"{plain['peak_mib']:,.0f} -> {fused['peak_mib']:,.0f} MiB",
         f"{spec['tokens']} tokens x hidden {spec['hidden']}, vocab {spec['vocab']:,}, {spec['dtype']}; "
         f"time {1e3 * plain['seconds']:.1f} -> {1e3 * fused['seconds']:.1f} ms (Liger where installed)"),
    ]  # fmt: skip


def check_compile_regions(args: argparse.Namespace) -> list[Row]:
    gpu = not args.smoke
    spec = dict(layers=24 if gpu else 2, d_model=1024 if gpu else 32, heads=16 if gpu else 2, seq=1024 if gpu else 16,
                batch=8 if gpu else 2, vocab=50304 if gpu else 64, steps=10 if gpu else 2,
                device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                backend="inductor" if gpu else "aot_eager")  # fmt: skip
    rows = {}
    for variant in ("whole", "regions"):
        with tempfile.TemporaryDirectory(prefix="la-inductor-") as cache:
            rows[variant] = _child("bench_compile_regions.py", {**spec, "variant": variant},
                                   env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})  # fmt: skip
    w, r = rows["whole"], rows["regions"]
    return [
        ("compile cold start: whole vs regions", f"{w['cold']:.1f} s vs {r['cold']:.1f} s",
         f"{spec['layers']} layers, d {spec['d_model']}, seq {spec['seq']}; steady {1e3 * w['steady']:.1f} vs "
         f"{1e3 * r['steady']:.1f} ms/step"),
    ]  # fmt: skip


def check_tf32_warmup(args: argparse.Namespace) -> list[Row]:
    """An fp32 eager MLP stepped with TF32 off and on, in pairs: once each side's first steps are counted (no
    warm-up: the first TF32 matmuls pick their cuBLAS kernels), once after a warm-up of each side."""
    import torch
    from torch import nn

    gpu = not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    width, batch, steps = (4096, 64, 20) if gpu else (64, 8, 2)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4))).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch * 8, width, device=device)

    def window(tf32: bool, n: int) -> float:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        cold = [window(False, steps) / window(True, steps) for _ in range(1)]  # each side's first steps included
        window(False, steps), window(True, steps)  # the warm-up of both sides
        warm = sorted(window(False, steps) / window(True, steps) for _ in range(3))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return [
        ("TF32 speed-up, first pair (no warm-up)", f"{cold[0]:.2f}x", f"fp32 eager MLP {width} wide x 4, batch {8 * batch}"),
        ("TF32 speed-up after a warm-up (3 pairs)", f"{warm[1]:.2f}x (range {warm[0]:.2f}-{warm[-1]:.2f})",
         "fp32 time / TF32 time: below 1 only if TF32 is slower once warm"),
    ]  # fmt: skip


STACK_CHECKS = [
    ("gpt 350m", check_gpt_350m),
    ("float8", check_float8),
    ("fused ce memory", check_fused_ce_memory),
    ("compile regions", check_compile_regions),
    ("tf32 warm-up", check_tf32_warmup),
]
