"""Finding and loading kvcopy's native libraries (ctypes, C ABI).

``setup.py`` builds them with CMake into ``kvcopy/_lib/``, beside a record of what
it built and why not (``build-info.json``, read by :func:`build_info`); a source
checkout can build them in place with ``python setup.py build_ext --inplace`` or
``pip install -e .``. ``KVCOPY_LIB_DIR`` points elsewhere (a build tree). A library
that is missing is a reason a backend is unavailable, never an import error; the
reason says whether the install skipped it (and why) or it went missing since. So is
a library built from other sources than this Python code: each exports
``<stem>_abi_version()``, bumped whenever one of its C signatures changes or its results
do (a new checksum term), and a library whose version is not :data:`ABI_VERSIONS`' is
refused (calling it with the new signatures would pass the wrong arguments, or trust
sums computed another way).
"""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

LIB_DIR = Path(__file__).resolve().parent / "_lib"
BUILD_INFO = LIB_DIR / "build-info.json"

# The ABI version (``<stem>_abi_version()``) this Python code calls each library with.
ABI_VERSIONS = {"kvcopy_cpu": 12, "kvcopy_cuda": 3}

_loaded: Dict[str, Tuple[Optional[ctypes.CDLL], Optional[str]]] = {}


def _candidates(stem: str) -> List[Path]:
    dirs = [Path(p) for p in os.environ.get("KVCOPY_LIB_DIR", "").split(os.pathsep) if p]
    dirs.append(LIB_DIR)
    return [d / f"lib{stem}.so" for d in dirs]


def find(stem: str) -> Optional[Path]:
    """The file :func:`load` would load for ``stem``, or None when there is none."""
    return next((p for p in _candidates(stem) if p.is_file()), None)


def load(stem: str) -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """``(library, None)``, or ``(None, why not)``; cached per process."""
    if stem not in _loaded:
        tried = _candidates(stem)
        found = find(stem)
        if found is None:
            _loaded[stem] = (None, missing_reason(stem, tried))
        else:
            try:
                _loaded[stem] = _checked(ctypes.CDLL(str(found)), stem, found)
            except OSError as exc:
                _loaded[stem] = (None, f"cannot load {found}: {exc}")
    return _loaded[stem]


def _checked(lib: ctypes.CDLL, stem: str, path: Path) -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """``(lib, None)`` when its ABI version is the one expected, else ``(None, why)``."""
    want = ABI_VERSIONS.get(stem)
    if want is None:
        return lib, None
    fn = getattr(lib, f"{stem}_abi_version", None)
    if fn is None:
        return None, f"{path} has no {stem}_abi_version: built from older sources; rebuild with `pip install -e .`"
    fn.restype, fn.argtypes = ctypes.c_int, []
    got = int(fn())
    if got != want:
        return None, (f"{path} has ABI version {got}, this kvcopy needs {want}: built from other sources; "
                      "rebuild with `pip install -e .` (or `python setup.py build_ext --inplace`)")
    return lib, None


def build_info() -> Optional[dict]:
    """The install's record of what it built (``kvcopy/_lib/build-info.json``), or None
    where there is none (libraries built by hand, or an install older than the record)."""
    try:
        return json.loads(BUILD_INFO.read_text())
    except (OSError, ValueError):
        return None


def build_note(stem: str) -> str:
    """One phrase on ``lib{stem}.so``: there, or not built at install and why."""
    entry = ((build_info() or {}).get("libraries") or {}).get(stem)
    present = next((p for p in _candidates(stem) if p.is_file()), None)
    if present is not None:
        how = "built at install" if entry and entry.get("built") else "is built"
        return f"lib{stem}.so {how} ({present.parent})"
    if entry is None:
        return f"lib{stem}.so is not built (no install record {BUILD_INFO.name})"
    if entry.get("built"):
        return f"lib{stem}.so was built at install but is gone"
    return f"lib{stem}.so not built at install: {entry.get('reason') or 'no reason recorded'}"


def missing_reason(stem: str, tried: List[Path]) -> str:
    entry = ((build_info() or {}).get("libraries") or {}).get(stem)
    if entry is not None and not entry.get("built"):
        return f"{build_note(stem)} (`pip install -v .` shows the build)"
    return (f"{build_note(stem)}; looked in {', '.join(str(p.parent) for p in tried)}; build it with "
            "`pip install -v -e .` (CMake and a C++ compiler; nvcc for the CUDA library)")

