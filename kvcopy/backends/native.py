"""Finding and loading kvcopy's native libraries (ctypes, C ABI).

``setup.py`` builds them with CMake next to this file (``kvcopy/_lib/``); a source
checkout can build them in place with ``python setup.py build_ext --inplace`` or
``pip install -e .``. ``KVCOPY_LIB_DIR`` points elsewhere (a build tree). A library
that is missing is a reason a backend is unavailable, never an import error.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

LIB_DIR = Path(__file__).resolve().parent.parent / "_lib"

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
            _loaded[stem] = (None, f"lib{stem}.so not built (looked in {', '.join(str(p.parent) for p in tried)}; "
                                   "run `pip install -e .` with a C++ compiler and CMake)")
        else:
            try:
                _loaded[stem] = (ctypes.CDLL(str(found)), None)
            except OSError as exc:
                _loaded[stem] = (None, f"cannot load {found}: {exc}")
    return _loaded[stem]


def plan_call_function(prefix: bool = False):
    """``kvcopy_plan_call`` from the host library (csrc/call_plan.cpp), or None.

    ``prefix=True``: ``kvcopy_plan_call_prefix``, which also writes the CUDA kernel's
    block prefix after the runs; None from a library built before it existed."""
    lib, _ = load("kvcopy_cpu")
    name = "kvcopy_plan_call_prefix" if prefix else "kvcopy_plan_call"
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None and fn.argtypes is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.restype = i64
        fn.argtypes = [i64] + [ptr] * 8 + [i64, i64, ptr, ptr]
    return fn
