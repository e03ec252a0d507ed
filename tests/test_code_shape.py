"""The library's shape limits (issue 20's re-layout): no module under ``kvcopy/`` over
600 lines and no function over 80, so each file reads top to bottom. Checked over
every module with ``ast``; a failure names the offenders."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvcopy"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_is_over_80_lines():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, long
