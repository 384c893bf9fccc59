"""exit_distributed: a finished multi-process script ends without the interpreter-teardown abort, and loses nothing."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

START_GLOO = """
import atexit, os, sys
import torch
import torch.distributed as dist
from lightning_accel.strategies.shutdown import backend_threads_alive, destroy_process_groups, exit_distributed

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
atexit.register(lambda: print("atexit handler ran", flush=True))
"""


def _run(body: str, port: int) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(START_GLOO) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, str(port)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_group_held_elsewhere_keeps_its_threads_and_exit_leaves_cleanly_with_the_code(tmp_path):
    # what DeepSpeed ZeRO-3 does: the group object is kept (param.ds_process_group), so destroying it in
    # torch's registry leaves its gloo threads running
    out = tmp_path / "result.txt"
    proc = _run(f"""
        held = dist.group.WORLD
        assert backend_threads_alive()
        assert destroy_process_groups() is True, "the held group's threads should outlive destroy_process_group"
        assert not dist.is_initialized()
        with open({str(out)!r}, "w") as f:
            f.write("done")
        print("buffered line, no newline flush", end="")
        sys.stdout.write(" and more")
        exit_distributed(3)
        print("never reached")
    """, _free_port())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith("buffered line, no newline flush and more")  # flushed before os._exit
    assert "atexit handler ran" in proc.stdout
    assert "never reached" not in proc.stdout
    assert out.read_text() == "done"
    assert "terminate called" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_nothing_held_destroys_the_group_and_exits_normally():
    proc = _run("""
        assert destroy_process_groups() is False  # the only reference was torch's: threads joined
        assert not backend_threads_alive()
        exit_distributed(0)
    """, _free_port())
    assert proc.returncode == 0, proc.stderr
    assert "atexit handler ran" in proc.stdout  # a plain sys.exit: the interpreter runs its exit handlers


def test_without_a_process_group_it_is_a_plain_exit():
    code = "from lightning_accel.strategies.shutdown import destroy_process_groups, exit_distributed\n" \
           "assert destroy_process_groups() is False\nexit_distributed(5)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 5, proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_registered_clean_exit_leaves_with_the_scripts_code_when_threads_outlive_the_group(tmp_path):
    # the strategies call register_clean_exit(); the script itself ends with a plain sys.exit(3)
    out = tmp_path / "result.txt"
    proc = _run(f"""
        from lightning_accel.strategies.shutdown import register_clean_exit
        held = dist.group.WORLD  # as DeepSpeed holds it
        register_clean_exit()
        register_clean_exit()  # idempotent: one handler
        with open({str(out)!r}, "w") as f:
            f.write("done")
        print("unflushed", end="")
        sys.exit(3)
    """, _free_port())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.count("atexit handler ran") == 1  # the other handlers ran, once
    assert proc.stdout.startswith("unflushed")
    assert out.read_text() == "done"
    assert "terminate called" not in proc.stderr


def test_a_file_left_open_keeps_its_writes_and_the_code_survives_the_strategies_handler(tmp_path):
    # exit_distributed leaves before the teardown that would have flushed the file; the strategies' handler, run
    # among the exit handlers, must not leave again with its own status
    out = tmp_path / "never_closed.txt"
    proc = _run(f"""
        import weakref
        from lightning_accel.strategies.shutdown import register_clean_exit
        register_clean_exit()
        class Gone: pass
        gone = Gone()
        dead = weakref.proxy(gone)  # a dead proxy among the objects looked at: any look at it raises ReferenceError
        del gone
        f = open({str(out)!r}, "w")
        f.write("buffered, never flushed")
        exit_distributed(3)
    """, _free_port())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.count("atexit handler ran") == 1
    assert out.read_text() == "buffered, never flushed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_registered_clean_exit_destroys_the_group_and_reports_an_uncaught_exception():
    proc = _run("""
        from lightning_accel.strategies.shutdown import register_clean_exit
        # registered before the strategy's handler: runs after it
        atexit.register(lambda: print("group destroyed:", not dist.is_initialized(), flush=True))
        register_clean_exit()
        raise RuntimeError("user error")
    """, _free_port())
    assert proc.returncode == 1
    assert "RuntimeError: user error" in proc.stderr
    assert "group destroyed: True" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
@pytest.mark.parametrize("hook", ["torch's", "another library's after ours"])
def test_an_uncaught_exception_exits_1_when_threads_outlive_the_group(hook):
    # torch's init_process_group installs its own sys.excepthook (above, before ours is registered); a library may
    # also replace ours later: a failing script must never leave with exit code 0 through os._exit
    proc = _run(f"""
        from lightning_accel.strategies.shutdown import register_clean_exit
        held = dist.group.WORLD  # as DeepSpeed holds it: the handler leaves with os._exit
        register_clean_exit()
        if {hook == "another library's after ours"!r}:
            sys.excepthook = lambda *args: print("their hook", flush=True)
        raise RuntimeError("user error")
    """, _free_port())
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "atexit handler ran" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the threads from /proc")
def test_an_exit_status_no_hook_saw_is_never_replaced_under_pytest():
    # `python -m pytest` ends with `raise SystemExit(status)`: with threads outliving the group the handler must not
    # os._exit(0) over a failing run's status
    proc = _run("""
        import _pytest  # noqa: F401
        from lightning_accel.strategies import shutdown
        shutdown.register_clean_exit()  # at exit the default group's object is kept: its threads outlive the groups
        raise SystemExit(5)
    """, _free_port())
    assert proc.returncode == 5, proc.stderr


IN_FLIGHT = """
import atexit, os, sys, time
import torch
import torch.distributed as dist
from lightning_accel.strategies.shutdown import exit_distributed

rank = int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)

def callback_holding_the_group():
    group = dist.group.WORLD  # as torch's PowerSGD hook closes over group_to_use
    def done(fut):
        return group.size()
    return done

if rank == 0:
    # the all-reduce completes after rank 0 has destroyed the groups: its callback, run on a gloo worker thread,
    # then drops the closure's reference to the group
    fut = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(callback_holding_the_group())
    del fut
    atexit.register(time.sleep, 1.0)  # rank 0 is still leaving when rank 1 joins the all-reduce
else:
    time.sleep(0.3)
    dist.all_reduce(torch.ones(3))
with open(f"rank{rank}.txt", "w") as f:
    f.write("done")
exit_distributed(0)
"""


@pytest.mark.distributed
def test_a_group_whose_last_reference_a_gloo_callback_drops_never_aborts_the_exit(tmp_path):
    # before the default group's object was kept alive, the worker thread running the callback destroyed the group,
    # joined itself and aborted rank 0 ("Resource deadlock avoided", exit -6): the end of a ddp_powersgd script
    port = str(_free_port())
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    ranks = [subprocess.Popen([sys.executable, "-c", IN_FLIGHT, port, str(r)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [proc.communicate(timeout=120) for proc in ranks]
    for rank, (proc, (_, err)) in enumerate(zip(ranks, outs)):
        assert proc.returncode == 0, (rank, proc.returncode, err[-2000:])
        assert "terminate called" not in err
        assert (tmp_path / f"rank{rank}.txt").read_text() == "done"


def _bench_clean_exit():
    spec = importlib.util.spec_from_file_location("bench_clean_exit", REPO / "benchmarks" / "bench_clean_exit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp_topk", "fsdp2", "pp"])
def test_a_plain_user_script_ends_with_exit_code_0(strategy, tmp_path):
    # one run each here; benchmarks/bench_clean_exit.py loops 50 runs per strategy
    proc = _bench_clean_exit().run_user_script(strategy, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 finished" in proc.stdout and "rank 1 finished" in proc.stdout


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_a_user_script_under_deepspeed_keeps_its_exit_code(tmp_path):
    # ZeRO-3 keeps the group referenced: the strategy's exit handler leaves with os._exit and the script's code
    proc = _bench_clean_exit().run_user_script("deepspeed_zero3", tmp_path, exit_code=3)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 0 finished" in proc.stdout and "rank 1 finished" in proc.stdout
    assert "terminate called" not in proc.stderr


@pytest.mark.distributed
def test_a_user_script_that_raises_after_its_fit_exits_1(tmp_path):
    # pp keeps its groups referenced (the exit handler leaves with os._exit): the exception's status must survive
    proc = _bench_clean_exit().run_user_script("pp", tmp_path, exit_code="raise")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the user's script fails after its fit" in proc.stderr
