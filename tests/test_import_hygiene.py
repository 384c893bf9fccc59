"""`import lightning_accel` must stay light: no optional dependency, no CUDA, no processes."""

import json
import subprocess
import sys

from tests.conftest import REPO

HEAVY = ("deepspeed", "nvidia.dali", "pynvml", "matplotlib")


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_adds_no_optional_dependency_and_no_cuda():
    # torch imports pynvml when it is installed, and torchmetrics (through lightning) imports matplotlib when it
    # is installed; what matters is that lightning_accel itself adds none of them.
    got = _run(f"""
import json, sys, multiprocessing
import torch, lightning.pytorch
before = set(sys.modules)
import lightning_accel
added = set(sys.modules) - before
print(json.dumps({{
    "added_heavy": sorted(m for m in added if m.split('.')[0] in {{h.split('.')[0] for h in {HEAVY!r}}}),
    "cuda": torch.cuda.is_initialized(),
    "children": len(multiprocessing.active_children()),
    "strategies": lightning_accel.strategies.registration.register_strategies(),
}}))
""")
    assert got["added_heavy"] == []
    assert got["cuda"] is False
    assert got["children"] == 0


def test_import_works_with_optional_dependencies_missing():
    # matplotlib is left out: torchmetrics decides from the installed distribution's metadata to import it, so
    # hiding the module breaks torchmetrics itself, not lightning_accel.
    got = _run(f"""
import json, sys
for name in {HEAVY[:3]!r}:
    sys.modules[name] = None  # make `import name` raise ImportError
import lightning_accel
from lightning.pytorch.strategies import StrategyRegistry
print(json.dumps({{"ok": True, "mfu": lightning_accel.MFUMonitor.__name__,
                   "registered": all(n in StrategyRegistry for n in lightning_accel.strategies.registration.STRATEGIES)}}))
""")
    assert got == {"ok": True, "mfu": "MFUMonitor", "registered": True}


def test_public_names_resolve():
    import lightning_accel

    for name in lightning_accel.__all__:
        assert getattr(lightning_accel, name) is not None, name
    try:
        lightning_accel.NoSuchThing
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("unknown attribute did not raise")
