"""How a 2-process user script ends under each strategy string: its exit status on every rank, per ending.

The script below is what a user writes: build a Trainer with ``strategy=...``, fit, then end in one of the ways a
Python script ends. Nothing of lightning_accel is called but the import that registers the strings. Both ranks are
started the way torchrun or SLURM start them (``LOCAL_RANK``, ``MASTER_PORT`` set; Lightning launches nothing), so
the status of each is seen. A run passes when both ranks end with the status plain Python gives that ending, and
what Python guarantees at its end held: the ``atexit`` handler ran once, the non-daemon thread finished its file,
the gzip file the script closes in an exit handler is complete (its trailer is there).

    python benchmarks/bench_clean_exit.py --runs 200 --strategies ddp_powersgd,deepspeed_zero3
    python benchmarks/bench_clean_exit.py --runs 3 --endings all      # every ending under every string
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the endings a script can take, with the status Python gives each (a subprocess sees a signal as its negative)
ENDINGS: dict[str, int] = {
    "normal": 0,
    "destroy_process_group": 0,  # torch's advice for the end of a script: destroy_process_group(), then the end
    "caught_sys_exit": 0,  # sys.exit(4) caught by the script, which then ends normally
    "sys_exit_in_thread": 0,  # Python ignores SystemExit raised in a thread
    "sys_exit": 3,
    "raise_system_exit": 2,
    "builtin_exit": 5,
    "exception": 1,
    "keyboard_interrupt": -signal.SIGINT,  # Python re-raises SIGINT on itself: a shell shows 130
}

_IMPORTS = r"""
import atexit
import gzip
import os
import sys
import threading
import time

import torch
import lightning.pytorch as pl
from torch import nn
import lightning_accel  # registers the strategy strings

strategy, out = sys.argv[1], sys.argv[3]
rank = int(os.environ.get("LOCAL_RANK", 0))
ending = sys.argv[2].split(",")[rank]  # one ending per rank: after the fit the ranks no longer talk
"""

#: after the fit: what a script leaves for Python's own end, then the ending
_FIT_AND_END = r"""
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Task(), torch.utils.data.DataLoader(data, batch_size=8))

atexit.register(lambda: open(f"{out}/atexit_rank{rank}", "a").write("ran\n"))


def write_later():
    time.sleep(0.3)
    with open(f"{out}/thread_rank{rank}", "w") as f:
        f.write("complete")


threading.Thread(target=write_later).start()  # not a daemon: Python waits for it before its end
archive = gzip.open(f"{out}/archive_rank{rank}.gz", "wt")  # closed by its owner's exit handler
archive.write("payload " * 1000)
atexit.register(archive.close)

if ending == "destroy_process_group":
    torch.distributed.destroy_process_group()
elif ending == "caught_sys_exit":
    try:
        sys.exit(4)
    except SystemExit:
        pass
elif ending == "sys_exit_in_thread":
    thread = threading.Thread(target=sys.exit, args=(1,))
    thread.start()
    thread.join()
elif ending == "sys_exit":
    sys.exit(3)
elif ending == "raise_system_exit":
    raise SystemExit(2)
elif ending == "builtin_exit":
    exit(5)
elif ending == "exception":
    raise RuntimeError("the user's script fails after its fit")
elif ending == "keyboard_interrupt":
    raise KeyboardInterrupt
"""

#: a user's script: nothing of lightning_accel but the import that registers the strings
USER_SCRIPT = (
    _IMPORTS
    + r"""
class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    def training_step(self, batch, i):
        return nn.functional.mse_loss(self.net(batch[0]), batch[0])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.TensorDataset(torch.randn(64, 16))
"""
    + _FIT_AND_END
)

#: the same script for the pipeline strings: a network they can split (token embedding, blocks, head)
USER_SCRIPT_PP = (
    _IMPORTS
    + r"""
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
"""
    + _FIT_AND_END
)

#: every strategy string of the collection that runs several processes
STRATEGIES = (
    "ddp_fp16_compress",
    "ddp_bf16_compress",
    "ddp_powersgd",
    "ddp_topk",
    "ddp_qsgd",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero2_offload",
    "deepspeed_zero3",
    "deepspeed_zero3_offload",
    "deepspeed_auto",
    "fsdp2",
    "tp",
    "fsdp2_tp",
    "pp",
    "pp_ddp",
)

#: variables of an outer launcher that must not reach the ranks started here
_LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "TORCHELASTIC_RUN_ID",
)


@dataclass
class RankEnd:
    """How one rank ended: its status and what Python's end guarantees, as the files it left show."""

    rank: int
    status: int
    atexit_runs: int
    thread_file_complete: bool
    gzip_file_complete: bool
    stderr_tail: str

    def problems(self, expected_status: int) -> list[str]:
        """What differs from a plain Python end (empty when nothing does)."""
        found = []
        if self.status != expected_status:
            found.append(f"rank {self.rank} exited {self.status}, Python gives {expected_status}")
        if self.atexit_runs != 1:
            found.append(f"rank {self.rank}: the atexit handler ran {self.atexit_runs} times, not once")
        if not self.thread_file_complete:
            found.append(f"rank {self.rank}: the non-daemon thread's file is missing or incomplete")
        if not self.gzip_file_complete:
            found.append(f"rank {self.rank}: the gzip file closed at exit is truncated (no trailer)")
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_gzip(path: Path) -> bool:
    try:
        with gzip.open(path, "rt") as f:
            return f.read() == "payload " * 1000
    except (OSError, EOFError):
        return False


def run_user_script(
    strategy: str, endings: str | tuple[str, str], directory: Path, *, timeout: float = 300
) -> list[RankEnd]:
    """Run the user script (the pipeline one for ``pp*``) with ``strategy`` on 2 CPU processes started as a cluster
    launcher starts them; rank ``r`` ends with ``endings[r]`` (a key of :data:`ENDINGS`; one string: both ranks).
    Returns how each rank ended."""
    endings = (endings, endings) if isinstance(endings, str) else tuple(endings)
    unknown = [e for e in endings if e not in ENDINGS]
    if len(endings) != 2 or unknown:
        raise ValueError(f"endings={endings!r}: give one or two of {sorted(ENDINGS)}")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*_rank*"):
        stale.unlink()
    script = directory / "user_script.py"
    script.write_text(USER_SCRIPT_PP if strategy.startswith("pp") else USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        DS_ACCELERATOR="cpu",
    )
    procs = []
    for rank in range(2):
        with open(directory / f"stderr_rank{rank}", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), strategy, ",".join(endings), str(directory)],
                    cwd=directory,
                    env={**env, "LOCAL_RANK": str(rank)},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    deadline = time.monotonic() + timeout
    try:
        statuses = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # a rank that hangs: end it, the run has failed
                proc.kill()
                proc.wait()
    ends = []
    for rank, status in enumerate(statuses):
        atexit_file = directory / f"atexit_rank{rank}"
        thread_file = directory / f"thread_rank{rank}"
        ends.append(
            RankEnd(
                rank=rank,
                status=status,
                atexit_runs=atexit_file.read_text().count("ran") if atexit_file.exists() else 0,
                thread_file_complete=thread_file.exists() and thread_file.read_text() == "complete",
                gzip_file_complete=_read_gzip(directory / f"archive_rank{rank}.gz"),
                stderr_tail=(directory / f"stderr_rank{rank}").read_text()[-3000:],
            )
        )
    return ends


def main(argv: list[str] | None = None) -> dict[tuple[str, str], collections.Counter[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="runs per strategy and ending (default 50)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategy strings")
    parser.add_argument("--endings", default="normal", help=f"comma-separated, or 'all': {', '.join(ENDINGS)}")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: use 1 or more")
    endings = list(ENDINGS) if args.endings == "all" else args.endings.split(",")
    unknown = [e for e in endings if e not in ENDINGS]
    if unknown:
        parser.error(f"--endings {','.join(unknown)}: choose from {', '.join(ENDINGS)} or 'all'")
    results: dict[tuple[str, str], collections.Counter[str]] = {}
    print("| strategy | ending | runs | as Python ends it | other | s per run |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategies.split(","):
            for ending in endings:
                outcomes: collections.Counter[str] = collections.Counter()
                start = time.perf_counter()
                for _ in range(args.runs):
                    ends = run_user_script(strategy, ending, Path(tmp) / "run")
                    problems = [p for end in ends for p in end.problems(ENDINGS[ending])]
                    outcomes["ok" if not problems else "; ".join(problems)] += 1
                    if problems and outcomes["; ".join(problems)] == 1:
                        tails = [end.stderr_tail.strip().splitlines()[-3:] for end in ends]
                        print(f"  {strategy} {ending}: {'; '.join(problems)}: {tails}", file=sys.stderr)
                results[(strategy, ending)] = outcomes
                other = {k: v for k, v in outcomes.items() if k != "ok"}
                print(
                    f"| {strategy} | {ending} | {args.runs} | {outcomes['ok']} | {other or '-'} | "
                    f"{(time.perf_counter() - start) / args.runs:.1f} |",
                    flush=True,
                )
    return results


if __name__ == "__main__":
    main()
