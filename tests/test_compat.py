"""The compatibility layer: every private name still exists in the installed versions; the version floor raises
an ImportError that names the supported range; no private access is left outside the ``_compat`` package."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import pytest

from lightning_accel import _compat

COMPAT = Path(_compat.__file__).parent
PACKAGE = COMPAT.parent
SUBMODULES = [importlib.import_module(f"{_compat.__name__}.{m.name}") for m in pkgutil.iter_modules(_compat.__path__)]
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("entry", _compat.PRIVATE_NAMES, ids=lambda e: f"{e.owner}.{e.name}")
def test_every_private_name_exists_in_the_installed_versions(entry):
    if entry.owner.startswith("transformers") and not HAVE_TRANSFORMERS:
        pytest.skip("transformers not installed (the name is read only on transformers models)")
    obj = _compat.resolve(entry)
    assert hasattr(obj, entry.name), (
        f"{entry.owner}.{entry.name} is gone (checked: {entry.checked}); update "
        f"lightning_accel/_compat/ for {', '.join(entry.used_in)}"
    )
    if entry.kind == "override":
        assert callable(getattr(obj, entry.name))  # an override of a renamed method would silently never run


def test_every_entry_of_every_submodule_is_in_private_names():
    # the registry test above checks PRIVATE_NAMES only: an entry left out of the union would go unchecked
    registered = set(_compat.PRIVATE_NAMES)
    missing = {
        module.__name__: [f"{e.owner}.{e.name}" for e in module.PRIVATE_NAMES if e not in registered]
        for module in SUBMODULES
        if hasattr(module, "PRIVATE_NAMES")
    }
    assert {name: entries for name, entries in missing.items() if entries} == {}
    assert {f"{_compat.__name__}.{lib}" for lib in ("torch", "lightning", "transformers")} <= set(missing)


def _imported_at_import_time(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: everywhere but inside its functions."""
    found: set[str] = set()
    nodes: list[ast.AST] = [ast.parse(path.read_text())]
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
        nodes.extend(ast.iter_child_nodes(node))
    return found


def test_importing_compat_imports_neither_lightning_nor_transformers():
    # the framework-free core imports the package: Lightning and transformers are imported inside accessors only
    heavy = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers")
    at_import = {
        f"{Path(module.__file__).name}: {name}"
        for module in (_compat, *SUBMODULES)
        for name in _imported_at_import_time(Path(module.__file__))
        if name.split(".")[0] in heavy
    }
    assert at_import == set()


def _defines(path: Path, qualname: str) -> bool:
    """Whether ``path`` defines ``qualname`` (``name`` or ``Class.method``, at any depth) or assigns ``name``."""
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    names |= {
        t.id
        for n in ast.walk(tree)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    return all(part in names for part in qualname.split("."))


def test_every_used_in_file_exists():
    # each user is named as file:function: a function renamed or moved leaves its entry pointing at nothing
    missing = []
    for entry in _compat.PRIVATE_NAMES:
        for use in entry.used_in:
            path, _, qualname = use.partition(":")
            if not (PACKAGE / path).is_file() or (qualname and not _defines(PACKAGE / path, qualname)):
                missing.append(f"{entry.owner}.{entry.name}: {use} is not there")
    assert not missing, "\n".join(missing)


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
        if path.is_relative_to(COMPAT):
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
    assert offenders == {}, f"private accesses outside _compat/ (move them behind an accessor there): {offenders}"


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
