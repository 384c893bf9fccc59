"""Shared test helpers: skips for missing hardware/extras and a runner for 2-process Lightning DDP on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# a developer's own LIGHTNING_ACCEL would attach callbacks to every Trainer of the suite (lightning_accel/attach.py);
# the tests that attach set it themselves
os.environ.pop("LIGHTNING_ACCEL", None)

#: variables a distributed launcher sets; none may leak from this process into a script that launches its own ranks
LAUNCH_VARIABLES = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture(autouse=True)
def _no_leaked_launch_variables():
    """Undo what an in-process Trainer leaves in ``os.environ`` (Lightning sets the launch variables)."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """Destroy the process group an in-process Trainer started (``strategy="ddp"`` with ``devices=1`` starts a
    one-process gloo group and leaves it): later tests would see a distributed run. Its outstanding work is
    completed first, so that no gloo thread still holds a callback that references the group when it goes."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from lightning_accel.strategies.outstanding_work import finish_outstanding_work

        finish_outstanding_work()  # one process: the barrier is local
        torch.distributed.destroy_process_group()


#: test files whose assertions follow from measured speed (what the Autopilot, the tuners, the doctor and the smells'
#: previews keep or report on planted sleeps and real steps): marked ``timing``, so a parallel run (pytest-xdist) can
#: keep them to themselves: a neighbouring test must not take the cores they measure on
TIMING_SENSITIVE = (
    "tests/callbacks/test_autopilot",
    "tests/callbacks/test_dataloader_tuner.py",
    "tests/callbacks/test_batch_size_tuner.py",
    "tests/callbacks/test_device_prefetcher.py",
    "tests/callbacks/test_bottleneck_doctor",
    "tests/callbacks/test_doctor_attribution.py",
    "tests/callbacks/test_mfu_monitor.py",
    "tests/core/test_smells.py",
    "tests/core/test_prefetch.py",
    "tests/demo/test_demo_autopilot.py",
    "tests/models/test_real_models.py",
    "tests/commands/test_bench_command.py",
)


def pytest_configure(config: pytest.Config) -> None:
    _share_the_cores_among_xdist_workers()


def _share_the_cores_among_xdist_workers() -> None:
    """Under pytest-xdist (``-n N``) each worker, and what it starts (notebook kernels, scripts, DDP ranks through
    ``OMP_NUM_THREADS``), runs torch on usable CPUs // N threads. With torch's default of one thread per core, two
    workers ran four spinning OpenMP threads on this project's 2 cores and each notebook took 3-4x as long as alone
    (06: 177 s instead of 59), which ate the whole gain of the parallel run."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return
    from lightning_accel.core.utilisation import usable_cpu_count

    threads = max(1, usable_cpu_count() // workers)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = str(threads)
    torch.set_num_threads(threads)


#: the longest tests (tens of seconds to minutes each on 2 cores): under pytest-xdist they are handed out first, so
#: the run does not end on one worker executing them alone while the other has nothing left
LONGEST_FIRST = (
    "tests/test_notebooks.py",
    "tests/strategies/test_pipeline_ddp.py",
    "tests/models/test_real_models_ddp.py",
    "tests/test_process_contract.py",
    "tests/data/test_dali_ddp.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from lightning_accel._imports import is_available

    if os.environ.get("PYTEST_XDIST_WORKER"):  # the same order on every worker (xdist checks it)
        items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))

    needs = {
        "gpu": (torch.cuda.is_available(), "needs a CUDA GPU"),
        "deepspeed": (is_available("deepspeed"), "needs deepspeed: pip install 'lightning-accel[deepspeed]'"),
        "dali": (is_available("nvidia.dali"), "needs NVIDIA DALI: pip install 'lightning-accel[dali]'"),
    }
    for item in items:
        if item.nodeid.startswith(TIMING_SENSITIVE):
            item.add_marker(pytest.mark.timing)
        for marker, (ok, reason) in needs.items():
            if marker in item.keywords and not ok:
                item.add_marker(pytest.mark.skip(reason=reason))


def run_script(
    code: str, tmp_path: Path, *, timeout: float = 300, env: dict[str, str] | None = None, args: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script file in a fresh interpreter (Lightning's DDP launcher re-runs the script per rank).

    The script runs with the repository on ``PYTHONPATH`` and ``tmp_path`` as its working directory; it fails the
    test with the script's output if it exits non-zero.
    """
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    # a Trainer that ran inside this pytest process leaves LOCAL_RANK, MASTER_PORT, ... in os.environ; a child
    # inheriting them believes it was launched externally and rank 0 waits forever for peers
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    full_env = {
        **inherited,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }  # an abort prints every thread
    proc = subprocess.run(
        [sys.executable, str(script), *(args or [])],
        cwd=tmp_path,
        env=full_env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"script exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n"
            f"--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def read_rank_json(tmp_path: Path, stem: str, world_size: int = 2) -> list[Any]:
    """Load ``{stem}_rank{r}.json`` written by each rank of a :func:`run_script` DDP run."""
    return [json.loads((tmp_path / f"{stem}_rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture
def ddp_script(tmp_path: Path):
    """``ddp_script(code)`` runs a script (typically ``Trainer(devices=2, strategy="ddp", accelerator="cpu")``)."""

    def run(code: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return run_script(code, tmp_path, **kwargs)

    return run
