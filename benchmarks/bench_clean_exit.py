"""Exit codes of a plain, finished 2-process user script per strategy string (no call of ours at its end).

The script below is what a user writes: build a Trainer with ``strategy=...``, fit, end. Before the strategies
registered their own exit handling (``strategies/shutdown.py``'s ``register_clean_exit``), about 1 in 25 such
2-process CPU runs aborted with -6 after finishing ("terminate called without an active exception"). Each run is a
fresh pair of processes; the table counts exit codes per strategy.

    python benchmarks/bench_clean_exit.py --runs 50 --strategies ddp_topk,deepspeed_zero3
    python benchmarks/bench_clean_exit.py --runs 3 --failing     # a script that raises must exit 1, never 0
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_IMPORTS = r'''
import sys
import torch
import lightning.pytorch as pl
from torch import nn
import lightning_accel  # registers the strategy strings
'''
#: the end of every user script: fit 3 steps, then end (0, sys.exit(n), or an exception after the fit)
_FIT_AND_END = r'''
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[1], max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Task(), torch.utils.data.DataLoader(data, batch_size=8))
print(f"rank {trainer.global_rank} finished", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "raise":
    raise RuntimeError("the user's script fails after its fit")
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
'''

#: a user's script: nothing of lightning_accel but the import that registers the strings
USER_SCRIPT = _IMPORTS + r'''
class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self.net(batch[0]), batch[0])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.TensorDataset(torch.randn(64, 16))
''' + _FIT_AND_END

#: the same script for the pipeline strings: a network they can split (token embedding, blocks, head)
USER_SCRIPT_PP = _IMPORTS + r'''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    def forward(self, x):
        return x + self.mlp(x)

class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(16, 64)
    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = TinyLM()
    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

tokens = torch.randint(0, 64, (64, 9), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
''' + _FIT_AND_END

STRATEGIES = ("ddp_fp16_compress", "ddp_bf16_compress", "ddp_powersgd", "ddp_topk", "ddp_qsgd", "deepspeed_zero1",
              "deepspeed_zero2", "deepspeed_zero3", "fsdp2", "tp", "pp", "pp_ddp")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_user_script(strategy: str, directory: Path, *, exit_code: int | str | None = None,
                    timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run :data:`USER_SCRIPT` (:data:`USER_SCRIPT_PP` for the pipeline strings) once with ``strategy`` on 2 CPU
    processes; ``exit_code``: the script's ``sys.exit`` after its fit, or ``"raise"`` to end on an exception."""
    script = directory / "user_script.py"
    script.write_text(USER_SCRIPT_PP if strategy.startswith("pp") else USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", MASTER_PORT=str(_port()),
               OMP_NUM_THREADS="1")
    args = [sys.executable, str(script), strategy] + ([] if exit_code is None else [str(exit_code)])
    return subprocess.run(args, cwd=directory, env=env, text=True, capture_output=True, timeout=timeout)


def main(argv: list[str] | None = None) -> dict[str, collections.Counter[int]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="runs per strategy (default 50)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategy strings")
    parser.add_argument("--failing", action="store_true",
                        help="the script raises after its fit: every run must exit 1, never 0")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: use 1 or more")
    results: dict[str, collections.Counter[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            codes: collections.Counter[int] = collections.Counter()
            start = time.perf_counter()
            for _ in range(args.runs):
                proc = run_user_script(strategy, Path(tmp), exit_code="raise" if args.failing else None)
                codes[proc.returncode] += 1
                if proc.returncode != (1 if args.failing else 0) and codes[proc.returncode] == 1:
                    print(f"  {strategy}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
            results[strategy] = codes
            print(f"{strategy:<20} {args.runs} runs  exit codes {dict(codes)}  "
                  f"({(time.perf_counter() - start) / args.runs:.1f} s per run)", flush=True)
    return results


if __name__ == "__main__":
    main()
