"""kvcopy's native boundary: finding and loading its libraries, and every ctypes signature.

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

Every C function kvcopy calls through ctypes is declared here, and only here:
:data:`SIGNATURES` for kvcopy's two libraries (declared when :func:`load` loads one; a
library missing a symbol is out of date: rebuild), :func:`driver` for the CUDA driver
calls (``libcuda.so.1``), :func:`cudart` for the runtime torch loaded, the NVRTC
launcher's parameter structs, :func:`noop_function` (the overhead benchmark's stub) and
:func:`setns` (libc's, for the two-host benchmark's namespaces on Python 3.11).
:class:`CudaError` / :func:`check` turn a CUDA error code into an exception.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

LIB_DIR = Path(__file__).resolve().parent / "_lib"
BUILD_INFO = LIB_DIR / "build-info.json"

# The ABI version (``<stem>_abi_version()``) this Python code calls each library with
# (the rule for bumping it: csrc/kvcopy_abi.h).
ABI_VERSIONS = {"kvcopy_cpu": 13, "kvcopy_cuda": 4}

_loaded: Dict[str, Tuple[Optional[ctypes.CDLL], Optional[str]]] = {}

_vp, _i64, _int, _str = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
_P = ctypes.POINTER


# ------------------------------------------------------------------ the entry table's row
def _entry_layout() -> Tuple[int, Dict[str, int]]:
    """``KVCOPY_ENTRY_FIELDS`` and the ``EntryField`` columns of kernels/entry_layout.cuh,
    parsed strictly (a line that does not match the expected form is an error, not a
    guess)."""
    from .kernels import include_dir

    text = (include_dir() / "entry_layout.cuh").read_text()
    width = re.search(r"^#define KVCOPY_ENTRY_FIELDS (\d+)$", text, re.M)
    body = re.search(r"enum EntryField : int \{\n(.*?)\n\};", text, re.S)
    if width is None or body is None:
        raise ImportError("kernels/entry_layout.cuh: no KVCOPY_ENTRY_FIELDS or EntryField enum")
    columns = {}
    for line in body.group(1).splitlines():
        m = re.fullmatch(r"\s*k(\w+) = (\d+|KVCOPY_ENTRY_FIELDS),(?:\s*//.*)?", line)
        if m is None:
            raise ImportError(f"kernels/entry_layout.cuh: cannot read {line.strip()!r}")
        columns[m.group(1)] = int(width.group(1)) if m.group(2) == "KVCOPY_ENTRY_FIELDS" else int(m.group(2))
    return int(width.group(1)), columns


# ENTRY_FIELDS: int64 columns of an entry row; ENTRY_COLUMNS: EntryField name -> column
# ("SrcBase" -> 0, ..., "KeyStrides" -> 16).
ENTRY_FIELDS, ENTRY_COLUMNS = _entry_layout()


# ------------------------------------------------------------------ option structs (csrc/kvcopy_abi.h)
class _AbiStruct(ctypes.Structure):
    """A struct of csrc/kvcopy_abi.h: 8-byte fields, the first its own size. Build with
    :meth:`make`, which sets ``struct_bytes``."""

    @classmethod
    def make(cls, **fields):
        return cls(ctypes.sizeof(cls), **fields)


class Tables(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("entries", _vp), ("group_offsets", _vp), ("group_entries", _vp),
                ("entry_bytes_prefix", _vp), ("num_groups", _i64)]


class CpuTuning(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("num_threads", _i64), ("simd", _i64), ("stream_min_bytes", _i64),
                ("piece_bytes", _i64), ("piece_min_bytes", _i64)]


class Fold(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("gather", _vp), ("bounds", _vp), ("num_gather", _i64), ("starts", _vp),
                ("num_values", _i64), ("values", _vp), ("want", _vp)]


class PlanStatic(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("num_groups", _i64), ("src_limit", _vp), ("dst_limit", _vp),
                ("dst_class", _vp), ("num_classes", _i64), ("entries_per_group", _vp), ("dst_capacity", _i64)]


class Ranges(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("num_ranges", _i64), ("word_bytes", _i64)]


class CudaTables(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("tables", _vp), ("num_entries", _i64), ("num_groups", _i64),
                ("num_group_entries", _i64), ("word_bytes", _i64)]


class CudaCall(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("call_device", _vp), ("call_words", _i64), ("total_bytes", _i64),
                ("grid", _i64)]


class CeOptions(_AbiStruct):
    _fields_ = [("struct_bytes", _i64), ("src_is_host", _i64), ("dst_is_host", _i64), ("host_access_any", _i64),
                ("mode", _i64)]


# C struct name -> its mirror (the contracts test compares their fields with kvcopy_abi.h).
ABI_STRUCTS = {"kvcopy_tables": Tables, "kvcopy_cpu_tuning": CpuTuning, "kvcopy_fold": Fold,
               "kvcopy_plan_static": PlanStatic, "kvcopy_ranges": Ranges, "kvcopy_cuda_tables": CudaTables,
               "kvcopy_cuda_call": CudaCall, "kvcopy_ce_options": CeOptions}

# The per-call struct of a CUDA launch, packed in one C call into immutable bytes (cheaper
# than setting a ctypes.Structure's fields): kvcopy_cuda_call's layout, struct_bytes first.
CUDA_CALL = struct.Struct("<5q")
CUDA_CALL_BYTES = CUDA_CALL.size

# Struct pointers are passed as addresses (c_void_p): the callers keep the structs alive
# and hand their cached ``ctypes.addressof`` (or, per CUDA call, the packed bytes).
# kvcopy_cpu_copy(tables, tuning, packed, total_bytes)
CPU_COPY_ARGS = [_vp, _vp, _vp, _i64]
# kvcopy_cpu_copy_sums(tables, tuning, packed, total_bytes, sums, num_sums); _fold adds the fold
CPU_SUMS_ARGS = CPU_COPY_ARGS + [_vp, _i64]
# kvcopy_cpu_copy_ranges(tables, call_ext, total_bytes, ranges): test helper
CPU_RANGES_ARGS = [_vp, _vp, _i64, _vp]
# kvcopy_cuda_copy(tables, call, call_host, stream); _sums adds sums, num_sums
CUDA_COPY_ARGS = [_vp, _vp, _vp, _vp]
# kvcopy_cuda_store_words(dst, src, count, stream)
CUDA_STORE_ARGS = [_vp, _vp, _i64, _vp]

# library stem -> symbol -> (restype, argtypes): every function of kvcopy's C ABI.
SIGNATURES: Dict[str, Dict[str, Tuple[Any, List[Any]]]] = {
    "kvcopy_cpu": {
        "kvcopy_cpu_abi_version": (_int, []),
        "kvcopy_cpu_entry_fields": (_int, []),
        "kvcopy_cpu_has_openmp": (_int, []),
        "kvcopy_cpu_sums_loops": (_int, []),
        "kvcopy_cpu_sums_loop": (_int, [_int]),
        "kvcopy_cpu_copy": (_int, CPU_COPY_ARGS),
        "kvcopy_cpu_copy_sums": (_int, CPU_SUMS_ARGS),
        "kvcopy_cpu_copy_sums_fold": (_i64, CPU_SUMS_ARGS + [_vp]),
        "kvcopy_cpu_flush": (_int, [_vp, _i64]),
        "kvcopy_fold_page_sums": (_i64, [_vp, _i64, _vp]),
        "kvcopy_plan_call": (_i64, [_vp] * 5),
        "kvcopy_host_noop": (_int, []),
        # test helpers
        "kvcopy_cpu_copy_ranges": (_int, CPU_RANGES_ARGS),
        "kvcopy_cpu_copy_ranges_sums": (_int, CPU_RANGES_ARGS + [_vp, _i64]),
        "kvcopy_cpu_copy_streams": (_int, [_i64, _i64]),
        "kvcopy_cpu_sums_pieces": (_int, [_i64, _i64, _vp]),
    },
    "kvcopy_cuda": {
        "kvcopy_cuda_abi_version": (_int, []),
        "kvcopy_cuda_entry_fields": (_int, []),
        "kvcopy_cuda_threads": (_int, []),
        "kvcopy_cuda_inline_words": (_int, []),
        "kvcopy_cuda_params_bytes": (_int, []),
        "kvcopy_cuda_runtime_version": (_int, []),
        "kvcopy_cuda_error_name": (_str, [_int]),
        "kvcopy_cuda_error_string": (_str, [_int]),
        "kvcopy_cuda_device_count": (_int, [_P(_int)]),
        "kvcopy_cuda_device_info": (_int, [_int, _P(_int), _P(_int)]),
        "kvcopy_cuda_host_device_pointer": (_int, [_vp, _P(_vp)]),
        "kvcopy_cuda_copy": (_int, CUDA_COPY_ARGS),
        "kvcopy_cuda_copy_sums": (_int, CUDA_COPY_ARGS + [_vp, _i64]),
        "kvcopy_cuda_stream_capturing": (_int, [_vp, _P(_int)]),
        "kvcopy_cuda_stream_create": (_int, [_int, _P(_vp), _P(_int)]),
        "kvcopy_cuda_stream_destroy": (_int, [_vp]),
        "kvcopy_cuda_store_words": (_int, CUDA_STORE_ARGS),
        "kvcopy_ce_batch_abi": (_int, []),
        "kvcopy_ce_error_name": (_str, [_int]),
        "kvcopy_ce_copy": (_int, [_vp, _vp, _vp, _vp, _P(_int), _P(_i64)]),
    },
}


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
    """``(lib, None)`` when its ABI version is the one expected and it exports every
    function of :data:`SIGNATURES` (each then declared), else ``(None, why)``."""
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
    for name, (res, args) in SIGNATURES.get(stem, {}).items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"{path} is out of date (no {name}); rebuild with `pip install -e .`"
        fn.restype, fn.argtypes = res, args
    width = int(getattr(lib, f"{stem}_entry_fields")())
    if width != ENTRY_FIELDS:
        return None, (f"{path} was compiled with {width}-column entry rows, kernels/entry_layout.cuh says "
                      f"{ENTRY_FIELDS}: built from other sources; rebuild with `pip install -e .`")
    return lib, None


def probe(stem: str, path: Path) -> Tuple[ctypes.CDLL, List[str]]:
    """The library at ``path`` whatever its ABI version (diagnostics: the GPU check,
    build tests), every signature of :data:`SIGNATURES` it has declared, and the names
    of those it lacks. ``OSError`` where it does not load."""
    lib = ctypes.CDLL(str(path))
    missing = []
    for name, (res, args) in SIGNATURES.get(stem, {}).items():
        fn = getattr(lib, name, None)
        if fn is None:
            missing.append(name)
        else:
            fn.restype, fn.argtypes = res, args
    return lib, missing


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



# ------------------------------------------------------------------ CUDA errors
class CudaError(RuntimeError):
    """A CUDA call made by kvcopy failed; ``name`` is the CUDA error name."""

    def __init__(self, what: str, code: int, name: str):
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code
        self.name = name


def error_name(code: int) -> str:
    lib, _ = load("kvcopy_cuda")
    if lib is None:
        return f"CUDA error {code}"
    return lib.kvcopy_ce_error_name(code).decode()


def check(code: int, what: str) -> None:
    if code != 0:
        raise CudaError(what, code, error_name(code))


# ------------------------------------------------------------------ CUDA driver and runtime
DRIVER_SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "cuModuleLoadData": (_int, [_P(_vp), _str]),
    "cuModuleGetFunction": (_int, [_P(_vp), _vp, _str]),
    "cuLaunchKernel": (_int, [_vp] + [ctypes.c_uint] * 7 + [_vp, _P(_vp), _vp]),
    "cuGetErrorName": (_int, [_int, _P(_str)]),
    "cuMemsetD8Async": (_int, [_vp, ctypes.c_ubyte, ctypes.c_size_t, _vp]),
    "cuDeviceGetAttribute": (_int, [_P(_int), _int, _int]),
    "cuDriverGetVersion": (_int, [_P(_int)]),
}
_driver: List[ctypes.CDLL] = []


def driver() -> ctypes.CDLL:
    """``libcuda.so.1`` with :data:`DRIVER_SIGNATURES` declared, loaded once; ``OSError``
    where there is no CUDA driver."""
    if not _driver:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, (res, args) in DRIVER_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _driver.append(lib)
    return _driver[0]


def setns(fd: int, nstype: int) -> None:
    """``setns(2)`` for the calling thread (``os.setns`` where Python has it, 3.12+, else
    libc's): ``OSError`` with its errno on failure."""
    if hasattr(os, "setns"):
        os.setns(fd, nstype)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setns.restype, libc.setns.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


_cudart: List[Optional[ctypes.CDLL]] = []


def cudart() -> Optional[ctypes.CDLL]:
    """The CUDA runtime this process loaded (torch's; found in ``/proc/self/maps``), or
    None: ``cudaGetLastError``, which torch's binding does not expose."""
    if not _cudart:
        lib = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                lib.cudaGetLastError.restype, lib.cudaGetLastError.argtypes = _int, []
                break
        except OSError:
            lib = None
        _cudart.append(lib)
    return _cudart[0]


class KernelParams(ctypes.Structure):
    """Mirror of kvcopy::KernelParams (kernels/block_copy_kernel.cuh), for the NVRTC launch."""

    _fields_ = [
        ("tables", _vp),
        ("call", _vp),
        ("num_entries", _i64),
        ("num_groups", _i64),
        ("num_group_entries", _i64),
        ("total_bytes", _i64),
        ("sums", _vp),
        ("inline_call", _i64 * 480),
    ]


class StoreParams(ctypes.Structure):
    """Mirror of kvcopy::StoreParams."""

    _fields_ = [("dst", _vp), ("count", _i64), ("words", _i64 * 480)]


def noop_function(argtypes: List[Any]) -> Any:
    """``kvcopy_host_noop`` (does nothing, returns 0) typed with ``argtypes``, so a call
    converts the same arguments as the real function's: the overhead benchmark's launch
    stub. Extra register/stack arguments are ignored by the x86-64 and AArch64 C calling
    conventions (the caller owns them). RuntimeError without a current host library."""
    lib, why = load("kvcopy_cpu")
    if lib is None:
        raise RuntimeError(f"the stub needs a current libkvcopy_cpu (kvcopy_host_noop): {why}")
    address = ctypes.cast(lib.kvcopy_host_noop, _vp).value
    assert address is not None
    return ctypes.CFUNCTYPE(_int, *argtypes)(address)
