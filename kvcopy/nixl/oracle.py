"""The byte oracle: a plan's descriptors applied to CPU tensors, without NIXL.

``replay(plan, local, remote)`` does, with plain byte slices, what a pull and its
completion do with NIXL and the copy kernels: for each region pair, each page pair
``(local_pages[i], remote_pages[i])``, each chunk ``c`` and each byte segment, it
copies the bytes at ``remote_page * page_stride + c * chunk_stride + remote offset``
of the remote layer's tensor to the same place in the local layer's tensor, and then
zeroes the pages listed for zeroing. ``local`` and ``remote`` map layer names to CPU
tensors with the geometry the plan was made for: the two engines' device caches (the
result is what D's caches hold after ``complete``), or the host buffers NIXL reads and
writes. Offsets are taken relative to each tensor's first element, so the tensors need
not be the registered ones.

It loops over pages in Python on purpose: slow, and sharing no code with the
descriptor tables, the NIXL index lists or the copy kernels it checks. Every byte it
touches is bounds-checked against the tensor's storage; a plan that would reach
outside raises ``ValueError``.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .plan import PullPlan, RegionRef


def _bytes_of(t: torch.Tensor, name: str):
    """(uint8 view of the tensor's whole storage, byte offset of its first element)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"layer {name!r}: replay needs a CPU tensor")
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage, t.storage_offset() * t.element_size()


def _page_chunk(ref: RegionRef, page: int, chunk: int) -> int:
    return page * ref.page_stride + chunk * ref.chunk_stride


def _check(buf: torch.Tensor, start: int, n: int, what: str) -> None:
    if start < 0 or start + n > buf.numel():
        raise ValueError(f"{what}: bytes [{start}, {start + n}) outside the tensor's storage of {buf.numel()}")


def replay(plan: PullPlan, local: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor],
           zero: bool = True) -> None:
    """Apply ``plan`` to ``local`` from ``remote`` in place (then zero, unless ``zero=False``)."""
    for pair in plan.pairs:
        for name in pair.layers:
            dst, dst0 = _bytes_of(local[name], name)
            src, src0 = _bytes_of(remote[name], name)
            for lp, rp in zip(pair.local_pages, pair.remote_pages):
                for c in range(pair.local.num_chunks):
                    for l_off, r_off, n in pair.byte_segments():
                        d = dst0 + _page_chunk(pair.local, lp, c) + l_off
                        s = src0 + _page_chunk(pair.remote, rp, c) + r_off
                        _check(dst, d, n, f"layer {name!r}, local page {lp}")
                        _check(src, s, n, f"layer {name!r}, remote page {rp}")
                        dst[d : d + n] = src[s : s + n]
    if not zero:
        return
    for pair in plan.pairs:
        for name in pair.layers:
            dst, dst0 = _bytes_of(local[name], name)
            for lp in pair.pages_to_zero:
                for c in range(pair.local.num_chunks):
                    d = dst0 + _page_chunk(pair.local, lp, c)
                    _check(dst, d, pair.local.chunk_bytes, f"layer {name!r}, local page {lp}")
                    dst[d : d + pair.local.chunk_bytes] = 0
