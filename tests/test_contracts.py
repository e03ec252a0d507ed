"""The contracts of the tree, checked statically (``ast``, regex) and in one fresh interpreter.

* Layers: which kvcopy module may import which (the copy core imports no ``kvcopy.nixl``,
  ``kvcopy.vllm``, ``kvcopy.offload``; the library imports no test tooling or benchmark;
  inside ``kvcopy.nixl`` engine geometry < planning < wire formats < buffer modes < the
  manager), and no import cycle at module level.
* No private name imported across packages; no re-export shim (``noqa: F401`` outside an
  ``__init__.py``); only the public packages' ``__init__.py`` bind names.
* One place for ctypes (``kvcopy/native.py``); no exported C function with 8 or more
  parameters; the entry-table width defined once, and no comment stating another.
* Config: no option field defined in two ``*Options`` classes; every ``KVCOPY_*``
  variable read in one module only.
* Shape: at most 6 top-level modules in ``kvcopy/``.

Each check has a planted case showing that it can fail. ``KNOWN`` holds the violations
the tree still has while it is restructured: a check fails on a new violation, and on a
known one that is gone (remove it from ``KNOWN``), so the sets only shrink.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcopy"
TOOLING = ("kvcopy.testing", "kvcopy.bench")


# ------------------------------------------------------------------ walking the tree
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(path: Path, root: Path = ROOT) -> str:
    """The package a file belongs to: itself for an ``__init__.py``, else its folder's."""
    name = module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def kvcopy_modules(root: Path = ROOT) -> List[Path]:
    # rglob does not follow kvcopy/kernels (a link to ../kernels): the kernels are not Python layers
    return sorted((root / "kvcopy").rglob("*.py"))


def is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imported_modules(path: Path, root: Path = ROOT, top_level_only: bool = False,
                     from_base: bool = True) -> Iterator[Tuple[int, str]]:
    """Every module name ``path`` imports: absolute, relative (resolved), at any depth
    (``top_level_only``: outside functions), and ``importlib.import_module`` /
    ``__import__`` of a constant name. ``from_base=False``: for ``from a.b import c``
    only ``a.b.c``, which :func:`existing_module` resolves to the module or package."""
    package = package_of(path, root)
    tree = ast.parse(path.read_text(), str(path))
    nodes = _top_level_nodes(tree) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _resolved(node, package)
            if from_base:
                yield node.lineno, module
            for alias in node.names:  # `from kvcopy import testing` imports a module too
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if called in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def _resolved(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Statements run at import: module body, class bodies, if/try blocks; not functions.
    ``if TYPE_CHECKING:`` blocks are skipped (never run)."""
    todo: List[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        yield node
        if isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        if isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def existing_module(name: str, root: Path = ROOT) -> str:
    """The longest prefix of ``name`` that is a module or package file under ``root``
    (``kvcopy.nixl.planning.plan.Plan`` -> ``kvcopy.nixl.planning.plan``), or ``""``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts[:n])
    return ""


def kvcopy_imports(path: Path, root: Path = ROOT, top_level_only: bool = False) -> Set[str]:
    """The kvcopy modules ``path`` imports (names resolved to module files)."""
    out = set()
    for _, name in imported_modules(path, root, top_level_only, from_base=False):
        if is_within(name, "kvcopy"):
            mod = existing_module(name, root)
            if mod:
                out.add(mod)
    return out


# ------------------------------------------------------------------ 1. layers
CHECKS = {"kvcopy.checks", "kvcopy.msgpack_shape"}
NATIVE = {"kvcopy.checks", "kvcopy.kernels", "kvcopy.native"}
CORE_DATA = NATIVE | {"kvcopy.core.layout", "kvcopy.core.storages", "kvcopy.core.tables", "kvcopy.core.checksum",
                      "kvcopy.core.options"}
COPY_BACKENDS = CORE_DATA | {"kvcopy.copy_backends"}
COPY_CORE = COPY_BACKENDS | {"kvcopy.core.planner", "kvcopy.core.aliasing", "kvcopy.core.copier", "kvcopy.core.copy_op",
                             "kvcopy.ops"}
OFFLOAD = COPY_CORE | {"kvcopy.offload"}
NIXL = COPY_CORE | {"kvcopy.nixl"}
LIBRARY = OFFLOAD | NIXL | {"kvcopy", "kvcopy.msgpack_shape", "kvcopy.vllm"}

# module prefix -> the kvcopy modules (prefixes) it may import; the longest prefix decides
LAYERS: Dict[str, Set[str]] = {
    "kvcopy": LIBRARY,
    "kvcopy.__main__": {"kvcopy.bench"},
    "kvcopy.checks": set(),
    "kvcopy.msgpack_shape": set(),
    "kvcopy.kernels": set(),
    "kvcopy.native": {"kvcopy.checks", "kvcopy.kernels", "kvcopy.native"},
    "kvcopy.core.layout": CORE_DATA,
    "kvcopy.core.storages": CORE_DATA,
    "kvcopy.core.tables": CORE_DATA,
    "kvcopy.core.checksum": CORE_DATA,
    "kvcopy.core.options": CHECKS,
    "kvcopy.copy_backends": COPY_BACKENDS,
    "kvcopy.core.planner": COPY_CORE,
    "kvcopy.core.aliasing": COPY_CORE,
    "kvcopy.core.copier": COPY_CORE,
    "kvcopy.core.copy_op": COPY_CORE,
    "kvcopy.ops": COPY_CORE,
    "kvcopy.offload": OFFLOAD,
    "kvcopy.nixl": NIXL,
    "kvcopy.vllm": LIBRARY,
    "kvcopy.testing": LIBRARY | {"kvcopy.testing"},
    "kvcopy.bench": LIBRARY | {"kvcopy.testing", "kvcopy.bench"},
}

# Inside kvcopy.nixl: a module imports no module of a higher rank. Engine geometry (no bytes
# on the wire) < planning < wire formats < the agent and per-pull values < buffer modes <
# the manager and its records.
NIXL_RANKS: Dict[str, int] = {
    "kvcopy.nixl.engine": 0,
    "kvcopy.nixl.planning": 1,
    "kvcopy.nixl.wire": 2,
    "kvcopy.nixl.agent": 3, "kvcopy.nixl.options": 3, "kvcopy.nixl.pull": 3, "kvcopy.nixl.sum_check": 3,
    "kvcopy.nixl.peer_load": 3,
    "kvcopy.nixl.modes": 4,
    "kvcopy.nixl.ledger": 5, "kvcopy.nixl.late_reads": 5, "kvcopy.nixl.manager": 5, "kvcopy.nixl": 5,
}

def _rule(name: str, table: Dict[str, object]):
    best = max((p for p in table if is_within(name, p)), key=len, default=None)
    return None if best is None else table[best]


def layer_violations(root: Path = ROOT) -> Set[str]:
    out = set()
    for path in kvcopy_modules(root):
        name = module_name(path, root)
        allowed = _rule(name, LAYERS)
        assert allowed is not None, f"{name} is in no layer of LAYERS"
        rank = _rule(name, NIXL_RANKS)
        for mod in kvcopy_imports(path, root):
            if is_within(mod, name) and path.name == "__init__.py" or mod == name:
                continue  # a package importing its own modules
            if not any(is_within(mod, a) for a in allowed):  # type: ignore[union-attr]
                out.add(f"{name} -> {mod}")
            elif rank is not None and is_within(mod, "kvcopy.nixl") and _rule(mod, NIXL_RANKS) > rank:
                out.add(f"{name} -> {mod}")
    return out


def test_each_layer_imports_only_the_layers_below_it():
    assert layer_violations() == set()


def test_every_nixl_module_has_a_rank():
    """Each module of kvcopy.nixl is ranked by its own entry or its subpackage's, never by
    the package's fallback (a new top-level module of kvcopy.nixl must be placed)."""
    unranked = [name for p in kvcopy_modules() if is_within(name := module_name(p), "kvcopy.nixl")
                and name not in NIXL_RANKS and name.rpartition(".")[0] not in NIXL_RANKS]
    assert unranked == []


def test_the_layer_check_can_fail(tmp_path):
    pkg = tmp_path / "kvcopy"
    (pkg / "nixl" / "planning").mkdir(parents=True)
    (pkg / "core").mkdir()
    for name in ("__init__.py", "nixl/__init__.py", "nixl/planning/__init__.py", "nixl/manager.py",
                 "core/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "core" / "copier.py").write_text("def f():\n    from ..nixl import manager\n")
    (pkg / "nixl" / "planning" / "plan.py").write_text("from .. import manager\n")
    assert layer_violations(tmp_path) == {"kvcopy.core.copier -> kvcopy.nixl.manager",
                                          "kvcopy.nixl.planning.plan -> kvcopy.nixl.manager"}


def test_the_walk_sees_every_kind_of_import(tmp_path):
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
    for name, text in sources.items():
        (pkg / name).write_text(text)
        found = [m for _, m in imported_modules(pkg / name, tmp_path) if is_within(m, "kvcopy.testing")]
        assert found, name
    (pkg / "g.py").write_text("from ..layout import as_words\nimport kvcopy.testbed\n")
    assert not [m for _, m in imported_modules(pkg / "g.py", tmp_path) if is_within(m, "kvcopy.testing")]


def test_importing_the_library_loads_no_test_tooling():
    """Every library module importable here, in a fresh interpreter: no module of
    kvcopy.testing or kvcopy.bench is loaded on the way (kvcopy.vllm needs vLLM:
    imported where it is)."""
    names = [module_name(p) for p in kvcopy_modules()
             if not any(is_within(module_name(p), t) for t in TOOLING) and p.name != "__main__.py"]
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
        f"loaded = sorted(m for m in sys.modules if any(m == t or m.startswith(t + '.') for t in {TOOLING!r}))\n"
        "print(len(names) - len(skipped), loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = out.stdout.strip().split(" ", 1)
    vllm_modules = [n for n in names if n.startswith("kvcopy.vllm")]
    assert int(count) >= len(names) - len(vllm_modules) and loaded == "[]", out.stdout


def import_cycles(root: Path = ROOT) -> List[List[str]]:
    """Strongly connected components (size > 1, or a self-import) of the module-level
    import graph of kvcopy/ (Tarjan)."""
    graph = {module_name(p, root): {m for m in kvcopy_imports(p, root, top_level_only=True)}
             for p in kvcopy_modules(root)}
    for name, deps in graph.items():  # importing a.b.c runs a/__init__ and a/b/__init__ too
        graph[name] = {d for d in deps if d != name and d in graph}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_at_module_level():
    assert import_cycles() == []


def test_the_cycle_check_can_fail(tmp_path):
    pkg = tmp_path / "kvcopy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from .a import x\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    assert import_cycles(tmp_path) == [["kvcopy.a", "kvcopy.b"]]


def test_real_vllm_is_imported_only_by_the_vllm_layer_and_test_tooling():
    out = []
    for path in kvcopy_modules():
        name = module_name(path)
        if any(is_within(name, p) for p in VLLM_IMPORTERS):
            continue
        out += [f"{name}:{line}" for line, mod in imported_modules(path) if is_within(mod, "vllm")]
    assert out == []


VLLM_IMPORTERS = ("kvcopy.vllm", "kvcopy.testing")


# ------------------------------------------------------------------ 2. private names
def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _owner_package(full: str, root: Path) -> str:
    """The package defining the first private component of ``full``."""
    comps = full.split(".")
    first = next(i for i, c in enumerate(comps) if _private(c))
    owner = ".".join(comps[:first])
    return owner if (root.joinpath(*owner.split(".")) / "__init__.py").is_file() else owner.rpartition(".")[0]


def private_imports(paths: List[Path], root: Path = ROOT) -> Set[str]:
    """Imports of a private kvcopy name (module or attribute) defined in another package,
    and attribute reads ``mod._x`` of a kvcopy module of another package bound by import."""
    out = set()
    for path in paths:
        here = package_of(path, root) if is_within(module_name(path, root), "kvcopy") else ""
        where = path.relative_to(root)
        modules: Dict[str, str] = {}  # local name -> kvcopy module it is bound to
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = _resolved(node, package_of(path, root))
                if is_within(mod, "kvcopy") and any(_private(c) for c in mod.split(".")) \
                        and _owner_package(mod, root) != here:
                    out.add(f"{where}: {mod}")
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    if existing_module(full, root) == full:
                        modules[a.asname or a.name] = full
                    if is_within(full, "kvcopy") and any(_private(c) for c in full.split(".")) \
                            and _owner_package(full, root) != here:
                        out.add(f"{where}: {full}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and existing_module(a.name, root) == a.name:
                        modules[a.asname] = a.name
                    if is_within(a.name, "kvcopy") and any(_private(c) for c in a.name.split(".")) \
                            and _owner_package(a.name, root) != here:
                        out.add(f"{where}: {a.name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr) \
                    and node.value.id in modules:
                mod = modules[node.value.id]
                owner = mod if (root.joinpath(*mod.split(".")) / "__init__.py").is_file() else mod.rpartition(".")[0]
                if is_within(mod, "kvcopy") and owner != here:
                    out.add(f"{where}: {mod}.{node.attr}")
    return out


def test_no_private_name_is_imported_across_packages():
    paths = kvcopy_modules() + sorted((ROOT / "bench").glob("*.py"))
    assert private_imports(paths) == set()


def test_no_test_imports_a_private_module_of_the_library():
    """Tests may test a module's private names, never a private module (``kvcopy.nixl._agent``
    became the public ``kvcopy.nixl.agent``)."""
    found = {f for f in private_imports(sorted((ROOT / "tests").rglob("*.py")))
             if any(_private(c) for c in f.split(": ")[1].split(".")[:-1])}
    assert found == set()


def test_the_private_check_can_fail(tmp_path):
    for name in ("kvcopy/__init__.py", "kvcopy/nixl/__init__.py", "kvcopy/nixl/_secret.py", "kvcopy/bench/__init__.py",
                 "kvcopy/copy_backends/__init__.py", "kvcopy/copy_backends/cpu.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "kvcopy/bench/a.py").write_text(
        "from ..nixl._secret import make_agent\nfrom ..copy_backends import cpu\nx = cpu._piece_bytes\n")
    (tmp_path / "kvcopy/nixl/b.py").write_text("from ._secret import make_agent\n")
    assert private_imports(sorted((tmp_path / "kvcopy").rglob("*.py")), tmp_path) == {
        "kvcopy/bench/a.py: kvcopy.nixl._secret", "kvcopy/bench/a.py: kvcopy.nixl._secret.make_agent",
        "kvcopy/bench/a.py: kvcopy.copy_backends.cpu._piece_bytes"}


# ------------------------------------------------------------------ 3. shims and package APIs
PUBLIC_PACKAGES = {"kvcopy", "kvcopy.nixl", "kvcopy.vllm", "kvcopy.copy_backends", "kvcopy.bench",
                   "kvcopy.testing", "kvcopy.kernels"}


def shims(root: Path = ROOT) -> Set[str]:
    return {str(p.relative_to(root)) for p in kvcopy_modules(root)
            if p.name != "__init__.py" and "noqa: F401" in p.read_text()}


def test_no_reexport_shim():
    """A name is imported from the module that defines it; an optional dependency is probed
    with importlib, never with an unused import kept by ``noqa: F401``."""
    assert shims() == set()


def test_the_shim_check_can_fail(tmp_path):
    (tmp_path / "kvcopy").mkdir()
    (tmp_path / "kvcopy/a.py").write_text("from .b import c  # noqa: F401\n")
    (tmp_path / "kvcopy/__init__.py").write_text("from .b import c  # noqa: F401\n")
    assert shims(tmp_path) == {"kvcopy/a.py"}


def binding_inits(root: Path = ROOT) -> Set[str]:
    """``__init__.py`` files of non-public packages holding more than a docstring."""
    out = set()
    for p in kvcopy_modules(root):
        if p.name != "__init__.py" or module_name(p, root) in PUBLIC_PACKAGES:
            continue
        body = ast.parse(p.read_text()).body
        rest = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        if rest:
            out.add(module_name(p, root))
    return out


def test_only_public_packages_bind_names_in_their_init():
    assert binding_inits() == set()


def test_the_init_check_can_fail(tmp_path):
    (tmp_path / "kvcopy/nixl/engine").mkdir(parents=True)
    (tmp_path / "kvcopy/nixl/__init__.py").write_text("from .a import b\n")
    (tmp_path / "kvcopy/nixl/engine/__init__.py").write_text('"""Doc."""\nfrom .a import b\n')
    assert binding_inits(tmp_path) == {"kvcopy.nixl.engine"}


NIXL_ALL_MAX = 15


def test_the_nixl_package_api_is_small_and_every_exported_name_resolves():
    import importlib

    for pkg in ("kvcopy", "kvcopy.nixl", "kvcopy.testing"):
        mod = importlib.import_module(pkg)
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert missing == [], (pkg, missing)
    import kvcopy.nixl

    assert len(kvcopy.nixl.__all__) <= NIXL_ALL_MAX, kvcopy.nixl.__all__


# ------------------------------------------------------------------ 4. one place for ctypes
CTYPES_HOME = "kvcopy/native.py"
# bench/offload_bench.py compiles and declares its own C memcpy loop: vLLM's baseline, not kvcopy's ABI
CTYPES_ALLOWED = {"bench/offload_bench.py"}
CTYPES_CALLS = {"CDLL", "LoadLibrary", "CFUNCTYPE", "PyDLL"}


def ctypes_uses(paths: List[Path], root: Path = ROOT) -> Set[str]:
    out = set()
    for path in paths:
        rel = str(path.relative_to(root))
        if rel == CTYPES_HOME or rel in CTYPES_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out |= {f"{rel}: {sub.attr}" for t in targets for sub in ast.walk(t)
                        if isinstance(sub, ast.Attribute) and sub.attr in ("argtypes", "restype")}
            elif isinstance(node, ast.Call):
                fn = node.func
                called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if called in CTYPES_CALLS:
                    out.add(f"{rel}: {called}")
            elif isinstance(node, ast.ClassDef):
                if any(ast.unparse(b).split(".")[-1] in ("Structure", "Union") for b in node.bases):
                    out.add(f"{rel}: Structure")
    return out


# Not kvcopy's ABI, each with its reason.
ALLOWED_CTYPES = {
    "tests/copy_backends/test_cpu.py: CDLL": "libc's mprotect, to fault a page under the copy",
    "tests/copy_backends/test_cpu.py: argtypes": "libc's mprotect",
    "tests/copy_backends/test_cuda_backend.py: CFUNCTYPE": "Python callbacks recording what a launch is passed",
}


def _ctypes_scope() -> List[Path]:
    return kvcopy_modules() + sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))


def test_ctypes_is_declared_in_one_module():
    assert ctypes_uses(_ctypes_scope()) == set(ALLOWED_CTYPES)


def test_the_ctypes_check_can_fail(tmp_path):
    (tmp_path / "kvcopy").mkdir()
    (tmp_path / "kvcopy/a.py").write_text(
        "import ctypes\nlib = ctypes.CDLL('x')\nlib.f.argtypes = []\n"
        "class S(ctypes.Structure):\n    pass\nT = ctypes.CFUNCTYPE(None)\n")
    assert ctypes_uses([tmp_path / "kvcopy/a.py"], tmp_path) == {
        "kvcopy/a.py: CDLL", "kvcopy/a.py: argtypes", "kvcopy/a.py: Structure", "kvcopy/a.py: CFUNCTYPE"}


# ------------------------------------------------------------------ 5. the native boundary's numbers
MAX_C_PARAMS = 7
EXTERN_BLOCK = re.compile(r'extern "C" \{(.*?)\}\s*//\s*extern "C"', re.S)
C_FUNCTION = re.compile(r"^[A-Za-z_][\w\s\*:<>]*?\b(kvcopy_\w+)\s*\(([^)]*)\)\s*(?:noexcept\s*)?\{", re.M)


def exported_c_functions(root: Path = ROOT) -> Dict[str, int]:
    """``kvcopy_*`` functions defined in the ``extern "C"`` blocks of csrc/: name -> parameters."""
    out = {}
    for f in sorted((root / "csrc").glob("*")):
        if f.suffix not in (".cpp", ".cu", ".h"):
            continue
        for block in EXTERN_BLOCK.finditer(f.read_text()):
            for fm in C_FUNCTION.finditer(block.group(1)):
                args = [a for a in fm.group(2).replace("\n", " ").split(",") if a.strip() and a.strip() != "void"]
                out[fm.group(1)] = len(args)
    return out


def test_no_exported_c_function_takes_8_or_more_parameters():
    functions = exported_c_functions()
    assert len(functions) >= 30, functions
    assert {f: n for f, n in functions.items() if n > MAX_C_PARAMS} == {}


def test_every_exported_c_function_has_its_signature_in_native_and_the_reverse():
    from kvcopy import native

    declared = {name: len(args) for sig in native.SIGNATURES.values() for name, (_, args) in sig.items()}
    assert declared == exported_c_functions()


ABI_STRUCT = re.compile(r"typedef struct \{(.*?)\} (kvcopy_\w+);", re.S)
STRUCT_FIELD = re.compile(r"^\s*(?:const\s+)?\w+\s*\*?\s*(\w+);", re.M)


def abi_structs(root: Path = ROOT) -> Dict[str, List[str]]:
    """csrc/kvcopy_abi.h: struct name -> its field names, in order."""
    text = (root / "csrc" / "kvcopy_abi.h").read_text()
    return {m.group(2): STRUCT_FIELD.findall(m.group(1)) for m in ABI_STRUCT.finditer(text)}


def test_the_option_structs_mirror_kvcopy_abi_h_field_by_field():
    import ctypes

    from kvcopy import native

    structs = abi_structs()
    assert len(structs) >= 8, structs
    assert {name: [f for f, _ in cls._fields_] for name, cls in native.ABI_STRUCTS.items()} == structs
    assert all(ctypes.sizeof(cls) == 8 * len(structs[name]) for name, cls in native.ABI_STRUCTS.items())


def test_the_struct_parse_can_fail(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc/kvcopy_abi.h").write_text(
        "typedef struct {\n  int64_t struct_bytes;\n  const int64_t* entries;\n  uint64_t* values;\n} kvcopy_x;\n")
    assert abi_structs(tmp_path) == {"kvcopy_x": ["struct_bytes", "entries", "values"]}


def test_the_c_parse_can_fail(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc/a.cpp").write_text(
        'extern "C" {\nint kvcopy_a(int a, const int64_t* b) {\n  return 0;\n}\n'
        'int64_t kvcopy_b(void) { return 1; }\n}  // extern "C"\n')
    assert exported_c_functions(tmp_path) == {"kvcopy_a": 2, "kvcopy_b": 0}


# A definition gives the width a value (a number, or a constexpr of one); passing it on
# (``ENTRY_FIELDS=self.entry_fields``, ``kEntryFields = KVCOPY_ENTRY_FIELDS``) is not one.
WIDTH_DEFINITION = re.compile(
    r"^\s*((ENTRY_FIELDS|kEntryFields)\s*=\s*(\d|tl\.constexpr\(\d)|.*tl\.constexpr\(\d+\)"
    r"|#\s*define\s+KVCOPY_ENTRY_FIELDS\b)")
WIDTH_HOME = "kernels/entry_layout.cuh"
STATED_WIDTH = re.compile(r"\[E\]\[(\d+)\]|\[E, ?(\d+)\]|\bE x (\d+)\b")
ENTRY_WIDTH = 20


def _width_files(root: Path) -> List[Path]:
    files = list((root / "kvcopy").rglob("*.py")) + list((root / "kernels").glob("*")) + list((root / "csrc").glob("*"))
    return sorted(p for p in files if p.is_file() and p.suffix in (".py", ".cuh", ".h", ".cu", ".cpp"))


def width_definitions(root: Path = ROOT) -> Tuple[Set[str], Set[str]]:
    """(places defining the entry width outside its home, lines stating another width)."""
    defs, stale = set(), set()
    for p in _width_files(root):
        rel = str(p.relative_to(root))
        for line in p.read_text(errors="replace").splitlines():
            if WIDTH_DEFINITION.search(line) and "ENTRY" in line.upper() and rel != WIDTH_HOME:
                defs.add(rel)
            m = STATED_WIDTH.search(line)
            if m and int(next(g for g in m.groups() if g)) != ENTRY_WIDTH:
                stale.add(rel)
    return defs, stale


def test_the_entry_width_is_defined_once_and_stated_right():
    assert width_definitions() == (set(), set())
    from kvcopy import native

    assert native.ENTRY_FIELDS == ENTRY_WIDTH  # read from its home, kernels/entry_layout.cuh


def test_the_width_check_can_fail(tmp_path):
    (tmp_path / "kvcopy").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kvcopy/t.py").write_text("ENTRY_FIELDS = 20\n# entries [E][16]\n")
    (tmp_path / "kernels/entry_layout.cuh").write_text("#define KVCOPY_ENTRY_FIELDS 20\n// [E][20]\n")
    assert width_definitions(tmp_path) == ({"kvcopy/t.py"}, {"kvcopy/t.py"})


# ------------------------------------------------------------------ 6. config
def option_fields(root: Path = ROOT) -> Dict[str, Set[str]]:
    """Field name -> the ``*Options`` classes (library only) whose body defines it."""
    owners: Dict[str, Set[str]] = defaultdict(set)
    for p in kvcopy_modules(root):
        if any(is_within(module_name(p, root), t) for t in TOOLING):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Options"):
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) \
                            and not st.target.id.isupper():
                        owners[st.target.id].add(node.name)
    return owners


KNOWN_TWICE: Set[str] = set()


def test_no_option_field_is_defined_twice():
    twice = {f for f, c in option_fields().items() if len(c) > 1}
    assert twice == KNOWN_TWICE, sorted(twice ^ KNOWN_TWICE)


def test_the_field_check_can_fail(tmp_path):
    (tmp_path / "kvcopy").mkdir()
    (tmp_path / "kvcopy/a.py").write_text(
        "class AOptions:\n    x: int = 1\n    LIMIT: int = 2\n"
        "class BOptions(AOptions):\n    x: int = 2\n    y: int = 0\n")
    assert {f: c for f, c in option_fields(tmp_path).items() if len(c) > 1} == {"x": {"AOptions", "BOptions"}}


# os.environ / os.getenv, and kvcopy.checks.env_int / env_flag (the readers that name the variable)
ENV_READ = re.compile(r"""(?:environ\.get|getenv|environ\[|env_int|env_flag)\(?\s*["'](KVCOPY_\w+)["']""")


def env_readers(root: Path = ROOT) -> Dict[str, Set[str]]:
    """``KVCOPY_*`` variable -> the library modules reading it."""
    out: Dict[str, Set[str]] = defaultdict(set)
    for p in kvcopy_modules(root):
        if any(is_within(module_name(p, root), t) for t in TOOLING):
            continue
        for m in ENV_READ.finditer(p.read_text()):
            out[m.group(1)].add(module_name(p, root))
    return out


def test_each_environment_variable_is_read_in_one_module():
    readers = env_readers()
    assert len(readers) >= 10, readers
    many = {v: sorted(m) for v, m in readers.items() if len(m) > 1}
    assert many == {}, many


def test_the_environment_check_can_fail(tmp_path):
    (tmp_path / "kvcopy").mkdir()
    (tmp_path / "kvcopy/a.py").write_text('import os\nos.environ.get("KVCOPY_X")\n')
    (tmp_path / "kvcopy/b.py").write_text('import os\nos.getenv("KVCOPY_X", "1")\n')
    assert env_readers(tmp_path) == {"KVCOPY_X": {"kvcopy.a", "kvcopy.b"}}


# ------------------------------------------------------------------ 7. shape
TOP_LEVEL_MAX = 6
KNOWN_TOP_LEVEL: Set[str] = set()


def test_kvcopy_has_at_most_6_top_level_modules():
    top = {p.stem for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    if len(KNOWN_TOP_LEVEL) > TOP_LEVEL_MAX:
        assert top == KNOWN_TOP_LEVEL, sorted(top ^ KNOWN_TOP_LEVEL)
    else:
        assert len(top) <= TOP_LEVEL_MAX, sorted(top)



@pytest.mark.parametrize("name", ["reference_copy", "reference_copy_groups"])
def test_the_public_api_is_what_a_user_calls(name):
    import kvcopy
    import kvcopy.nixl

    assert name not in kvcopy.__all__ and not hasattr(kvcopy, name)
    for tool in ("replay", "select_pages"):
        assert tool not in kvcopy.nixl.__all__ and not hasattr(kvcopy.nixl, tool)
    assert set(kvcopy.__all__) == {"COPY_BACKENDS", "BlockCopier", "PageLayout", "available_copy_backends",
                                   "copy_blocks", "describe"}
    from kvcopy.testing import reference

    assert callable(getattr(reference, name))
