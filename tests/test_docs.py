"""The documentation site: every public name has its API page, every page is in the nav, the command-line page lists
every demo flag, the docstring converter renders reStructuredText as Markdown, and the strict build passes without
importing torch or the package (skipped where mkdocs is not installed: ``pip install -e ".[docs]"``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

import lightning_accel
from lightning_accel.cli import build_parser
from tests.conftest import REPO

DOCS = REPO / "docs"
API = DOCS / "reference" / "api"


def _nav_pages() -> list[str]:
    """Every page path in mkdocs.yml's nav, in order."""
    found: list[str] = []

    def walk(entry: object) -> None:
        if isinstance(entry, str):
            found.append(entry)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)

    walk(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    return found


def test_every_public_name_has_an_api_page_pointing_at_its_definition():
    index = (API / "index.md").read_text()
    problems = []
    for name, module in lightning_accel._EXPORTS.items():
        page = API / f"{name}.md"
        if not page.exists():
            problems.append(f"{name}: no {page.relative_to(REPO)}")
            continue
        if page.read_text().strip() != f"::: {module}.{name}":
            problems.append(f"{name}: {page.relative_to(REPO)} should hold the one line '::: {module}.{name}'")
        if f"]({name}.md)" not in index:
            problems.append(f"{name}: not listed in {(API / 'index.md').relative_to(REPO)}")
    assert problems == [], "\n".join(problems)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages()
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(on_disk) - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(on_disk)) == [], "nav entries without a page"
    assert len(nav) == len(set(nav)), "a page listed twice in the nav"


def test_the_command_line_page_lists_every_command_and_demo_flag():
    page = (DOCS / "reference" / "cli.md").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    missing = [f"`{name}`" for name in commands if f"| `{name}` |" not in page]
    demo_flags = [
        opt
        for action in commands["demo"]._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]
    missing += [flag for flag in demo_flags if f"`{flag}`" not in page]
    assert missing == [], f"add these to docs/reference/cli.md: {missing}"


def test_the_attach_page_lists_every_run_option_and_every_form_of_the_variable():
    from lightning_accel.attach import _KEYS, _WORDS
    from lightning_accel.commands.run import _options

    page = (DOCS / "attach.md").read_text()
    flags = [opt for action in _options()._actions for opt in action.option_strings if opt not in ("-h", "--help")]
    forms = [f"`{word}`" for word in _WORDS] + [f"`{key}:PATH`" for key in _KEYS]
    missing = [flag for flag in flags if f"`{flag}" not in page] + [form for form in forms if form not in page]
    assert missing == [], f"add these to docs/attach.md: {missing}"


# ------------------------------------------------------------------------------------- the docstring converter
needs_griffe = pytest.mark.skipif(importlib.util.find_spec("griffe") is None, reason="griffe (the docs extra) missing")


def _converter():
    spec = importlib.util.spec_from_file_location("rst_docstrings", DOCS / "hooks" / "rst_docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rst_to_markdown


@needs_griffe
def test_a_simple_table_becomes_a_markdown_table_with_its_continuation_lines_joined():
    text = textwrap.dedent("""\
        Keys:

        ==========  ======================
        key         meaning
        ==========  ======================
        ``a``       first line
                    and its continuation
        ``hook_``   split code
        ``name``    span
        ==========  ======================

        After.""")
    assert _converter()(text).split("\n") == [
        "Keys:",
        "",
        "",
        "| key | meaning |",
        "|---|---|",
        "| ``a`` | first line and its continuation |",
        "| ``hook_`` | split code |",
        "| ``name`` | span |",
        "",
        "",
        "After.",
    ]


@needs_griffe
def test_a_code_span_split_over_two_table_lines_is_joined():
    text = "=====  =====\nk      v\n=====  =====\n``x``  ``compress_``\n       ``hook``\n=====  =====\n"
    assert "| ``x`` | ``compress_hook`` |" in _converter()(text)


@needs_griffe
def test_roles_become_code_spans_and_a_literal_block_becomes_fenced_code():
    text = textwrap.dedent("""\
        See :class:`~lightning_accel.core.stages.StageMachine` and :func:`.compression_hooks.topk_hook`::

            machine = StageMachine()
            machine.batch_requested()

        Then :mod:`lightning_accel.core.rules`.""")
    assert _converter()(text).split("\n") == [
        "See `StageMachine` and `topk_hook`:",
        "",
        "```python",
        "machine = StageMachine()",
        "machine.batch_requested()",
        "```",
        "",
        "Then `lightning_accel.core.rules`.",
    ]


@needs_griffe
def test_an_entry_documenting_two_arguments_becomes_one_entry_each():
    text = textwrap.dedent("""\
        Args:
            budget: the share.
            warmup_steps / measure_steps: untimed and timed
                steps per window.
            patience: misses.""")
    assert _converter()(text).split("\n") == [
        "Args:",
        "    budget: the share.",
        "    warmup_steps: untimed and timed",
        "        steps per window.",
        "    measure_steps: untimed and timed",
        "        steps per window.",
        "    patience: misses.",
    ]


# --------------------------------------------------------------------------------------------- the strict build
# Builds the site the way .ci/docs does (mkdocs build --strict, its own command line, which prints the warnings), in
# a fresh interpreter that reports at exit which modules the build imported: mkdocstrings must read the package's
# source, not import it (no torch, no CUDA, no downloads).
_BUILD = """
import atexit, json, runpy, sys
atexit.register(lambda: print(json.dumps(sorted(m for m in ("torch", "lightning", "lightning_accel")
                                                if m in sys.modules))))
sys.argv = ["mkdocs", "build", "--strict", "--site-dir", sys.argv[1]]
runpy.run_module("mkdocs", run_name="__main__")
"""


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs missing: pip install -e '.[docs]'")
def test_the_site_builds_strictly_without_importing_the_package(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _BUILD, str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], "building the docs imported these modules"
    page = (tmp_path / "site" / "reference" / "api" / "DDPCompressionStrategy" / "index.html").read_text()
    assert "<table>" in page and ":func:" not in page and "=====" not in page


def architecture_problems(text: str) -> list[str]:
    """What the architecture page names that the package lacks: a path that does not exist, a name said to be
    ``in`` a file that the file does not define, and a folder of the package missing from the layout table."""
    import re

    problems = []
    for path in sorted(set(re.findall(r"`(lightning_accel[\w/.]*)`", text))):
        if not (REPO / path.rstrip("/")).exists():
            problems.append(f"no such path: {path}")
    for name, path in re.findall(r"`(\w+)` in `(lightning_accel/[\w/]+\.py)`", text):
        source = (REPO / path).read_text() if (REPO / path).exists() else ""
        if not re.search(rf"^\s*(def|class) {name}\b|^{name}\b\s*[:=]", source, re.MULTILINE):
            problems.append(f"{path} defines no {name}")
    table = {m for m in re.findall(r"^\| `(lightning_accel/[\w/]+)/`", text, re.MULTILINE)}
    for folder in sorted(p for p in (REPO / "lightning_accel").iterdir() if (p / "__init__.py").exists()):
        if f"lightning_accel/{folder.name}" not in table and folder.name not in ("demo", "losses"):
            problems.append(f"the layout table has no row for lightning_accel/{folder.name}/")
    return problems


def test_the_architecture_page_names_files_and_definitions_that_exist():
    assert architecture_problems((DOCS / "architecture.md").read_text()) == []


def test_the_architecture_check_sees_a_moved_file_and_a_renamed_definition():
    page = (DOCS / "architecture.md").read_text()
    moved = page.replace("`lightning_accel/core/rules.py`", "`lightning_accel/core/rulez.py`")
    renamed = page.replace("`_rule_memory` in", "`_rule_memoryy` in")
    assert any("no such path: lightning_accel/core/rulez.py" in p for p in architecture_problems(moved))
    assert architecture_problems(renamed) == ["lightning_accel/core/rules.py defines no _rule_memoryy"]
