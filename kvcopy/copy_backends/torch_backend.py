"""Backend ``torch``: each (group, layer) copied with ``index_select``/``index_copy_`` (any device).

One gather and one scatter per (group, entry): groups x layers operations, the cost of
vLLM's per-layer loop. It is the path of last resort, for devices and tensors no fused
backend runs. Tensors are reinterpreted as integers of their element width first
(:func:`kvcopy.core.layout.as_words`), so the copy is bit-exact for every dtype and never
does float arithmetic; each side is indexed along its own block axis, so a page's
element ``[i, j, ...]`` lands at ``[i, j, ...]`` whatever either side's strides are.
Checksums are the oracle's (:func:`kvcopy.core.checksum.table_checksums`, numpy over the
host pages after the copy): a second pass, and a host wait for a GPU copy.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import Backend
from ..core.checksum import table_checksums
from ..core.layout import as_words
from ..core.tables import CallPlan, CopyTables


class TorchBackend(Backend):
    name = "torch"

    def copy(self, tables: CopyTables, call: CallPlan, max_ctas: Optional[int] = None) -> None:  # no grid
        for g, (src_ids, dst_ids) in enumerate(zip(call.src_ids, call.dst_ids)):
            if len(src_ids) == 0:
                continue
            src_index = torch.tensor(src_ids, dtype=torch.int64)
            dst_index = torch.tensor(dst_ids, dtype=torch.int64)
            for e in tables.group_entry_ids(g):
                _copy_pages(tables.src_tensors[e], tables.dst_tensors[e], src_index, dst_index,
                            tables.src_block_dims[e], tables.dst_block_dims[e])

    def checksum_reason(self, tables: CopyTables) -> None:
        return None

    def copy_with_checksums(self, tables: CopyTables, call: CallPlan, out: torch.Tensor,
                            max_ctas: Optional[int] = None) -> None:
        self.copy(tables, call)  # a copy to the host waits for the device (pages.to(host) is blocking)
        out.copy_(torch.from_numpy(table_checksums(tables, call).view("int64")))


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor,
                src_block_dim: int, dst_block_dim: int) -> None:
    """Pages ``src_index`` of ``src`` to pages ``dst_index`` of ``dst``, in place."""
    pages = as_words(src).movedim(src_block_dim, 0).index_select(0, src_index.to(src.device))
    out = as_words(dst).movedim(dst_block_dim, 0)  # a view: index_copy_ writes through it
    out.index_copy_(0, dst_index.to(dst.device), pages.to(dst.device).reshape((len(dst_index),) + out.shape[1:]))
