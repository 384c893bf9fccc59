"""all_gather_bounded in 2 gloo processes: a rank that hangs is named within the bound; one that died fails fast."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

SCRIPT = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from lightning_accel.core.collectives import RankFailure, all_gather_bounded

rank, mode, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
print(all_gather_bounded(torch.tensor([float(rank)]), what="test", timeout_s=2).tolist(), flush=True)  # both
if rank == 1:
    if mode == "die":
        os._exit(7)
    time.sleep(30)  # hangs: never reaches the second gather
    os._exit(0)
start = time.perf_counter()
try:
    all_gather_bounded(torch.ones(1), what="BottleneckDoctor window", timeout_s=2)
except RankFailure as err:
    print(f"after {time.perf_counter() - start:.1f} s: {err}", flush=True)
os._exit(0)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo over TCP on Linux")
@pytest.mark.parametrize("mode", ["hang", "die"])
def test_a_rank_that_hangs_or_died_fails_the_others_in_bounded_time_naming_it(mode, tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(SCRIPT)
    port = str(_port())
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    peer = subprocess.Popen(
        [sys.executable, str(script), "1", mode, port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(script), "0", mode, port], env=env, capture_output=True, text=True, timeout=120
        )
        elapsed = time.perf_counter() - start
    finally:
        peer.kill()
        peer.wait()
    assert "[[0.0], [1.0]]" in proc.stdout, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("after "))
    assert "BottleneckDoctor window: rank 0 of 2" in line
    seconds = float(line.split()[1])
    if mode == "hang":
        # the 2 s bound, then the monitored barrier (10 s) names the silent rank
        assert 2 <= seconds < 20 and "Ranks 1 failed to pass monitoredBarrier" in line, line
    else:
        assert seconds < 5 and "rank 1 stopped" in line, line  # gloo sees the closed connection at once
    assert elapsed < 60
