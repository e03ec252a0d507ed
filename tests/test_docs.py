"""Every block fenced as Python in README.md and docs/*.md runs as written on the CPU.

Each block runs alone, in a fresh namespace, in a scratch directory, with nothing
defined before it: a fragment or an API listing must use another fence (```text).
Blocks are collected when the tests are: a block added to any of these files later is
run too. What the examples do is checked further in test_readme.py and
test_nixl_docs.py.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# ```python, ```py, ```python3 (any case), at the start of a line, body up to the closing fence.
PYTHON_FENCE = re.compile(r"^```[ \t]*(?:python3?|py)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M | re.I)


def python_blocks():
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in PYTHON_FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(pytest.param(doc, line, m.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return out


BLOCKS = python_blocks()


def test_docs_have_python_blocks():
    # The README's API and NIXL examples at least: a broken fence regex would run nothing.
    assert sum(1 for b in BLOCKS if b.values[0].name == "README.md") >= 2, [b.id for b in BLOCKS]


@pytest.mark.parametrize("doc,line,code", BLOCKS)
def test_python_block_runs_as_written(doc, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Line numbers in a traceback are those of the Markdown file.
    source = "\n" * line + code
    exec(compile(source, str(doc), "exec"), {"__name__": "__doc_example__"})
