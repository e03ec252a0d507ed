"""Backend ``torch``: the reference copy applied entry by entry (any device).

One ``index_select`` + ``index_copy_`` per (group, layer): groups x layers operations,
the cost seeds/2 measured. It exists as the oracle and as the path of last resort.
"""
from __future__ import annotations

import torch

from ..reference import reference_copy
from ..tables import CallPlan, CopyTables
from . import Backend


class TorchBackend(Backend):
    name = "torch"

    def copy(self, tables: CopyTables, call: CallPlan) -> None:
        for g in range(tables.num_groups):
            if len(call.src_ids[g]) == 0:
                continue
            src_ids = torch.from_numpy(call.src_ids[g])
            dst_ids = torch.from_numpy(call.dst_ids[g])
            for e in tables.group_entry_ids(g):
                src = tables.src_tensors[e]
                dst = tables.dst_tensors[e]
                reference_copy(src, dst, src_ids, dst_ids, tables.src_block_dims[e], tables.dst_block_dims[e])
