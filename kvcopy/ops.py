"""The copy as a ``torch.library`` custom op: ``torch.ops.kvcopy.copy_blocks_``.

    kvcopy.ops.copy(copier, "h2d", block_ids_per_group)          # eager or compiled
    torch.compile(step)(...)   # step calls kvcopy.ops.copy: one opaque op, no graph break

``torch.compile`` cannot trace a :class:`~kvcopy.core.copier.BlockCopier` call (numpy
validation, ctypes launches); the custom op makes the whole call one node that
declares what it writes (``mutates_args=("dsts",)``: every destination tensor of the
direction), so the compiler orders it against the model's reads and writes of the KV
cache (under a compiler that does not re-inplace mutations, such as ``aot_eager``,
the op also refreshes the clones it is handed: correct, but a full copy of every
destination tensor). The copier is named by an integer handle (a weak registry), the block ids are
CPU int64 tensors, one per group. The fake (meta) implementation does nothing: the op
returns nothing and only mutates in place.

CUDA graphs: the op enqueues exactly what an eager call does, on the current stream,
and never synchronizes, so it can be captured with ``torch.cuda.graph`` (see
:mod:`kvcopy.copy_backends.cuda` for what a replay reads).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Optional, Sequence

import torch

_by_handle: Dict[int, "weakref.ref"] = {}
_handles: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_next = itertools.count(1)


@torch.compiler.assume_constant_result
def handle_of(copier) -> int:
    """The integer the op uses to find ``copier`` (registered on first use; under
    ``torch.compile`` evaluated once at trace time and baked in as a constant)."""
    h = _handles.get(copier)
    if h is None:
        h = next(_next)
        _handles[copier] = h
        _by_handle[h] = weakref.ref(copier, _forget(h))
    return h


def _forget(handle: int):
    """The weakref callback that drops ``handle`` once its copier is gone."""
    def forget(_ref) -> None:
        _by_handle.pop(handle, None)
    return forget


@torch.library.custom_op("kvcopy::copy_blocks_", mutates_args=("dsts",), device_types=None)
def _copy_blocks(handle: int, to_device: bool, device_ids: List[torch.Tensor],
                 host_ids: List[torch.Tensor], dsts: List[torch.Tensor]) -> None:
    ref = _by_handle.get(handle)
    copier = ref() if ref is not None else None
    if copier is None:
        raise ValueError(f"kvcopy::copy_blocks_: no live BlockCopier with handle {handle}")
    if to_device:
        copier.to_device(device_ids, host_ids)
    else:
        copier.to_host(device_ids, host_ids)
    # The kernels write the copier's own tensors. A functionalizing compiler that did
    # not re-inplace the op (aot_eager does not; inductor does) hands us clones and
    # copies them back afterwards: bring the clones up to date, or that copy-back
    # would undo the copy. Inductor passes the originals: nothing happens here.
    for mine, given in zip(_destinations(copier, to_device), dsts):
        if given.data_ptr() != mine.data_ptr():
            given.copy_(mine)


@_copy_blocks.register_fake
def _copy_blocks_fake(handle, to_device, device_ids, host_ids, dsts) -> None:
    return None


def _id_tensors(ids: Sequence) -> List[torch.Tensor]:
    out = []
    for g in ids:
        if isinstance(g, torch.Tensor):
            out.append(g.to(device="cpu", dtype=torch.int64))
        else:
            out.append(torch.tensor(list(g), dtype=torch.int64))
    return out


def _destinations(copier, to_device: bool) -> List[torch.Tensor]:
    tables = copier.tables("h2d" if to_device else "d2h")
    seen, out = set(), []
    for t in tables.dst_tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def copy(copier, direction: str, block_ids: Sequence, host_block_ids: Optional[Sequence] = None) -> None:
    """``copier.to_device`` (``"h2d"``) or ``copier.to_host`` (``"d2h"``) through the op."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    to_device = direction == "h2d"
    dev = _id_tensors(block_ids)
    host = dev if host_block_ids is None else _id_tensors(host_block_ids)
    torch.ops.kvcopy.copy_blocks_(handle_of(copier), to_device, dev, host, _destinations(copier, to_device))
