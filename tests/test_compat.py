"""The compatibility layer: every private name still exists in the installed versions; the version floor raises
an ImportError that names the supported range; no private access is left outside ``_compat.py``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from lightning_accel import _compat

PACKAGE = Path(_compat.__file__).parent
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("entry", _compat.PRIVATE_NAMES, ids=lambda e: f"{e.owner}.{e.name}")
def test_every_private_name_exists_in_the_installed_versions(entry):
    if entry.owner.startswith("transformers") and not HAVE_TRANSFORMERS:
        pytest.skip("transformers not installed (the name is read only on transformers models)")
    obj = _compat.resolve(entry)
    assert hasattr(obj, entry.name), (
        f"{entry.owner}.{entry.name} is gone (checked: {entry.checked}); update "
        f"lightning_accel/_compat.py for {', '.join(entry.used_in)}"
    )
    if entry.kind == "override":
        assert callable(getattr(obj, entry.name))  # an override of a renamed method would silently never run


def test_every_used_in_file_exists():
    for entry in _compat.PRIVATE_NAMES:
        for use in entry.used_in:
            assert (PACKAGE / use.split(":")[0]).is_file(), use


# Private names of this package's own objects (or dunder protocols) that are not Lightning/torch internals.
OWN = {"_fields", "_trainer_or_none", "_pipeline", "_discard", "_thread", "_stop", "_step_depth"}
# The standard library's private-looking public names (none used today).
STDLIB: set[str] = set()


def _private_accesses(path: Path) -> set[str]:
    """Private attributes read on objects other than ``self``/``cls``, and private imports from torch/lightning."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "lightning"):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            found |= {p for p in parts if p.startswith("_")}
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                found.add(node.attr)  # super()._method(): a private method of the base class
                continue
            found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
        ):
            found.add(str(node.args[1].value))
    return found


def test_no_private_torch_or_lightning_access_outside_compat():
    registered = {e.name for e in _compat.PRIVATE_NAMES}
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_compat.py":
            continue
        own_names = {
            n.name
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        }
        own_attrs = {
            t.attr
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Attribute)
        }
        left = _private_accesses(path) - own_names - own_attrs - OWN - STDLIB
        # names of this package's private objects (``lazy._q``) are set on instances of its own classes
        left = {name for name in left if name in registered or not _defined_in_package(name)}
        if left:
            offenders[rel] = sorted(left)
    assert offenders == {}, f"private accesses outside _compat.py (move them behind an accessor there): {offenders}"


def _defined_in_package(name: str) -> bool:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if f"self.{name} =" in text or f"self.{name}:" in text or f"def {name}(" in text or f".{name} = " in text:
            return True
    return False


def test_floor_raises_import_error_naming_the_supported_range(monkeypatch):
    import lightning
    import torch

    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(
        ImportError,
        match=r"TorchCompile needs torch>=2\.6 and lightning>=2\.6 .*found torch 2\.5\.1"
        r"\+cpu\. Upgrade: pip install 'torch>=2\.6' 'lightning>=2\.6'",
    ):
        _compat.require_versions("TorchCompile")
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setattr(lightning, "__version__", "2.5.6")
    with pytest.raises(ImportError, match=r"found lightning 2\.5\.6"):
        _compat.require_versions("TorchCompile")
    _compat.require_versions("the attention helpers", lightning=False)  # torch alone is new enough


def test_importing_a_component_on_an_old_lightning_names_the_range(monkeypatch):
    import lightning

    import lightning_accel.callbacks

    monkeypatch.setattr(lightning, "__version__", "2.4.0")
    monkeypatch.delitem(sys.modules, "lightning_accel.callbacks.torch_compile", raising=False)
    with pytest.raises(ImportError, match=r"TorchCompile needs torch>=2\.6 and lightning>=2\.6.*found lightning 2\.4"):
        importlib.import_module("lightning_accel.callbacks.torch_compile")
    monkeypatch.undo()  # the original module object is back in sys.modules: classes stay identical
    assert (
        importlib.import_module("lightning_accel.callbacks.torch_compile").TorchCompile
        is lightning_accel.callbacks.TorchCompile
    )


def test_pyproject_states_the_same_floor():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"torch>={".".join(map(str, _compat.TORCH_MIN))}"' in text
    assert f'"lightning>={".".join(map(str, _compat.LIGHTNING_MIN))}"' in text


def test_every_private_name_says_why_no_public_api_does_it():
    missing = [f"{e.owner}.{e.name}" for e in _compat.PRIVATE_NAMES if len(e.why.split()) < 4]
    assert missing == [], f"say in PrivateName(why=...) why no public API does the job: {missing}"
