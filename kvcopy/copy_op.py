"""``copy_blocks``: a drop-in for vLLM's ``CopyBlocksOp`` (``copy_kv_blocks``).

    connector.set_host_xfer_buffer_ops(kvcopy.copy_blocks)

Same signature and meaning: ``src_kv_caches`` and ``dst_kv_caches`` map layer names
to tensors, one id list applies to every layer, ``direction`` is ``"h2d"`` (host
buffers to device caches) or ``"d2h"``. Unlike vLLM's it raises on lists of different
lengths, unknown layers and a direction that contradicts where the tensors live;
empty lists are a no-op.

One id list for every layer is exactly seeds/1's bug when layers of different KV cache
groups share a device tensor (hybrid models) or a layer reads another's KV: unfilled
host pages of one layer overwrite another's received blocks. kvcopy refuses that
input instead of corrupting KV: an ``h2d`` call whose device tensors are shared by
layers with different host buffers raises ``ValueError`` ("write the same device
bytes from different sources"). Such models need the per-group masks of
:class:`~kvcopy.copier.BlockCopier` (README, "vLLM integration").

The caches vLLM passes are the same tensors on every call, so the validated
:class:`~kvcopy.copier.BlockCopier` for them is built once and cached, keyed by every
tensor's address and geometry. Building the key walks the layers (a few us per
layer); code that owns its caches should hold a ``BlockCopier`` and skip that. Up to 8
copiers are kept; evicting one (a 9th set of caches) closes it, which synchronizes the
device before its tables are freed and its host memory unpinned.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch

from .copier import BlockCopier

_CACHE_SIZE = 8
_copiers: "OrderedDict[tuple, BlockCopier]" = OrderedDict()


def _key(caches: Mapping[str, torch.Tensor]) -> tuple:
    return tuple(
        (name, t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        for name, t in caches.items()
    )


def copy_blocks(
    src_kv_caches: Mapping[str, torch.Tensor],
    dst_kv_caches: Mapping[str, torch.Tensor],
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    direction: str,
    *,
    backend: str = "auto",
) -> None:
    """Copy blocks ``src_block_ids[i] -> dst_block_ids[i]`` of every layer, one call."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"{len(src_block_ids)} source block ids but {len(dst_block_ids)} destination block ids"
        )
    if len(src_block_ids) == 0:
        return
    missing = set(src_kv_caches).symmetric_difference(dst_kv_caches)
    if missing:
        raise ValueError(f"layers not in both source and destination caches: {sorted(missing)}")
    host, device = (src_kv_caches, dst_kv_caches) if direction == "h2d" else (dst_kv_caches, src_kv_caches)
    for name, t in host.items():
        if t.device.type != "cpu":
            side = "source" if direction == "h2d" else "destination"
            raise ValueError(
                f"direction {direction!r} but {side} layer {name!r} is on {t.device}, not the host"
            )
    key = (_key(device), _key(host), backend)
    copier = _copiers.get(key)
    if copier is None:
        copier = BlockCopier(device, host, [list(device)], backend=backend)
        _copiers[key] = copier
        if len(_copiers) > _CACHE_SIZE:
            _copiers.popitem(last=False)[1].close()
    else:
        _copiers.move_to_end(key)
    if direction == "h2d":
        copier.to_device([dst_block_ids], [src_block_ids])
    else:
        copier.to_host([src_block_ids], [dst_block_ids])
