"""The library's import graph: test tooling (kvcopy.testing) stays out of it.

References, fuzzers and oracles live in ``kvcopy.testing``. Nothing under ``kvcopy/``
outside that package imports it, except the benchmark CLI (``kvcopy.bench``), which
checks the copies it times against the reference. Checked statically over every
module (every ``import`` statement, at any depth, and ``importlib.import_module`` /
``__import__`` of a constant name) and at run time (importing the library's modules
in a fresh interpreter loads no ``kvcopy.testing`` module).
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcopy"
TOOLING = "kvcopy.testing"
MAY_IMPORT_TOOLING = ("kvcopy.testing", "kvcopy.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_modules(path: Path):
    """Every module name ``path`` imports: absolute, relative (resolved), at any depth."""
    name = _module_name(path)
    package = name if _is_package(path) else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from kvcopy import testing` imports a module too
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def library_modules():
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not _module_name(p).startswith(MAY_IMPORT_TOOLING)]


def importable_library_modules():
    """Library modules to import in a test (``kvcopy.__main__`` runs the CLI)."""
    return [_module_name(p) for p in library_modules() if p.name != "__main__.py"]


def _imports_tooling(module: str) -> bool:
    return module == TOOLING or module.startswith(TOOLING + ".")


def test_no_library_module_imports_test_tooling():
    offenders = [f"{p.relative_to(ROOT)}:{line}: imports {module}"
                 for p in library_modules() for line, module in imported_modules(p) if _imports_tooling(module)]
    assert not offenders, "\n".join(offenders)


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The check can fail: each way of importing the tooling is found."""
    pkg = tmp_path / "kvcopy" / "nixl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    sources = {
        "a.py": "from ..testing import cases\n",
        "b.py": "import kvcopy.testing.reference\n",
        "c.py": "def f():\n    from kvcopy.testing.nixl import oracle\n",
        "d.py": "import importlib\nimportlib.import_module('kvcopy.testing.nixl.fuzz')\n",
        "e.py": "from kvcopy import testing\n",
        "f.py": "from .. import testing\n",
    }
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for name, text in sources.items():
        (pkg / name).write_text(text)
        found = [m for _, m in imported_modules(pkg / name) if _imports_tooling(m)]
        assert found, name
    (pkg / "g.py").write_text("from ..layout import as_words\nimport kvcopy.testbed\n")
    assert not [m for _, m in imported_modules(pkg / "g.py") if _imports_tooling(m)]


def test_importing_the_library_loads_no_test_tooling():
    """Every library module importable here, in a fresh interpreter: no module of
    kvcopy.testing is loaded on the way (the kvcopy.vllm* modules need vLLM: imported where it is)."""
    names = importable_library_modules()
    script = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "skipped = []\n"
        "for n in names:\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except ImportError as exc:\n"
        "        if not n.startswith('kvcopy.vllm'):\n"
        "            raise\n"
        "        skipped.append(n)\n"
        "loaded = sorted(m for m in sys.modules if m == 'kvcopy.testing' or m.startswith('kvcopy.testing.'))\n"
        "print(len(names) - len(skipped), loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = out.stdout.strip().split(" ", 1)
    vllm_modules = [n for n in names if n.startswith("kvcopy.vllm")]
    assert int(count) >= len(names) - len(vllm_modules) and loaded == "[]", out.stdout


@pytest.mark.parametrize("name", ["reference_copy", "reference_copy_groups"])
def test_the_public_api_is_what_a_user_calls(name):
    import kvcopy
    import kvcopy.nixl

    assert name not in kvcopy.__all__ and not hasattr(kvcopy, name)
    for tool in ("replay", "select_pages"):
        assert tool not in kvcopy.nixl.__all__ and not hasattr(kvcopy.nixl, tool)
    assert set(kvcopy.__all__) == {"BACKENDS", "BlockCopier", "PageLayout", "available_backends", "copy_blocks",
                                   "describe"}
    from kvcopy.testing import reference

    assert callable(getattr(reference, name))
