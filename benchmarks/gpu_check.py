"""The GPU check: one script to run on a CUDA machine (under 8 minutes on an H100/H200), printing one table.

    python benchmarks/gpu_check.py                # on a GPU machine
    python benchmarks/gpu_check.py --smoke        # tiny sizes on the CPU: checks the script itself (the tests do)

Checks:
1. the test suite's GPU-marked tests (``pytest -m gpu``);
2. MFU of a GPT-2-small-sized model (124 M parameters, seq 1024) trained with bf16 (``AutoMixedPrecision``),
   ``TorchCompile`` and SDPA attention, against the datasheet peak of the GPU (``MFUMonitor``); which SDPA kernel ran;
3. DALI: ``DALIImageDataModule`` images/s with ``decode_device="mixed"`` (nvJPEG) and ``"cpu"`` (both delivering on
   the GPU) vs a PIL DataLoader with as many workers, if DALI is installed (issue 7's GPU target: >= 3x);
4. the doctor's stage timer: CUDA-event timings of a forward pass vs a synchronised ``perf_counter`` reference;
5. the Autopilot on CUDA: the demo GPT on Lightning's default ``32-true`` precision, ``num_workers=0``, a
   micro-batch of 8 × accumulation 4: what it kept (expected: bf16 through the ``AutoMixedPrecision`` it installs
   itself, or TF32 if bf16 does not pay; workers or prefetch; a larger micro-batch), the precision plugin it
   trained with, its speed-up over the baseline and its search seconds;
6. NVTX: a short fit with ``BottleneckDoctor(nvtx=True)`` and ``NsysCapture(start_step=5, stop_step=10)``, under
   ``nsys profile --capture-range=cudaProfilerApi -t cuda,nvtx`` when nsys is on the PATH: which of the doctor's
   stages appear as ranges of the ``lightning_accel`` domain in ``nsys stats --report nvtx_sum``;
7. the doctor's compute attribution on CUDA: a 4-layer model with hand-written attention (sequence 1024) in fp32
   and in bf16-mixed, ``BottleneckDoctor(attribute_compute=True)``: the modules by device time, the compute
   findings (expected: ``eager_attention`` naming ``blocks.*.attn`` in both; ``fp32_matmul`` in fp32 only, on a GPU
   of compute capability >= 7), and the attributed device time against the same steps' forward + backward timed
   with CUDA events (at most 1x: the device idles while the host launches; near 1x where the GPU is the bound);
8. channels_last on a bf16 CNN: the finding and the paired speed-up;
9.-13. the stack past bf16 (``gpu_stack_checks.py``): a ~350 M GPT's MFU with bf16, compile, SDPA, fused AdamW and
   the fused cross-entropy; FP8 against bf16 (tokens/s, loss over 200 steps); the fused cross-entropy's peak
   memory; compile by region against whole-model compile; TF32 paired with and without a warm-up.

``--skip`` names checks to leave out (e.g. ``--skip dali nvtx`` where those are not installed). torchao and
liger-kernel, where the machine has no package index, install from wheels carried along
(``pip install --no-deps wheels/*.whl``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_stack_checks, also when loaded by path (the tests)

Row = tuple[str, str, str]


def check_gpu_tests(args: argparse.Namespace) -> list[Row]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(REPO / "tests")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.budget_s)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return [("GPU-marked tests", last, f"pytest exit {proc.returncode}")]


def check_gpt_mfu(args: argparse.Namespace) -> list[Row]:
    import lightning.pytorch as pl

    import lightning_accel as la
    from lightning_accel.attention import SDPABackendRecorder
    from lightning_accel.core.peak import get_peak_flops
    from lightning_accel.demo.model import GPTConfig
    from lightning_accel.demo.task import DemoDataModule, GPTTask

    gpu = not args.smoke
    cfg = (
        GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)
        if gpu
        else GPTConfig(seq_len=64, n_layer=2, d_model=64, n_head=2)
    )
    batch, steps = (16, 80) if gpu else (4, 12)
    task = GPTTask(cfg)
    data = DemoDataModule(
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        batch_size=batch,
        train_tokens=(steps + 2) * batch * (cfg.seq_len + 1),
        val_tokens=4 * (cfg.seq_len + 1),
        data_dir=Path(tempfile.mkdtemp()) / "tokens",
    )
    monitor = la.MFUMonitor(window=10, print_summary=False)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        plugins=[la.AutoMixedPrecision(dtype="bf16" if gpu else "fp32")],
        callbacks=[la.TorchCompile(backend="inductor" if gpu else "aot_eager"), monitor],
    )
    trainer.fit(task, datamodule=data)
    s = monitor.summary
    rows: list[Row] = [
        (
            "GPT MFU",
            "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.1f} %",
            f"{task.model.num_params() / 1e6:.0f} M params, seq {cfg.seq_len}, batch {batch}, "
            f"{s.get('dtype')}; {s.get('samples_per_sec', 0):,.1f} samples/s; peak: {s.get('peak_source')}",
        )
    ]
    if gpu:
        import torch

        name = torch.cuda.get_device_name()
        rows.append(("peak table", f"{(get_peak_flops(name, 'bf16') or 0) / 1e12:,.1f} TFLOP/s", f"{name}, bf16 dense"))
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device="cuda")
        model = task.model.cuda()
        with SDPABackendRecorder() as rec, torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
        rows.append(("SDPA kernel (eager)", str(rec.backend), str(rec.counts)))
    return rows


def check_dali(args: argparse.Namespace) -> list[Row]:
    """Issue 7's GPU figure: DALIImageDataModule (mixed and CPU decode, delivered on the GPU) vs a PIL DataLoader
    with as many workers as DALI has threads, side by side (``benchmarks/bench_dali.py``)."""
    import os

    import torch

    from lightning_accel._imports import is_available

    if not is_available("nvidia.dali"):
        return [("DALI vs PIL DataLoader", "skipped", "nvidia-dali-cuda120 not installed")]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_dali

    root = Path(tempfile.mkdtemp()) / "jpegs"
    images, size = (1024, (500, 375)) if not args.smoke else (64, (96, 72))
    bench_dali.make_jpegs(root, images, size)
    workers = min(8, os.cpu_count() or 1) if not args.smoke else 1
    device = torch.device("cuda", 0) if not args.smoke else torch.device("cpu")
    rates = bench_dali.compare(
        root,
        batch_size=64 if not args.smoke else 16,
        workers=workers,
        rounds=3 if not args.smoke else 1,
        device=device,
        reader=not args.smoke,
    )
    rows: list[Row] = []
    for name, epoch, epoch_ratio, steady, steady_ratio in bench_dali.summarise(rates):
        rows.append(
            (
                f"data: {name}",
                f"{steady_ratio:.2f}x",
                f"{steady:,.0f} images/s after the first batch ({epoch:,.0f} whole epoch, {epoch_ratio:.2f}x); "
                f"{workers} threads/workers, {images} JPEGs {size[0]}x{size[1]} on {device}",
            )
        )
    return rows


def check_stage_timer(args: argparse.Namespace) -> list[Row]:
    import torch

    from lightning_accel.core.timing import StageTimer

    device = torch.device("cuda" if not args.smoke else "cpu")
    width = 4096 if not args.smoke else 256
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
    x = torch.randn(64, width, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        sync()
        timer = StageTimer(device)
        for _ in range(20):
            timer.start("forward")
            model(x)
            timer.stop("forward")
        events_total = timer.flush()["forward"]
        ref = []
        for _ in range(20):
            sync()
            t = time.perf_counter()
            model(x)
            sync()
            ref.append(time.perf_counter() - t)
    per_step = events_total / 20
    ref_mean = statistics.fmean(ref)
    return [
        (
            "stage timer vs sync reference",
            f"{per_step / ref_mean:.3f}x",
            f"events {1e3 * per_step:.3f} ms/step, synchronised {1e3 * ref_mean:.3f} ms/step ({device.type})",
        )
    ]


def check_autopilot(args: argparse.Namespace) -> list[Row]:
    import lightning.pytorch as pl

    import lightning_accel as la
    from lightning_accel.demo.model import GPTConfig
    from lightning_accel.demo.task import DemoDataModule, GPTTask

    gpu = not args.smoke
    cfg = (
        GPTConfig(seq_len=256, n_layer=4, d_model=256, n_head=4)
        if gpu
        else GPTConfig(seq_len=32, n_layer=1, d_model=32, n_head=2)
    )
    steps = 400 if gpu else 20
    data = DemoDataModule(
        seq_len=cfg.seq_len,
        batch_size=8,
        train_tokens=(steps * 4 + 8) * 8 * (cfg.seq_len + 1),
        val_tokens=4 * (cfg.seq_len + 1),
        data_dir=Path(tempfile.mkdtemp()) / "tokens",
    )
    autopilot = la.Autopilot(
        budget_seconds=90 if gpu else 15,
        warmup_steps=5 if gpu else 2,
        measure_steps=20 if gpu else 4,
        save_plan=False,
        print_summary=False,
    )
    monitor = la.MFUMonitor(window=10, print_summary=False)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[autopilot, monitor],
    )
    trainer.fit(GPTTask(cfg), datamodule=data)
    plan = autopilot.plan
    speedup = plan.speedup if plan.speedup is not None and plan.kept else 1.0
    kept = "; ".join(k["change"] for k in plan.kept) or "nothing"
    rejected = "; ".join(
        f"{r.name}: {r.reason[:60]}" for r in autopilot.records[1:] if not r.kept and r.samples_per_sec is not None
    )
    plugin = trainer.precision_plugin
    precision = f"{type(plugin).__name__} {getattr(plugin, 'precision', '?')}"
    import torch

    return [
        (
            "autopilot",
            f"{speedup:.2f}x the untouched configuration ({plan.speedup_source or 'nothing kept'})",
            f"kept: {kept}; search {plan.search_seconds:.0f} s; stopped: {plan.stopped}",
        ),
        (
            "autopilot precision",
            precision,
            f"from Lightning's default 32-true; float32 matmul precision {torch.get_float32_matmul_precision()!r}",
        ),
        (
            "autopilot training",
            f"{monitor.summary.get('samples_per_sec') or 0:,.0f} samples/s",
            f"after the search; rejected: {rejected or 'none'}",
        ),
    ]


NVTX_CHILD = r"""
import sys
import torch
import lightning.pytorch as pl
import lightning_accel as la

class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

gpu = sys.argv[1] == "gpu"
data = torch.utils.data.TensorDataset(torch.randn(640, 512))
trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1, max_steps=20, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[la.BottleneckDoctor(nvtx=True, window=5, warmup_batches=1, report_path=False,
                                                    print_report=False, warn=False),
                                la.NsysCapture(start_step=5, stop_step=10)])
trainer.fit(Task(), torch.utils.data.DataLoader(data, batch_size=32))
print("captured", trainer.callbacks[1].captured if gpu else "cpu")
"""


def check_nvtx(args: argparse.Namespace) -> list[Row]:
    import shutil

    gpu = not args.smoke
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "nvtx_child.py"
        script.write_text(NVTX_CHILD)
        env_cmd = [sys.executable, str(script), "gpu" if gpu else "cpu"]
        nsys = shutil.which("nsys")
        if not (gpu and nsys):
            proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
            last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
            return [
                (
                    "nvtx stages in nsys",
                    "ran without nsys" if proc.returncode == 0 else "ERROR",
                    f"{last}; nsys {'not on PATH' if gpu else 'not used in --smoke'} (exit {proc.returncode})",
                )
            ]
        out = Path(tmp) / "timeline"
        proc = subprocess.run(
            [
                nsys,
                "profile",
                "--capture-range=cudaProfilerApi",
                "--capture-range-end=stop",
                "-t",
                "cuda,nvtx",
                "-o",
                str(out),
                "--force-overwrite=true",
                *env_cmd,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        report = ""
        for name in ("nvtx_sum", "nvtxsum"):  # the report's name before nsys 2023.4
            stats = subprocess.run(
                [nsys, "stats", "--report", name, "--format", "csv", f"{out}.nsys-rep"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if stats.returncode == 0 and "forward" in stats.stdout:
                report = stats.stdout
                break
        found = [s for s in ("data", "transfer", "forward", "backward", "optimizer") if s in report]
        return [
            (
                "nvtx stages in nsys",
                f"{len(found)}/5 stages",
                f"{', '.join(found) or 'none'}; profile exit "
                f"{proc.returncode}; lightning_accel domain {'seen' if 'lightning_accel' in report else 'not seen'}",
            )
        ]


def check_attribution(args: argparse.Namespace) -> list[Row]:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_accel as la

    gpu = not args.smoke
    d, heads, seq, batch = (512, 8, 1024, 8) if gpu else (32, 2, 128, 2)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
            att = ((q @ k.transpose(-1, -2)) / (c // heads) ** 0.5).softmax(-1)
            return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.attn = nn.LayerNorm(d), Attention()
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln(x))
            return x + self.mlp(x)

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[Block() for _ in range(4)])

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            (x,) = batch
            return F.mse_loss(self.blocks(x), x)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    rows: list[Row] = []
    for precision in ("32-true", "bf16-mixed"):
        doctor = la.BottleneckDoctor(
            window=5, warmup_batches=2, report_path=False, print_report=False, warn=False, attribute_compute=True
        )
        trainer = pl.Trainer(
            accelerator="gpu" if gpu else "cpu",
            devices=1,
            precision=precision,
            max_steps=16,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[doctor],
        )
        trainer.fit(Task(), DataLoader(TensorDataset(torch.randn(16 * batch, seq, d)), batch_size=batch))
        report = doctor.report
        attr = report.attribution
        if not attr:
            rows.append((f"attribution {precision}", "no window", "; ".join(report.notes)))
            continue
        top = ", ".join(f"{r['module']} {100 * r['share']:.0f} %" for r in attr["modules"][:4])
        found = [
            f"{f.rule} ({f.module}, saves {100 * (f.saving or 0):.1f} %)"
            for f in report.findings
            if f.kind == "compute"
        ]
        measured = sum(attr["measured_ms"].values())
        clock = "CUDA events" if attr["device"] == "cuda" else "host clock"
        notes = "; ".join(report.notes)
        rows.append(
            (
                f"attribution {precision}",
                "; ".join(found) or "no compute finding",
                f"{attr['device']}: {top}" + (f"; notes: {notes}" if notes else ""),
            )
        )
        rows.append(
            (
                f"attribution {precision} vs {clock}",
                f"{(attr['forward_ms'] + attr['backward_ms']) / measured:.3f}x" if measured else "—",
                f"attributed {attr['forward_ms'] + attr['backward_ms']:.2f} ms/step ({attr['device']} time), "
                f"forward + backward by {clock} {measured:.2f} ms/step; window cost "
                f"{attr['overhead'].get('extra_s') or 0:.2f} s",
            )
        )
    return rows


def check_channels_last(args: argparse.Namespace) -> list[Row]:
    """The doctor's nchw_convolution finding on a small CNN in bf16, and what channels_last measures against the
    rule's 1.2x prior (A B A B of 20-step loops, NCHW vs NHWC weights and inputs)."""
    import time

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_accel as la

    gpu = not args.smoke
    width, size, batch = (256, 56, 64) if gpu else (8, 16, 2)

    def convnet() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            *[m for _ in range(4) for m in (nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())],
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = convnet()

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    doctor = la.BottleneckDoctor(
        window=5, warmup_batches=2, report_path=False, print_report=False, warn=False, attribute_compute=True
    )
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=16,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[doctor],
    )
    data = TensorDataset(torch.randn(16 * batch, 3, size, size), torch.randint(0, 10, (16 * batch,)))
    trainer.fit(Task(), DataLoader(data, batch_size=batch))
    found = [
        f"{f.rule} ({f.module}, saves {100 * (f.saving or 0):.1f} %)"
        for f in doctor.report.findings
        if f.kind == "compute"
    ]
    attr = doctor.report.attribution or {}
    convs = [f"{o['name']} {100 * o['share']:.0f} %" for r in attr.get("leaves", [])[:1] for o in r["ops"][:2]]
    rows: list[Row] = [
        (
            "channels_last finding (bf16 CNN)",
            "; ".join(found) or "no compute finding",
            f"costliest module's ops: {', '.join(convs) or '-'}; notes: {'; '.join(doctor.report.notes) or 'none'}",
        )
    ]

    device = torch.device("cuda" if gpu else "cpu")
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def loop(model: nn.Module, inp: torch.Tensor) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for i in range(25):
            if i == 5:
                if gpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(inp), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20

    nchw, nhwc = convnet().to(device), convnet().to(device).to(memory_format=torch.channels_last)
    times: dict[str, list[float]] = {"nchw": [], "nhwc": []}
    for _ in range(3):
        times["nchw"].append(loop(nchw, x))
        times["nhwc"].append(loop(nhwc, x.contiguous(memory_format=torch.channels_last)))
    ratios = sorted(a / b for a, b in zip(times["nchw"], times["nhwc"]))
    rows.append(
        (
            "channels_last speed-up (bf16 CNN, A B x3)",
            f"{ratios[1]:.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f})",
            f"NCHW {1e3 * min(times['nchw']):.2f} ms/step, NHWC {1e3 * min(times['nhwc']):.2f} ms/step; the rule's prior: 1.2x on the convolutions",
        )
    )
    return rows


from gpu_stack_checks import STACK_CHECKS  # noqa: E402 - found through the path set above

CHECKS = [
    ("gpu tests", check_gpu_tests),
    ("gpt mfu", check_gpt_mfu),
    ("dali", check_dali),
    ("stage timer", check_stage_timer),
    ("autopilot", check_autopilot),
    ("nvtx", check_nvtx),
    ("channels last", check_channels_last),
    ("attribution", check_attribution),
    *STACK_CHECKS,
]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script itself)")
    parser.add_argument("--budget-s", type=int, default=240, help="time limit of the GPU-marked tests")
    parser.add_argument("--skip", nargs="*", default=[], help=f"checks to skip: {[n for n, _ in CHECKS]}")
    args = parser.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it on a GPU machine, or --smoke to check the script")
    rows: list[Row] = []
    for name, check in CHECKS:
        if name in args.skip or (args.smoke and name == "gpu tests"):
            continue
        start = time.perf_counter()
        try:
            rows.extend(check(args))
        except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
            rows.append((name, "ERROR", f"{err!r}"))
            traceback.print_exc()
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-accel GPU check" + (" (smoke, CPU)" if args.smoke else ""), header_style="bold")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)
    return rows


if __name__ == "__main__":
    main()
