"""vLLM 0.33's KV cache groups as kvcopy copies them: layers, block units, host buffers.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

What a connector needs to know about a model's groups, whatever moves the bytes (the
mirror connector's host buffers, or a staging arena):

* **Which layers each transfer group copies** (:func:`transfer_layer_groups`): the
  layers of ``kv_cache_config.transfer_groups``, the ones vLLM's NIXL worker registers;
  KV-sharing layers (they read another layer's KV) never.
* **What a group's block ids count** (:func:`pages_per_block`,
  :func:`kernel_block_ids`): vLLM views attention layers in kernel pages (a block of
  ``block_size`` tokens split into ``ratio`` pages the attention kernel supports: the
  device view is ``[NB * ratio, H, N / ratio, C]``) and Mamba/GDN state in blocks (an
  int8 view ``[NB, 1, 1, state bytes]``, never split). So an attention group's ids are
  kernel pages and a state group's ids logical blocks, as vLLM's
  ``_logical_to_kernel_block_ids`` gives them; kvcopy's copier takes each group's ids
  in its own view's unit, and checks that no logical block is named by two groups.
* **Which host buffer NIXL's region for a layer needs** (:func:`state_host_buffers`):
  vLLM's worker allocates each layer's host buffer in the device view's logical shape,
  contiguous, but sizes a Mamba layer's NIXL region (and its conv/SSM descriptors) with
  the spec's page, which vLLM pads to the largest page of the model. Where the state is
  smaller than that page (every real attention + GDN model), the region spans past the
  buffer and NIXL refuses the descriptors (``NIXL_ERR_NOT_FOUND``). The host buffer
  that fits is the state view ``[NB, 1, 1, state bytes]`` with the padded page as its
  block stride: what :func:`state_host_buffers` allocates.

Layout of the groups on the device (``allocate_kv_cache``): one int8 allocation, every
group's layers views of it from byte 0 (layer-outermost: layer ``l`` of each group at
``l * NB * page``; block-outermost layouts: each block a row of all of a group's pages).
Groups' pages may differ in shape and size (padded to the largest page, a doubled block
size, pages packed side by side, kernel pages over state blocks); block ids are unique
across groups (one block pool), so one group's writes never touch another's bytes.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs


def transfer_layer_groups(kv_cache_config, host_buffers, kv_sharing_layers=()) -> List[List[str]]:
    """Layer names per transfer group, as vLLM's NIXL worker registers them.

    vLLM's worker registers (and NIXL fills) the host buffer of a layer only when the
    layer is in a transfer group of the connector's ``kv_cache_config``; a KV-sharing
    layer gets a host buffer (one per ``kv_caches`` entry) but no group, so it is left
    out. ``kv_sharing_layers`` names layers to leave out even if a group lists them
    (the model runner appends them to its own copy of the groups).
    """
    skip = set(kv_sharing_layers)
    return [
        [n for n in group.layer_names if n in host_buffers and n not in skip]
        for group in kv_cache_config.transfer_groups
    ]


def is_state_group(group) -> bool:
    """Whether a KV cache group holds Mamba/GDN state (blocks never split into pages)."""
    return any(isinstance(spec, MambaSpec) for spec in iter_layer_specs(group.kv_cache_spec))


def pages_per_block(kv_cache_config, kernel_pages: int) -> Tuple[int, ...]:
    """Per transfer group, the device view's pages per block id: ``kernel_pages`` (vLLM's
    ``_physical_blocks_per_logical_kv_block``) for attention groups, 1 for state groups."""
    return tuple(1 if is_state_group(g) else kernel_pages for g in kv_cache_config.transfer_groups)


def kernel_block_ids(block_ids: Sequence[Sequence[int]], pages: Sequence[int]) -> List[List[int]]:
    """Logical block ids per group to the ids of each group's device view: block ``b``
    of a group with ``r`` pages per block is pages ``b * r .. b * r + r - 1``."""
    return [list(ids) if r == 1 else [b * r + j for b in ids for j in range(r)]
            for ids, r in zip(block_ids, pages)]


def state_host_buffers(kv_cache_config, device_caches: Mapping[str, torch.Tensor],
                       host_buffers: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Host buffers for the Mamba/GDN layers whose buffer from vLLM is smaller than the
    NIXL region vLLM registers for it: per layer, the device view's shape (int8
    ``[NB, 1, 1, state bytes]``) with the spec's (padded) page as block stride, so
    region block ``b`` (``b * page`` bytes in) holds block ``b``'s state. Layers whose
    buffer already has that stride are not in the result."""
    out = {}
    for group in kv_cache_config.transfer_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            spec = specs[name] if specs is not None else group.kv_cache_spec
            if not isinstance(spec, MambaSpec) or name not in host_buffers:
                continue
            have, dev = host_buffers[name], device_caches[name]
            page = spec.page_size_bytes
            if have.stride(0) * have.element_size() == page:
                continue
            state = dev[0].numel() * dev.element_size()
            rows = torch.empty((dev.shape[0], page), dtype=torch.uint8)
            out[name] = rows[:, :state].view(dev.dtype).view((dev.shape[0],) + tuple(dev.shape[1:]))
    return out
