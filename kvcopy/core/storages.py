"""Misuse checks on the memory a ``BlockCopier`` was built on: overlap, replaced or freed storage.

The copier's tables hold raw addresses (``data_ptr()`` at build). Two misuses make
them point at the wrong bytes:

* **source and destination overlap** (one storage, the host view half a page past the
  device view): a copy then reads bytes it already wrote, so the result depends on the
  backend's order. :func:`check_disjoint` refuses it at build: the byte extents of
  every device tensor and every host tensor, on the same device, must not intersect.
  One sort of ``2 * layers`` intervals.
* **storage replaced or freed after build** (``t.set_(other)``, or
  ``t.untyped_storage().resize_(0)``): the tables would write into freed memory.
  :class:`StorageGuard` records, per unique storage (not per layer, not per block),
  one tensor viewing it and that tensor's address, and holds the storage; before every
  call :meth:`StorageGuard.check` compares all the addresses in one C-level list
  comparison (with vLLM's per-layer host buffers, 48 layers watch 96 storages: one
  ``map`` over them, no Python loop reading each storage's address and size).

What the guard does not see: ``set_`` on one of several views of a storage other than
the one it watches. The storage itself is then still alive (the watched view holds it),
so the copier writes where it was built to write, never into freed memory.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch

from .layout import byte_extent


def check_disjoint(device: Mapping[str, torch.Tensor], host: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` if a device tensor and a host tensor share a byte."""
    spans = []  # (device, start, end, side, layer)
    for side, tensors in (("device cache", device), ("host buffer", host)):
        for name, t in tensors.items():
            if t.numel():
                start, end = byte_extent(t)
                spans.append((str(t.device), start, end, side, name))
    spans.sort()
    # Sweep per device: the interval reaching furthest so far, per side.
    reach: Dict[Tuple[str, str], Tuple[int, str]] = {}
    for dev, start, end, side, name in spans:
        other = "host buffer" if side == "device cache" else "device cache"
        far = reach.get((dev, other))
        if far is not None and far[0] > start:
            raise ValueError(
                f"{side} of layer {name!r} and {other} of layer {far[1]!r} share bytes "
                f"[{start:#x}, {min(end, far[0]):#x}) on {dev}: a copy's source and destination must not overlap")
        mine = reach.get((dev, side))
        if mine is None or end > mine[0]:
            reach[(dev, side)] = (end, name)


class StorageGuard:
    """Per unique storage: a tensor viewing it, the storage's address, the bytes needed."""

    def __init__(self, *tensor_maps: Mapping[str, torch.Tensor]):
        watched: Dict[int, List] = {}  # storage address -> [tensor, layer, address, bytes needed]
        for tensors in tensor_maps:
            for name, t in tensors.items():
                storage = t.untyped_storage()
                base = storage.data_ptr()
                need = byte_extent(t)[1] - base if t.numel() else 0
                entry = watched.get(base)
                if entry is None:
                    watched[base] = [t, name, base, need]
                elif need > entry[3]:
                    entry[3] = need
        self._watched = [tuple(e) for e in watched.values()]
        # The storages themselves are held, so none of them can be freed and its address
        # handed to a new allocation while the copier lives: a watched tensor's data_ptr
        # then changes on every misuse (set_ moves it, a storage resize_ reallocates it,
        # resize_(0) nulls it), and one C-level comparison of all of them per call
        # suffices, instead of reading each storage's address and size in a Python loop.
        self._held = [t.untyped_storage() for t, _, _, _ in self._watched]
        self._tensors = [t for t, _, _, _ in self._watched]
        self._addresses = [t.data_ptr() for t in self._tensors]

    def check(self) -> None:
        """Raise ``ValueError`` if a watched storage moved or shrank since build."""
        if list(map(_data_ptr, self._tensors)) == self._addresses:
            return
        for (t, name, base, need), address in zip(self._watched, self._addresses):
            if t.data_ptr() != address:
                storage = t.untyped_storage()
                raise ValueError(
                    f"the storage of layer {name!r} was replaced or freed after the BlockCopier was built "
                    f"(it was {need} bytes at {base:#x}, now {storage.nbytes()} bytes at {storage.data_ptr():#x}): "
                    "build a new copier for the new tensors")


_data_ptr = torch.Tensor.data_ptr
