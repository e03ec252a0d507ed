"""``copy_blocks``: a drop-in for vLLM 0.33's ``CopyBlocksOp`` (``copy_kv_blocks``).

    connector.set_host_xfer_buffer_ops(kvcopy.copy_blocks)

Same signature, same return (``None``), same bytes: for each layer name of
``src_kv_caches``, block ``src_block_ids[i]`` of the source tensor is written to block
``dst_block_ids[i]`` of ``dst_kv_caches``' tensor of that name (``dst[ids] = src[ids]``
on dim 0 of the logical tensor, as vLLM's ``insert_blocks_to_device`` /
``swap_out_blocks_to_host`` do). ``direction`` is ``"h2d"`` (host buffers to device
caches) or ``"d2h"``. As in vLLM, nothing happens when either dict or either id list
is empty or the lists differ in length, and ``dst_kv_caches`` may hold layers the
source does not (they are left alone). d2h from device bytes that several layers
share (hybrid groups overlaid from byte 0, KV-sharing layers) into their separate host
buffers is well defined and done.

Refused (``ValueError``/``TypeError``, nothing written):

* **Order-dependent h2d.** Layers that write the same device bytes from different host
  buffers at the same ids: vLLM's result is whichever layer its dict loop visits last
  (in hybrid models, one group's unfilled host pages overwrite another group's received
  KV, and a KV-sharing layer's never-filled host buffer overwrites its target's). Such
  models need per-group masks: :class:`kvcopy.vllm.KvcopyNixlConnector`, or a
  :class:`~kvcopy.core.copier.BlockCopier` with the groups.
* Inputs vLLM's callers never produce (``save_kv_to_host``, ``sync_recved_kv_to_device``:
  unique, in-range kernel-page ids, the worker's own caches and host buffers): a source
  layer missing from ``dst_kv_caches`` (vLLM: ``KeyError``), ids out of range or
  negative (vLLM: ``IndexError``, or a wrapped index), a destination id repeated
  (order-dependent in torch), a direction other than ``"h2d"``/``"d2h"`` or one that
  contradicts where the tensors live, host and device pages of different element
  sizes or shapes (vLLM would convert dtypes or broadcast). Layout-converting copies
  (a contiguous host buffer for a head-strided device cache: LHBNC, BLNHC, BHLNC, or
  LBNHC under ``enable_permute_local_kv``) are done element for element, as vLLM's.

The caches vLLM passes are the same tensors on every call, so the validated
:class:`~kvcopy.core.copier.BlockCopier` for them is built once (one direction) and cached,
keyed by every tensor's address and geometry. Building the key walks the layers (a
few us per layer); code that owns its caches should hold a ``BlockCopier`` and skip
that. Up to 8 copiers are kept; evicting one (a 9th set of caches) closes it, which
synchronizes the device before its tables are freed and its host memory unpinned.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch

from .copier import BlockCopier

_CACHE_SIZE = 8
_copiers: "OrderedDict[tuple, BlockCopier]" = OrderedDict()

_CONNECTOR_HINT = (
    "vLLM's copy_kv_blocks would leave whichever layer it copies last; per-group masks "
    "fix this: use the kvcopy.vllm.KvcopyNixlConnector connector "
    "(kv_connector_module_path='kvcopy.vllm'), or a kvcopy.BlockCopier built with the "
    "model's KV cache groups"
)


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
    """Copy blocks ``src_block_ids[i] -> dst_block_ids[i]`` of every source layer, one call."""
    if (not src_kv_caches or not dst_kv_caches or len(src_block_ids) == 0
            or len(dst_block_ids) == 0 or len(src_block_ids) != len(dst_block_ids)):
        return  # vLLM's copy_kv_blocks returns here too
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    _check_caches(src_kv_caches, "src_kv_caches")
    _check_caches(dst_kv_caches, "dst_kv_caches")
    missing = [name for name in src_kv_caches if name not in dst_kv_caches]
    if missing:
        raise ValueError(f"source layers not in the destination caches: {missing}")
    dst = {name: dst_kv_caches[name] for name in src_kv_caches}
    host, device = (src_kv_caches, dst) if direction == "h2d" else (dst, src_kv_caches)
    for name, t in host.items():
        if t.device.type != "cpu":
            side = "source" if direction == "h2d" else "destination"
            raise ValueError(
                f"direction {direction!r} but {side} layer {name!r} is on {t.device}, not the host"
            )
    key = (direction, _key(device), _key(host), backend)
    copier = _copiers.get(key)
    if copier is None:
        copier = _build(device, host, direction, backend)
        _copiers[key] = copier
        if len(_copiers) > _CACHE_SIZE:
            _copiers.popitem(last=False)[1].close()
    else:
        _copiers.move_to_end(key)
    if direction == "h2d":
        copier.to_device([dst_block_ids], [src_block_ids])
    else:
        copier.to_host([src_block_ids], [dst_block_ids])


def _check_caches(caches, what: str) -> None:
    """A mapping of layer names to torch tensors (a numpy array is refused, not copied)."""
    if not isinstance(caches, Mapping):
        raise TypeError(f"{what} must be a mapping of layer names to tensors, got {type(caches).__name__}")
    for name, t in caches.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{name!r}] is a {type(t).__name__}, not a torch.Tensor")


def _build(device, host, direction: str, backend: str) -> BlockCopier:
    try:
        return BlockCopier(device, host, [list(device)], copy_backend=backend, directions=(direction,))
    except ValueError as exc:
        if direction == "h2d" and ("same device bytes" in str(exc) or "overlap" in str(exc)):
            raise ValueError(
                f"copy_blocks h2d is order-dependent for these caches: {exc}. {_CONNECTOR_HINT}"
            ) from None
        raise
