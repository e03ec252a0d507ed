"""One request of a benchmark scenario, as the NIXL rows pull it: D's block ids, block
lists anchored at token 0, and D's KV checked against P's afterwards.

Shared by ``kvcopy-bench nixl`` (:mod:`.measure`), its two-host variant
(:mod:`kvcopy.bench.two_hosts_bench`) and ``bench/arena_plan_cost.py``. P's blocks are the
scenario's (:meth:`Scenario.block_ids`); D's are another permutation of the same pool
(or the pool's last runs for ``ids="contiguous"``), so D's destination never coincides
with P's source and a check of D's blocks against P's is not satisfied by chance.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch


def padded(ids: List[List[int]], counts: List[int]) -> List[List[int]]:
    """Block lists anchored at token 0: a shorter (sliding-window) list is the suffix."""
    from ...nixl import NO_BLOCK

    n = max(counts)
    return [[NO_BLOCK] * (n - len(g)) + list(g) for g in ids]


def d_block_ids(sc, num_blocks: int, seed: int) -> List[List[int]]:
    """D's blocks per group for scenario ``sc`` (as many as P's)."""
    counts = sc.blocks_per_group()
    if sc.ids == "contiguous":
        starts = np.cumsum([0] + counts[:-1]).tolist()
        return [list(range(num_blocks - s - n, num_blocks - s)) for s, n in zip(starts, counts)]
    perm = np.random.default_rng(seed + 17).permutation(num_blocks).tolist()
    out, k = [], 0
    for n in counts:
        out.append(perm[k:k + n])
        k += n
    return out


def check_kv(P, D, d_ids, block_dim: int, as_words) -> Optional[str]:
    """"ok" when D's KV holds P's bytes at every group's blocks, else what differs."""
    for g, names in enumerate(P.layer_groups):
        src = torch.tensor(P.ids[g], dtype=torch.int64)
        dst = torch.tensor(d_ids[g], dtype=torch.int64)
        for name in names:
            a = as_words(P.dev[name]).cpu().index_select(block_dim, src)
            b = as_words(D.dev[name]).cpu().index_select(block_dim, dst)
            if not torch.equal(a, b):
                return f"FAIL: group {g} layer {name!r}: D's blocks differ from P's"
    return "ok"
