"""The torch reference for block copies: the oracle every backend is checked against.

It indexes each tensor along its block axis (``index_select`` then ``index_copy_``,
as vLLM's host-buffer path does), so it shares no byte arithmetic with the kernels:
a wrong stride or chunk offset in the layout model shows up as a mismatch. Tensors are
reinterpreted as integers of the same width first, so the copy is bit-exact for every
dtype (bf16 NaN payloads, fp8, packed uint8 formats) and never does float arithmetic.

Slow by design: one gather and one scatter per layer per group.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..core.layout import as_words


def reference_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor | Sequence[int],
    dst_ids: torch.Tensor | Sequence[int],
    block_dim: int = 0,
    dst_block_dim: int | None = None,
) -> None:
    """``dst[block dst_ids[i]] = src[block src_ids[i]]`` along ``block_dim``, in place.

    Element ``[i, j, ...]`` of a page goes to element ``[i, j, ...]`` whatever either
    side's strides are (a layout-converting copy is a logical-index copy). A
    destination with its block axis elsewhere (``dst_block_dim``) or another shape of
    the same elements gets the pages in row-major order of the in-page dims.
    """
    src_ids = torch.as_tensor(src_ids, dtype=torch.int64)
    dst_ids = torch.as_tensor(dst_ids, dtype=torch.int64)
    if src_ids.numel() == 0:
        return
    dbd = block_dim if dst_block_dim is None else dst_block_dim
    pages = as_words(src).index_select(block_dim, src_ids.to(src.device)).to(dst.device)
    out = as_words(dst)
    if dbd == block_dim and pages.shape[:dbd] + pages.shape[dbd + 1:] == out.shape[:dbd] + out.shape[dbd + 1:]:
        out.index_copy_(dbd, dst_ids.to(dst.device), pages)
        return
    out = out.movedim(dbd, 0)  # a view: index_copy_ writes through it
    pages = pages.movedim(block_dim, 0).reshape((pages.shape[block_dim],) + tuple(out.shape[1:]))
    out.index_copy_(0, dst_ids.to(dst.device), pages)


def reference_copy_groups(
    src: Mapping[str, torch.Tensor],
    dst: Mapping[str, torch.Tensor],
    layer_groups: Sequence[Sequence[str]],
    src_ids_per_group: Sequence[Sequence[int]],
    dst_ids_per_group: Sequence[Sequence[int]],
    block_dims: Mapping[str, int] | None = None,
) -> None:
    """The copy contract, spelled out: each group's layers at that group's ids only."""
    for layers, s_ids, d_ids in zip(layer_groups, src_ids_per_group, dst_ids_per_group):
        for name in layers:
            bd = (block_dims or {}).get(name, 0)
            reference_copy(src[name], dst[name], s_ids, d_ids, bd)


def reference_offload_job(device_tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[tuple]],
                          host_tensors: Sequence[torch.Tensor], blocks_per_chunk: int, store: bool,
                          group_sizes: Sequence[int], block_indices: Sequence[int], device_ids: Sequence[int],
                          chunk_ids: Sequence[int]) -> None:
    """One offloading job (:mod:`kvcopy.offload`'s layout), block by block: group ``g``'s
    ``i``-th block is sub-block ``p = block_indices[g] % blocks_per_chunk + i`` of the
    group's chunks, i.e. chunk ``p // blocks_per_chunk``, bytes from ``(p %
    blocks_per_chunk) * page`` of its row; each layer ``(tensor, bytes)`` of the group
    moves its first ``bytes`` bytes of the page. ``store``: device to host, else back."""
    d_at = c_at = 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
        skip = first % blocks_per_chunk
        for i in range(n):
            p = skip + i
            block, chunk, j = device_ids[d_at + i], chunk_ids[c_at + p // blocks_per_chunk], p % blocks_per_chunk
            for idx, nbytes in groups[g]:
                page = device_tensors[idx].shape[1]
                dev = device_tensors[idx][:, :nbytes]
                host = host_tensors[idx][:, j * page:j * page + nbytes]
                src, dst, s_id, d_id = (dev, host, block, chunk) if store else (host, dev, chunk, block)
                reference_copy(src, dst, [s_id], [d_id])
        d_at += n
        c_at += -(-(n + skip) // blocks_per_chunk) if n else 0
