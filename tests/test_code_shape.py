"""The library's shape, as a warning: no module under ``kvcopy/`` over 600 lines and no
function over 80, so each file reads top to bottom. A module that grows past a limit is
a hint to look for its seam, not a failure: the contracts that fail are in
``tests/test_contracts.py``. pytest's summary lists the offenders."""
import ast
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvcopy"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def long_modules():
    return {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}


def long_functions():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    return long


def test_modules_over_600_lines_are_reported():
    long = long_modules()
    assert all(n > MAX_MODULE_LINES for n in long.values())
    if long:
        warnings.warn(UserWarning(f"modules over {MAX_MODULE_LINES} lines: {long}"), stacklevel=1)


def test_functions_over_80_lines_are_reported():
    long = long_functions()
    assert all(n > MAX_FUNCTION_LINES for n in long.values())
    if long:
        warnings.warn(UserWarning(f"functions over {MAX_FUNCTION_LINES} lines: {long}"), stacklevel=1)


def test_the_report_sees_a_long_module(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "b.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert long_modules() == {"a.py": MAX_MODULE_LINES + 1}
    assert long_functions() == {"b.py:1 f": MAX_FUNCTION_LINES + 1}
