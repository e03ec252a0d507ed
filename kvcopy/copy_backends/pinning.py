"""Page-locking host buffers in place, so GPU kernels can read and write them.

vLLM allocates its host staging buffers pageable (``torch.zeros(..., device="cpu")``
without ``pin_memory``); a kernel that dereferences a pageable host address faults.
:func:`pin_host_tensors` registers each distinct pageable CPU storage once with
``cudaHostRegister`` (portable | mapped) and :meth:`HostPinning.release` undoes it;
a pinning that is garbage collected releases itself. Registration works on
whole pages (what the driver locks anyway): the pages of all storages of one call are
merged into spans, so small tensors sharing a page are registered once, together.
Memory already page-locked by others (``torch.empty(..., pin_memory=True)``, NIXL/UCX)
is left alone and never unregistered by us; kvcopy's own spans are reference-counted
across copiers (:class:`Registry`), so closing one copier never unpins memory another
still uses. The first time pageable
memory gets pinned the process logs it once at INFO (later ones at DEBUG), so the
behaviour is never silent. Without CUDA it is a no-op.

Unified addressing: on x86-64 Linux (and Grace with ATS) a registered host pointer is
usable by kernels as is (``cudaDevAttrCanUseHostPointerForRegisteredMem`` = 1).
Where that attribute is 0 a kernel needs the pointer from
``cudaHostGetDevicePointer`` instead; :func:`host_pointer_usable` reports it, and
backends that pass raw host addresses to kernels refuse such devices rather than
translate (not needed on any machine kvcopy targets today).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .. import native

logger = logging.getLogger("kvcopy.copy_backends.pinning")

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_ERR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_CU_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

_logged = False
_log_lock = threading.Lock()


def _storage_range(t: torch.Tensor) -> Tuple[int, int, torch.UntypedStorage]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes(), s


def _is_pinned_addr(addr: int) -> bool:
    """Whether the byte at ``addr`` is page-locked (torch asks the CUDA runtime)."""
    buf = (ctypes.c_char * 1).from_address(addr)
    return bool(torch.frombuffer(buf, dtype=torch.uint8).is_pinned())


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def page_spans(ranges: Iterable[Tuple[int, int]], page: int = PAGE) -> List[Tuple[int, int]]:
    """``(address, bytes)`` ranges rounded out to whole pages, overlapping and adjacent
    ones merged: what ``cudaHostRegister`` locks anyway, so small tensors that share a
    page are registered once, together."""
    spans = sorted((a // page * page, -(-(a + n) // page) * page) for a, n in ranges if n > 0)
    out: List[Tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Registry:
    """kvcopy's own host registrations: disjoint page spans, each registered once with
    ``cudaHostRegister`` and reference-counted by the pinnings that use it.

    Two copiers over the same host buffers (a TransferManager's and one of
    copy_blocks's, or ``auto``'s candidate backends) share registrations; a span is
    unregistered when the last pinning holding it is released, never under a copier
    that still runs. Memory page-locked by others (``pin_memory=True``, NIXL/UCX) is
    left alone. The CUDA calls come in as functions so the logic runs on any machine.
    """

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], None],
                 is_pinned: Callable[[int], bool]):
        self._register = register  # (addr, nbytes) -> CUDA error code
        self._unregister = unregister  # addr -> None
        self._is_pinned = is_pinned  # addr -> bool
        self._spans: Dict[int, List[int]] = {}  # start -> [end, holders]
        self._lock = threading.Lock()

    def spans(self) -> Dict[int, Tuple[int, int]]:
        """start -> (end, holders); for tests and diagnostics."""
        with self._lock:
            return {a: (e, n) for a, (e, n) in self._spans.items()}

    def acquire(self, wanted: List[Tuple[int, int]]) -> Tuple[List[int], int]:
        """Hold every page of ``wanted`` (page spans): returns (the starts of the spans
        held, the number of foreign-pinned pieces left alone). On failure nothing stays
        held and a ``RuntimeError`` names the CUDA error."""
        held: List[int] = []
        foreign = 0
        try:
            for a, b in wanted:
                for lo, hi, mine in self._pieces(a, b):
                    if mine is not None:
                        with self._lock:
                            self._spans[mine][1] += 1
                        held.append(mine)
                        continue
                    if self._is_pinned(lo) and self._is_pinned(hi - 1):
                        foreign += 1
                        continue
                    err = self._register(lo, hi - lo)
                    if err == _ERR_ALREADY_REGISTERED and self._is_pinned(lo) and self._is_pinned(hi - 1):
                        foreign += 1  # registered by someone else since the check
                        continue
                    if err != 0:
                        raise RuntimeError(
                            f"cudaHostRegister({lo:#x}, {hi - lo}) failed: {_error_name(err)} ({err})")
                    with self._lock:
                        self._spans[lo] = [hi, 1]
                    held.append(lo)
        except BaseException:
            self.release(held)
            raise
        return held, foreign

    def _pieces(self, a: int, b: int):
        """[a, b) cut at kvcopy's existing spans: (lo, hi, start of the existing span
        covering it, or None for a gap to register)."""
        with self._lock:
            mine = sorted((s, e) for s, (e, _) in self._spans.items() if s < b and e > a)
            out: List[Tuple[int, int, Optional[int]]] = []
            pos = a
            for s, e in mine:
                if s > pos:
                    out.append((pos, s, None))
                out.append((max(s, pos), min(e, b), s))
                pos = max(pos, e)
            if pos < b:
                out.append((pos, b, None))
        return out

    def release(self, held: List[int]) -> None:
        """Drop one reference per start in ``held``; unregister spans nobody holds."""
        last = []
        with self._lock:
            for s in held:
                entry = self._spans.get(s)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._spans[s]
                        last.append(s)
        for s in last:
            self._unregister(s)


def _cuda_register(addr: int, nbytes: int) -> int:
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))
    if err != 0:
        _clear_last_error()  # else torch's next launch check reports it
    return err


def _cuda_unregister(addr: int) -> None:
    for dev in range(torch.cuda.device_count()):
        torch.cuda.synchronize(dev)  # no kernel may still read or write the memory
    torch.cuda.cudart().cudaHostUnregister(addr)


REGISTRY = Registry(_cuda_register, _cuda_unregister, _is_pinned_addr)


class HostPinning:
    """What one :func:`pin_host_tensors` call holds (spans of :data:`REGISTRY`)."""

    def __init__(self, registry: Registry, held: List[int], storages: list, already_pinned: int):
        self._held = held
        self._storages = storages  # kept alive while their memory is registered
        self.already_pinned = already_pinned
        self._finalizer = weakref.finalize(self, _drop, registry, held, storages)
        self._finalizer.atexit = False  # the process is going away: nothing to undo

    @property
    def registered(self) -> int:
        """Page spans this pinning holds a kvcopy registration of."""
        return len(self._held)

    @property
    def registered_bytes(self) -> int:
        return sum(s.nbytes() for s in self._storages) if self._held else 0

    def release(self) -> None:
        """Drop this pinning's hold; spans no copier holds are unregistered (after a
        device synchronize). Idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _drop(registry: Registry, held: List[int], storages: list) -> None:
    try:
        registry.release(held)
    finally:
        held.clear()
        storages.clear()


def pin_host_tensors(tensors: Iterable[torch.Tensor], registry: Optional[Registry] = None) -> HostPinning:
    """Page-lock the memory of every pageable CPU storage under ``tensors`` in place.

    Non-CPU tensors are ignored. Raises ``RuntimeError`` naming the CUDA error when a
    registration fails (nothing stays registered then).
    """
    if registry is None:
        if not torch.cuda.is_available():
            return HostPinning(REGISTRY, [], [], 0)
        registry = REGISTRY
    storages: Dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            ptr, nbytes, storage = _storage_range(t)
            if nbytes:
                storages.setdefault(ptr, storage)
    held, foreign = registry.acquire(page_spans((p, s.nbytes()) for p, s in storages.items()))
    pinning = HostPinning(registry, held, list(storages.values()), foreign)
    if held:
        _log_pinned(pinning)
    return pinning


def pin_host_side(tables) -> Optional[HostPinning]:
    """Page-lock the pageable host tensors of a copier direction's tables (both sides'
    CPU tensors); None when there is nothing on the host."""
    hosts = [t for t in list(tables.src_tensors) + list(tables.dst_tensors) if t.device.type == "cpu"]
    return pin_host_tensors(hosts) if hosts else None


def _log_pinned(p: HostPinning) -> None:
    global _logged
    with _log_lock:
        first, _logged = not _logged, True
    msg = ("kvcopy: page-locked %d pageable host buffer(s), %.1f MiB, in place with "
           "cudaHostRegister so GPU kernels can access them (allocate them with "
           "pin_memory=True to skip this)")
    (logger.info if first else logger.debug)(msg, p.registered, p.registered_bytes / 2**20)




def _clear_last_error() -> None:
    """``cudaGetLastError()`` in the CUDA runtime this process loaded (torch's binding
    does not expose it); a failed ``cudaHostRegister`` leaves its error there."""
    lib = native.cudart()
    if lib is not None:
        lib.cudaGetLastError()


def _error_name(err) -> str:
    try:
        return str(torch.cuda.cudart().cudaGetErrorString(err))
    except Exception:  # pragma: no cover - older torch
        return "cudaError"


_usable: Dict[int, bool] = {}


def host_pointer_usable(device: Optional[int] = None) -> bool:
    """``cudaDevAttrCanUseHostPointerForRegisteredMem`` of ``device``: whether kernels may
    use registered host pointers as is. True when it cannot be queried (x86 Linux,
    where it is always 1)."""
    if not torch.cuda.is_available():
        return True
    dev = torch.cuda.current_device() if device is None else int(device)
    if dev not in _usable:
        value = ctypes.c_int(1)
        try:
            rc = native.driver().cuDeviceGetAttribute(
                ctypes.byref(value), _CU_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev)
            _usable[dev] = bool(value.value) if rc == 0 else True
        except OSError:
            _usable[dev] = True
    return _usable[dev]
