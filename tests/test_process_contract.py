"""The process contract: a 2-process user script under a strategy of ours ends exactly as plain Python ends it.

Each rank ends its own way after the fit (the ranks no longer talk then), so one run checks two endings. Both
ranks are started as torchrun or SLURM start them, so both statuses are seen. One strategy of each family: DDP
with a comm hook whose callbacks hold the group (PowerSGD), DeepSpeed ZeRO-3 (groups held on every parameter),
the pipeline (point-to-point sends). ``benchmarks/bench_clean_exit.py`` runs every string, every ending, many
times.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_clean_exit", REPO / "benchmarks" / "bench_clean_exit.py")
bench_clean_exit = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_clean_exit", bench_clean_exit)  # its dataclass looks its module up there
_spec.loader.exec_module(bench_clean_exit)
ENDINGS = bench_clean_exit.ENDINGS

#: every ending once per family, two per run (rank 0's, rank 1's)
PAIRS = [
    ("normal", "sys_exit"),
    ("raise_system_exit", "builtin_exit"),
    ("exception", "keyboard_interrupt"),
    ("caught_sys_exit", "sys_exit_in_thread"),
    ("destroy_process_group", "normal"),
]
FAMILIES = [
    pytest.param("ddp_powersgd", id="ddp"),
    pytest.param("deepspeed_zero3", id="deepspeed", marks=pytest.mark.deepspeed),
    pytest.param("pp", id="pipeline"),
]


def test_the_pairs_cover_every_ending():
    assert {ending for pair in PAIRS for ending in pair} == set(ENDINGS)


@pytest.mark.distributed
@pytest.mark.parametrize("endings", PAIRS, ids=lambda pair: "+".join(pair))
@pytest.mark.parametrize("strategy", FAMILIES)
def test_a_user_script_ends_as_python_ends_it(strategy, endings, tmp_path):
    ends = bench_clean_exit.run_user_script(strategy, endings, tmp_path)
    problems = [p for end, ending in zip(ends, endings) for p in end.problems(ENDINGS[ending])]
    assert not problems, (problems, [end.stderr_tail for end in ends])
    assert not any("terminate called" in end.stderr_tail for end in ends)
