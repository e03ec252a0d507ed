"""Backend ``cpu``: ``kernels/block_copy.cuh`` compiled for the host, one C call per copy.

Both sides must be CPU tensors (a CPU-only engine, or the tests). The call passes the
static tables' addresses and the packed call array; the library walks every item
(OpenMP threads above 1 MiB per call) and memcpy's its segments, or, in calls of at
least ``KVCOPY_CPU_STREAM_BYTES`` (2 MiB on Intel CPUs, else 16 MiB:
:func:`default_stream_bytes`), copies them with non-temporal stores (an SSE2 loop).
ctypes releases the GIL for the duration of the call. ``KVCOPY_CPU_THREADS`` caps the
threads; it is read when a copier direction is prepared (not once per process), so a
benchmark that sets it before building its copiers runs them on that many threads.

With checksums (:mod:`kvcopy.core.checksum`) the call goes to ``kvcopy_cpu_copy_sums``, whose
loop hashes each word between its load and its store: AVX-512 F where the CPU has it,
else AVX2, else scalar code (``KVCOPY_CPU_SIMD``, read at prepare: ``0`` the scalar
loop, ``avx2`` the AVX2 loop); one ``vpmuludq`` per vector of words, the hash's one
32 x 32-bit multiply per word. In calls from 2 MiB up to the streaming threshold the
vector loops copy runs of at least ``KVCOPY_CPU_SUM_PIECE_BYTES`` (16 KiB) with memcpy
instead, piece by piece, and hash each piece in the destination, still in cache, while
the next piece's source is prefetched, whole in calls under 8 MiB, else its first half
(:func:`_piece_bytes`); smaller calls, which the caches hold, keep the fused loop
(:data:`PIECE_MIN_CALL_BYTES`).
On one core of an AMD EPYC Zen 3 (AVX2) the copy with
sums took 0.97-1.43x the time of the plain copy, most rows 1.0-1.2x, with the fused
AVX2 loop (medians; CHANGELOG.md, 2026-12-02; the pieces have not run there).

Both copies write calls of at least ``KVCOPY_CPU_STREAM_BYTES`` (2 MiB on Intel, else
16 MiB) with non-temporal stores. A run of a few KiB copied by memcpy never reaches
glibc's own streaming threshold, so each store first reads its destination line: a
third more memory traffic for a call the caches cannot hold (the plain copy took
0.62-0.73x the time with streaming stores at 18-64 MiB, d2h, one core, interleaved
calls, on an AMD EPYC; not saved). A streamed checksummed call hashes each word between
its load and its store: pieces run only below the threshold, so on Intel CPUs, with
both limits at 2 MiB, never by default (2-16 MiB elsewhere).
"""
from __future__ import annotations

import ctypes
import functools
import os
from types import MappingProxyType
from typing import Any, Dict, Mapping, NamedTuple, Optional

import torch

from . import Backend
from .. import native
from ..core.tables import CallPlan, CopyTables


def _threads() -> int:
    """``KVCOPY_CPU_THREADS`` (0 or unset: OpenMP's default team)."""
    text = os.environ.get("KVCOPY_CPU_THREADS", "").strip()
    try:
        return max(0, int(text)) if text else 0
    except ValueError:
        raise ValueError(f"KVCOPY_CPU_THREADS must be an integer, got {text!r}") from None


# kvcopy_cpu_sums_loops' bit for the AVX2 loop.
_AVX2 = 1


def _simd(loops: int) -> int:
    """``KVCOPY_CPU_SIMD``: unset or ``1``: the widest vector loop the CPU has (code 1);
    ``0``: the scalar loop (0); ``avx2``: the AVX2 loop (2; the tests run it on CPUs
    that would pick AVX-512)."""
    text = os.environ.get("KVCOPY_CPU_SIMD", "1").strip()
    if text in ("1", "on", "yes"):
        return 1
    if text in ("0", "off", "no"):
        return 0
    if text.lower() == "avx2":
        if not loops & _AVX2:
            raise ValueError("KVCOPY_CPU_SIMD=avx2, but this CPU has no AVX2")
        return 2
    raise ValueError(f"KVCOPY_CPU_SIMD must be 1, 0 or avx2, got {text!r}")


STREAM_BYTES_DEFAULT = 16 << 20
STREAM_BYTES_INTEL = 2 << 20


@functools.lru_cache(maxsize=4)
def cpuinfo(path: str = "/proc/cpuinfo") -> Mapping[str, str]:
    """The first processor's fields in Linux's cpuinfo (``vendor_id``, ``model name``,
    ``flags``, ...), read once per path; empty where the file cannot be read (not Linux)
    and, for a field, where the CPU has none (Arm has no ``vendor_id``)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return MappingProxyType({})
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return MappingProxyType(fields)


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``), or ""."""
    return cpuinfo().get("vendor_id", "")


def default_stream_bytes() -> int:
    """The streaming threshold without ``KVCOPY_CPU_STREAM_BYTES``: 2 MiB on Intel CPUs
    (:func:`cpu_vendor` says ``GenuineIntel``), 16 MiB otherwise, including where
    ``/proc/cpuinfo`` cannot be read.

    On a 2-core Xeon with AVX-512 (Sapphire Rapids class: AMX, AVX-512 FP16; 2 MiB of
    L2 per core; one thread; docs/backends.md, "Where the loop streams"): in
    scratch sweeps the plain copy took 0.78-1.08x the time with streaming stores at
    1-12 MiB (median 0.93x over 40 rows) but 0.93-1.95x at 0.25-0.5 MiB, where the caches
    hold the call. Three interleaved pairs per preset (CHANGELOG.md, 2026-12-03):
    ``cpu+sum`` / ``cpu`` 0.93-1.04x at 2-15 MiB against 0.98-1.13x with the 16 MiB
    threshold, and the plain copy itself 0.60-0.98x the time at 6-15 MiB. The 16 MiB
    default was set on AMD EPYCs, where streaming cost at 6-12 MiB
    (:func:`_stream_min_bytes`); CPUs other than Intel's keep it."""
    return STREAM_BYTES_INTEL if cpu_vendor() == "GenuineIntel" else STREAM_BYTES_DEFAULT


def _stream_min_bytes() -> int:
    """``KVCOPY_CPU_STREAM_BYTES``: calls of at least this many bytes, plain or
    checksummed, store with non-temporal stores (default :func:`default_stream_bytes`:
    2 MiB on Intel, 16 MiB elsewhere; 0: never). Streaming pays for calls the caches
    cannot hold and costs for those they can; where that line falls depends on the CPU.
    The checksummed copy on a 2-core AMD EPYC with AVX-512 (one thread, ``seeds2``,
    ``cpu+sum`` / plain ``cpu``, which did not stream then): streaming 6-12 MiB calls
    cost 1.12-1.16x against 1.04-1.07x without; at 18 MiB both cost 1.06-1.14x; at 24 MiB
    streaming cost 1.01x against 1.26-1.34x without, at 36 MiB 0.89-0.91x against
    1.09-1.10x. The plain copy on an AVX2 EPYC (one thread, interleaved calls, not
    saved): 0.62-0.73x the time of memcpy's at 18-64 MiB d2h; at 6 MiB 0.69-0.80x d2h
    but 1.06-1.16x h2d (medians and 10th percentiles)."""
    text = os.environ.get("KVCOPY_CPU_STREAM_BYTES", "").strip()
    try:
        return max(0, int(text)) if text else default_stream_bytes()
    except ValueError:
        raise ValueError(f"KVCOPY_CPU_STREAM_BYTES must be an integer, got {text!r}") from None


PIECE_BYTES_DEFAULT = 16 << 10
# Checksummed calls below this many bytes keep the fused loop unless
# KVCOPY_CPU_SUM_PIECE_BYTES is set (:func:`_piece_min_call_bytes`). The pieces were
# measured at 6-15 MiB, where they beat it; calls the caches hold went the other way.
# One core of a Xeon with AVX-512, seeds2 calls of 0.25-1.5 MiB, cpu+sum / cpu, four
# interleaved pairs per cache state (bench/results/cpu-xeon-*-under2m-*.json): warm
# (kvcopy-bench's default) fused 1.17-1.21x against pieced 1.40-1.55x at 256 KiB,
# 1.13-1.24x against 1.44-1.60x at 512 KiB, 1.10-1.18x against 1.19-1.28x at 1 MiB,
# 1.02-1.11x against 1.08-1.15x at 1.5 MiB; with the destination flushed from the
# caches before each call (--cache cold-dst) or the source too (cold), mostly rows
# flagged as noise, the medians 0.09x apart at most, either way (pieces lower at
# 512 KiB cold-dst, fused lower at 1.5 MiB and at every size cold).
PIECE_MIN_CALL_BYTES = 2 << 20
_SCALAR_LOOP = 0  # kvcopy_cpu_sums_loop's number for the scalar loop


def _piece_bytes(loop: int) -> int:
    """``KVCOPY_CPU_SUM_PIECE_BYTES``: in checksummed calls below the streaming threshold
    (and, unless this is set, of at least :data:`PIECE_MIN_CALL_BYTES`), the vector
    loops copy runs of at least this many bytes piece by piece with memcpy,
    and hash each piece where it landed when the next piece comes, that piece's source
    prefetched under the hash, whole in calls under 8 MiB, else its first half (``0``:
    never, every run through the fused loop; else a multiple of 64). Default: 16 KiB
    for both vector loops, 0 for the scalar one (far slower than memcpy: pieces would
    not pay). memcpy's string moves write lines without reading them first, which
    vector stores cannot, and the prefetch lets the hash's arithmetic run while the next
    piece is fetched. On a Xeon with AVX-512, with a 16 MiB streaming threshold (one
    thread, ``cpu+sum`` / ``cpu`` at ``seeds2`` 6 MiB, runs interleaved;
    CHANGELOG.md, 2026-12-03): AVX-512 loop pieced with the prefetch 1.00-1.07x in 14
    of 16 rows (1.16x in both of one run's), pieced without it 1.02-1.33x, fused
    1.14-1.22x; AVX2 loop pieced with the prefetch 1.01-1.07x, fused 1.07x. With the
    next piece's first half prefetched from 8 MiB up: ``seeds2`` 12 MiB 1.02-1.14x and
    ``mla`` (15 MiB) 1.02-1.07x, against 1.12-1.26x and 1.09-1.16x with nothing
    prefetched there. On Intel CPUs these calls now stream by default
    (:func:`default_stream_bytes`), and smaller ones keep the fused loop, so there the
    pieces run only when this is set; CPUs with only AVX2 (AMD Zen 2/3) have not run
    them."""
    text = os.environ.get("KVCOPY_CPU_SUM_PIECE_BYTES", "").strip()
    try:
        value = int(text) if text else (0 if loop == _SCALAR_LOOP else PIECE_BYTES_DEFAULT)
    except ValueError:
        value = -1
    if value < 0 or value % 64:
        raise ValueError(f"KVCOPY_CPU_SUM_PIECE_BYTES must be 0 or a positive multiple of 64, got {text!r}")
    return value


def _piece_min_call_bytes() -> int:
    """The smallest checksummed call whose runs go piece by piece: ``0`` (every call
    below the streaming threshold) when ``KVCOPY_CPU_SUM_PIECE_BYTES`` is set, to any
    value, 16384 (the default size) included: setting it asks for pieces of that size in
    calls of every size; else :data:`PIECE_MIN_CALL_BYTES`, on every CPU (measured on one
    Xeon with 2 MiB of L2 per core; elsewhere this moved calls under 2 MiB from the
    pieces to the fused loop unmeasured)."""
    return 0 if os.environ.get("KVCOPY_CPU_SUM_PIECE_BYTES", "").strip() else PIECE_MIN_CALL_BYTES


@functools.lru_cache(maxsize=None)
def _flush_function() -> Any:
    """``kvcopy_cpu_flush`` with its signature set, once; RuntimeError without the library."""
    lib, why = native.load("kvcopy_cpu")
    if lib is None:
        raise RuntimeError(f"flush_caches needs the kvcopy_cpu library: {why}")
    return lib.kvcopy_cpu_flush


def flush_caches(tensor: torch.Tensor) -> bool:
    """Write back and evict the lines of ``tensor``'s whole storage from this CPU's
    caches (``clflush`` on x86-64, ``dc civac`` on Arm64), leaving its bytes as they
    are: ``kvcopy-bench --cache cold-dst`` and ``cold`` call it before each timed call, so the call
    starts with its pages in memory, as a request's pages are in a serving engine
    whose other requests have passed through the caches since. True when flushed,
    False where the library has no flush instruction for this CPU (nothing done).
    Raises ValueError for a tensor not on the CPU and RuntimeError without the
    library. Time: about the bytes' memory bandwidth (dirty lines are written back)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"flush_caches: a CPU tensor, got one on {tensor.device}")
    fn = _flush_function()
    storage = tensor.untyped_storage()
    rc = fn(storage.data_ptr(), storage.nbytes())
    if rc < 0:
        raise RuntimeError(f"kvcopy_cpu_flush failed with code {rc}")
    return rc == 1


class _State(NamedTuple):
    """A copier direction's call constants: the copy function, its two structs' addresses
    (what a call passes) and the structs themselves (kept alive here)."""

    copy: Any
    tables_at: int
    tuning_at: int
    tables: Any  # kvcopy.native.Tables
    tuning: Any  # kvcopy.native.CpuTuning


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        lib, self._why = native.load("kvcopy_cpu")
        self._lib: Any = lib
        self._sums: Any = None
        self._sums_fold: Any = None
        self._loops = 0
        if lib is not None:
            self._loops = int(lib.kvcopy_cpu_sums_loops())
            self._sums = lib.kvcopy_cpu_copy_sums  # every signature declared by kvcopy.native
            self._sums_fold = lib.kvcopy_cpu_copy_sums_fold

    def unavailable_reason(self) -> Optional[str]:
        return self._why

    def checksum_loop(self) -> Optional[str]:
        """The loop checksummed copies prepared now would run (``KVCOPY_CPU_SIMD`` and
        the CPU): ``avx512``, ``avx2`` or ``scalar``; None without the library. Raises
        ValueError on a ``KVCOPY_CPU_SIMD`` that :meth:`prepare` would refuse."""
        if self._lib is None:
            return None
        return ("scalar", "avx2", "avx512")[self._lib.kvcopy_cpu_sums_loop(_simd(self._loops))]

    def unsupported_reason(self, tables: CopyTables) -> Optional[str]:
        if tables.src_device.type != "cpu" or tables.dst_device.type != "cpu":
            return f"needs CPU tensors on both sides, got {tables.src_device} -> {tables.dst_device}"
        return None

    def prepare(self, tables: CopyTables) -> None:
        if self._lib is None:
            raise ValueError(f"backend 'cpu' is not available: {self._why}")
        simd = _simd(self._loops)
        # The structs of the call's constants, made once (the arrays live in tables);
        # calls pass their addresses.
        static = tables.abi_struct()
        tuning = native.CpuTuning.make(num_threads=_threads(), simd=simd, stream_min_bytes=_stream_min_bytes(),
                                       piece_bytes=_piece_bytes(self._lib.kvcopy_cpu_sums_loop(simd)),
                                       piece_min_bytes=_piece_min_call_bytes())
        tables.backend_state["cpu"] = _State(self._lib.kvcopy_cpu_copy, ctypes.addressof(static),
                                             ctypes.addressof(tuning), static, tuning)

    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:  # no grid
        copy, static, tuning, _, _ = self.state(tables)
        rc = copy(static, tuning, call.words, call.total_bytes)
        if rc != 0:
            raise RuntimeError(f"kvcopy_cpu_copy failed with code {rc}")

    def checksum_reason(self, tables: CopyTables) -> Optional[str]:
        return self.unavailable_reason() or self.unsupported_reason(tables)

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                            max_ctas: Optional[int] = None) -> None:
        _, static, tuning, _, _ = self.state(tables)
        rc = self._sums(static, tuning, call.words, call.total_bytes, out.data_ptr(), out.numel())
        if rc == 2:  # nothing written
            raise MemoryError(f"kvcopy_cpu_copy_sums: no memory for its threads' rows of {out.numel()} sums")
        if rc != 0:
            raise RuntimeError(f"kvcopy_cpu_copy_sums failed with code {rc}")

    def copy_with_checksums_folded(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                                   fold_at: int, max_ctas: Optional[int] = None) -> Optional[int]:
        """One C call (``kvcopy_cpu_copy_sums_fold``): the copy, its sums, their fold."""
        _, static, tuning, _, _ = self.state(tables)
        differ = self._sums_fold(static, tuning, call.words, call.total_bytes, out.data_ptr(), out.numel(), fold_at)
        if differ == -2:  # nothing written
            raise MemoryError(f"kvcopy_cpu_copy_sums_fold: no memory for its threads' rows of {out.numel()} sums")
        if differ < 0:  # nothing written
            raise ValueError(f"kvcopy_cpu_copy_sums_fold: the fold's indices leave their ranges (a gather index "
                             f"outside the call's {out.numel()} sums, or segment starts out of order)")
        return differ
