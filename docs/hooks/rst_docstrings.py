"""A Griffe extension that turns the reStructuredText in the package's docstrings into Markdown.

The docstrings are Google style, which mkdocstrings reads, but they also use three reStructuredText forms that
Markdown would print as they are: cross-reference roles (``:class:`~a.b.C```), simple tables (columns framed by
``=====`` lines) and literal blocks introduced by ``::``. This extension rewrites those three, in memory, before
mkdocstrings renders the docstring; the source files are not touched.

Roles become code spans rather than links: a link to an object the reference does not document would fail the
strict build, and most roles point at internals.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["RstDocstrings", "rst_to_markdown"]

_ROLE = re.compile(r":(?:py:)?(?:func|class|attr|meth|data|mod|exc|obj|const):`(~?)([^`]+)`")
_SHELL_COMMANDS = ("nsys ", "python ", "pip ", "lightning-accel ", "torchrun ", "srun ", "export ", "$ ")
_BORDER = re.compile(r"^(\s*)(=+)((?:\s+=+)+)\s*$")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    target = target.strip()
    if tilde or target.startswith("."):
        target = target.lstrip(".").rsplit(".", 1)[-1] or target
    return f"`{target}`"


def _columns(border: str) -> list[tuple[int, int]]:
    """Start and end offsets of the ``=`` runs of a table border."""
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, columns: list[tuple[int, int]]) -> list[str]:
    """The text of each column; the last column takes the rest of the line."""
    cells = []
    for i, (start, _end) in enumerate(columns):
        stop = columns[i + 1][0] if i + 1 < len(columns) else len(line)
        cells.append(line[start:stop].strip())
    return cells


def _join(previous: str, more: str) -> str:
    """Append a continuation line to a cell; a code span or role split over two lines is joined back into one."""
    if not previous or not more:
        return previous or more
    lead = re.match(r"``([^`]+)``(.*)$", more)
    if lead and previous.endswith("`") and previous.rstrip("`").endswith((".", "_")):
        ticks = 2 if previous.endswith("``") else 1
        return previous[:-ticks] + lead.group(1) + "`" * ticks + lead.group(2)
    return f"{previous} {more}"


def _table(lines: list[str], start: int) -> tuple[list[str], int] | None:
    """The Markdown table for the reStructuredText simple table whose first border is ``lines[start]``, and the
    index after its closing border; ``None`` when the lines there are not a complete simple table."""
    indent = _BORDER.match(lines[start]).group(1)  # type: ignore[union-attr]
    columns = _columns(lines[start])
    borders = []
    for i in range(start + 1, len(lines)):
        if _BORDER.match(lines[i]) and _columns(lines[i]) == columns:
            borders.append(i)
            if len(borders) == 2:
                break
        elif lines[i].strip() == "" and not borders:
            return None
    if len(borders) < 2:
        return None
    header = [_cells(line, columns) for line in lines[start + 1 : borders[0]]]
    rows: list[list[str]] = []
    for line in lines[borders[0] + 1 : borders[1]]:
        if not line.strip():
            continue
        cells = _cells(line, columns)
        if rows and not cells[0]:  # a continuation line: the first column is empty
            rows[-1] = [_join(old, new) for old, new in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    head = [" ".join(parts).strip() for parts in zip(*header)] if header else [""] * len(columns)

    def row(cells: list[str]) -> str:
        return indent + "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    out = ["", row(head), indent + "|" + "|".join("---" for _ in columns) + "|", *(row(r) for r in rows), ""]
    return out, borders[1] + 1


def _literal_blocks(lines: list[str]) -> list[str]:
    """``text::`` + an indented block becomes ``text:`` + a fenced code block (Markdown has no ``::``)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith(("..", ">>>")):
            base = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_end = j
            while block_end < len(lines) and (
                not lines[block_end].strip() or len(lines[block_end]) - len(lines[block_end].lstrip()) > base
            ):
                block_end += 1
            while block_end > j and not lines[block_end - 1].strip():
                block_end -= 1
            if block_end > j:
                text = line.rstrip()[:-2].rstrip()
                if text.strip():  # "Example::" -> "Example:"; a lone "::" disappears
                    out.append(text + ":")
                block = lines[j:block_end]
                inner = min(len(b) - len(b.lstrip()) for b in block if b.strip())
                shell = block[0].strip().startswith(_SHELL_COMMANDS)
                out.extend(["", " " * base + ("```bash" if shell else "```python")])
                out.extend(" " * base + b[inner:] if b.strip() else "" for b in block)
                out.append(" " * base + "```")
                i = block_end
                continue
        out.append(line)
        i += 1
    return out


_SECTION = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Other Parameters|Keyword Args|Attributes):\s*$")
_SHARED_ENTRY = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*/\s*[A-Za-z_]\w*)+)(\s*:.*)$")


def _shared_entries(lines: list[str]) -> list[str]:
    """A Google-style entry that documents several names at once (``a / b: text``) becomes one entry per name,
    each with the same text, so the parser matches every name with the signature."""
    out: list[str] = []
    section_indent: int | None = None
    entry_indent: int | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if _SECTION.match(line):
            section_indent, entry_indent = indent, None
        elif section_indent is not None and line.strip():
            if indent <= section_indent:
                section_indent = None
            elif entry_indent is None:
                entry_indent = indent
        shared = _SHARED_ENTRY.match(line) if section_indent is not None and indent == entry_indent else None
        if shared:
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                j += 1
            while j > i + 1 and not lines[j - 1].strip():
                j -= 1
            for name in shared.group(2).split("/"):
                out.append(shared.group(1) + name.strip() + shared.group(3))
                out.extend(lines[i + 1 : j])
            i = j
            continue
        out.append(line)
        i += 1
    return out


def rst_to_markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText roles, simple tables and literal blocks in Markdown."""
    lines = text.split("\n")
    converted: list[str] = []
    i = 0
    while i < len(lines):
        if _BORDER.match(lines[i]):
            table = _table(lines, i)
            if table is not None:
                converted.extend(table[0])
                i = table[1]
                continue
        converted.append(lines[i])
        i += 1
    converted = _shared_entries(_literal_blocks(converted))
    return _ROLE.sub(_role, "\n".join(converted))


class RstDocstrings(griffe.Extension):
    """Rewrites every docstring as soon as Griffe has read it (before any parsing or rendering)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
