"""What the fused CUDA kernel reads besides the KV tensors, and how many CTAs it gets.

Two int64 arrays (``kernels/block_copy_kernel.cuh``):

* the **static table** (:func:`static_table`), uploaded once per copier direction:
  ``entries (E x KVCOPY_ENTRY_FIELDS) | group_offsets (G+1) | group_entries | entry byte prefix``, the
  last one the bytes of one block summed over the group entries before each, so a
  warp finds its entry with a binary search;
* the **call array** (``CallPlan.words``; :func:`call_array` as numpy), per call: the packed call
  of :mod:`kvcopy.core.tables` followed by its block prefix, as the call planner wrote it
  in one buffer (``CallPlan.prefix_words``).

The grid rule (:func:`grid_size`; its constant part :func:`grid_cap`): enough CTAs that each warp moves at least
``MIN_BYTES_PER_WARP`` bytes (below that, finding its first byte costs more than the
copy), at most one wave of ``CTAS_PER_SM`` CTAs per SM, at most the copier's
``max_ctas`` and at most the call's own cap when it has one (``BlockCopier.run(...,
max_ctas=)``: :func:`call_cap`). Both CUDA launchers (the library's and NVRTC's) use these; the
Triton backend uses :func:`call_cap` too (its own grid rule is in ``kernels/triton_copy.py``).
"""
from __future__ import annotations

from typing import Optional, overload

import numpy as np

from ..checks import env_int
from ..core.tables import RUN_BYTES, RUNS_PER_PAGE, CallPlan, CopyTables

THREADS = 512  # KVCOPY_THREADS in kernels/block_copy_kernel.cuh
INLINE_WORDS = 480  # KVCOPY_INLINE_WORDS: call arrays up to this size travel in the kernel parameters
# A warp gets at least this many bytes: below it the seek costs more than the copy.
MIN_BYTES_PER_WARP = env_int("KVCOPY_MIN_BYTES_PER_WARP", 4096, minimum=1)
# CTAs per SM when uncapped (the kernel uses 124-128 registers x 512 threads: one fits).
CTAS_PER_SM = env_int("KVCOPY_CTAS_PER_SM", 1, minimum=1)


# A CTA is launched for each this many bytes of a call (MIN_BYTES_PER_WARP per warp).
CTA_MIN_BYTES = THREADS // 32 * MIN_BYTES_PER_WARP


def grid_cap(sm_count: int, max_ctas: Optional[int]) -> int:
    """The most CTAs a call gets: one wave (CTAS_PER_SM per SM), at most ``max_ctas``;
    constant per copier direction."""
    cap = sm_count * CTAS_PER_SM
    return min(cap, int(max_ctas)) if max_ctas else cap


@overload
def call_cap(copier_cap: int, call_max_ctas: Optional[int]) -> int: ...


@overload
def call_cap(copier_cap: Optional[int], call_max_ctas: Optional[int]) -> Optional[int]: ...


def call_cap(copier_cap: Optional[int], call_max_ctas: Optional[int]) -> Optional[int]:
    """One call's cap: the copier's ``max_ctas`` and the call's, the smaller of those
    given (None: neither). The CUDA launchers and Triton's (whose copier cap is always
    set, so its result is an int) share this rule."""
    if call_max_ctas is None:
        return copier_cap
    return call_max_ctas if copier_cap is None else min(copier_cap, call_max_ctas)


def grid_size(total_bytes: int, sm_count: int, max_ctas: Optional[int]) -> int:
    """CTAs for a call of ``total_bytes``: enough warps that each has >=
    MIN_BYTES_PER_WARP, at most :func:`grid_cap`, at least one."""
    return max(1, min(-(-total_bytes // CTA_MIN_BYTES), grid_cap(sm_count, max_ctas)))


def static_table(tables: CopyTables, entries: Optional[np.ndarray] = None) -> np.ndarray:
    """entries | group_offsets | group_entries | entry_bytes_prefix, one int64 array
    (``entries`` replaces the tables' own rows, e.g. with translated host pointers)."""
    e = tables.entries if entries is None else entries
    page = (e[:, RUN_BYTES] * e[:, RUNS_PER_PAGE]) if len(e) else np.zeros(0, np.int64)
    prefix = np.zeros(len(tables.group_entries) + 1, dtype=np.int64)
    if len(tables.group_entries):
        np.cumsum(page[tables.group_entries], out=prefix[1:])
    return np.concatenate([e.ravel(), tables.group_offsets, tables.group_entries, prefix]).astype(np.int64)


def call_array(call: CallPlan) -> np.ndarray:
    """The call array as numpy (read-only: the packed call followed by its block prefix)."""
    return np.frombuffer(call.words, dtype=np.int64, count=call.num_words)
