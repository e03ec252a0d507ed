"""Every block fenced as Python in README.md and docs/*.md runs as written on the CPU;
every result file under bench/results/ is cited by exact name, and every citation exists.

Each block runs alone, in a fresh namespace, in a scratch directory, with nothing
defined before it: a fragment or an API listing must use another fence (```text).
Blocks are collected when the tests are: a block added to any of these files later is
run too. What the examples do is checked further in test_readme.py and
test_nixl_docs.py.
"""
import itertools
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
    # The README's example and docs/nixl.md's at least: a broken fence regex would run nothing.
    assert sum(1 for b in BLOCKS if b.values[0].name == "README.md") >= 1, [b.id for b in BLOCKS]
    assert sum(1 for b in BLOCKS if b.values[0].name == "nixl.md") >= 3, [b.id for b in BLOCKS]


@pytest.mark.parametrize("doc,line,code", BLOCKS)
def test_python_block_runs_as_written(doc, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Line numbers in a traceback are those of the Markdown file.
    source = "\n" * line + code
    exec(compile(source, str(doc), "exec"), {"__name__": "__doc_example__"})


# Where results are cited: a path under bench/results/, optionally with brace lists
# (`bench/results/cpu-2core-seeds2-{1,2,3}.json`). A bare `bench/results/` names the folder.
RESULTS = "bench/results"
CITATION = re.compile(r"bench/results/([\w./{},-]*[\w}])")
GLOB = re.compile(r"bench/results/[^\s`'\")]*[*?\[][^\s`'\")]*")


def citing_docs(root: Path):
    return [root / "README.md", root / "CHANGELOG.md", root / "bench" / "NOTES.md"] + sorted(
        (root / "docs").glob("*.md"))


def expand_braces(token: str):
    """`a-{1,2}-{x,y}.json` -> the four names; no brace: the token itself."""
    parts = re.split(r"(\{[^{}]*\})", token)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def result_citations(root: Path):
    """(doc, line, problem) for every bad citation, and the set of files cited."""
    problems, cited = [], set()
    for doc in citing_docs(root):
        if not doc.exists():
            continue
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(root)}:{n}"
            problems += [(where, f"glob in a citation: {m.group(0)}") for m in GLOB.finditer(line)]
            for m in CITATION.finditer(line):
                for name in expand_braces(m.group(1)):
                    path = root / RESULTS / name
                    if not path.is_file():
                        problems.append((where, f"cited, not a file: {RESULTS}/{name}"))
                    cited.add(f"{RESULTS}/{name}")
    return problems, cited


def check_results(root: Path):
    problems, cited = result_citations(root)
    kept = {p.relative_to(root).as_posix() for p in (root / RESULTS).rglob("*") if p.is_file()}
    problems += [(f, "kept, never cited") for f in sorted(kept - cited)]
    return problems


def test_every_cited_result_exists_and_every_result_is_cited():
    assert check_results(ROOT) == []


def test_the_results_check_can_fail(tmp_path):
    """A doc citing a missing file, a glob, and a result file nobody cites are each found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / RESULTS / "sub").mkdir(parents=True)
    for name in ("a-1.json", "a-2.json", "sub/b.json", "uncited.json"):
        (tmp_path / RESULTS / name).write_text("{}")
    (tmp_path / "README.md").write_text(
        "see `bench/results/a-{1,2}.json` and bench/results/sub/b.json, in bench/results/.\n")
    assert check_results(tmp_path) == [("bench/results/uncited.json", "kept, never cited")]
    (tmp_path / "docs" / "x.md").write_text("old: `bench/results/a-{2,3}.json`\nall: `bench/results/*.json`\n")
    assert check_results(tmp_path) == [
        ("docs/x.md:1", "cited, not a file: bench/results/a-3.json"),
        ("docs/x.md:2", "glob in a citation: bench/results/*.json"),
        ("bench/results/uncited.json", "kept, never cited")]
