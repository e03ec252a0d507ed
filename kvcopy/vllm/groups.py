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
* **What kvcopy's TransferManager registers for a model** (:func:`arena_layout`, the
  arena connector): each transfer group's layers as views kvcopy can place (attention
  ``[B, H, N, C]`` as vLLM views them, tokens per page ``N``; MLA ``[B, N, C]``; state
  rows ``[NB, state bytes]``, whose block stride is the padded page), tokens per block
  and per page per group. A state group has no token axis: it is declared with
  :data:`STATE_TOKENS` tokens per block and per page, so every prompt is one page
  position of it, and a request's state block is that one position on both sides.
  :func:`positions` turns a request's block table into the token-anchored lists kvcopy
  plans with (null blocks, prefix-cache hits and padding as ``NO_BLOCK``).
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

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.v1.kv_cache_interface import MambaSpec, iter_layer_specs

from ..nixl.planning.pack_order import STATE_PAGE_TOKENS
from ..nixl.planning.plan import NO_BLOCK

# Tokens per block and per page of a state group in kvcopy's plans: the largest a
# handshake allows (kvcopy.nixl.engine.info.MAX_TOKENS_PER_BLOCK). A prompt of at most
# this many tokens is one page position, the state after the prompt; the pack order
# stages regions of this many tokens per page after every attention layer.
STATE_TOKENS = STATE_PAGE_TOKENS


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


def kv_sharing_layers(vllm_config) -> List[str]:
    """Layers that read another layer's KV, from the model's attention modules."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    return [name for name, mod in ctx.items() if getattr(mod, "kv_sharing_target_layer_name", None)]


def host_mirror_bytes(kv_caches: Mapping[str, torch.Tensor]) -> int:
    """The host memory vLLM's ``initialize_host_xfer_buffer`` allocates for these caches:
    one buffer per layer name, as large as the layer's view (aliased layers each get one)."""
    return sum(t.numel() * t.element_size() for t in kv_caches.values())


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


@dataclass(frozen=True)
class GroupTokens:
    """Per transfer group, what kvcopy's plans need from ``kv_cache_config`` alone (the
    scheduler has no caches): tokens per block (:data:`STATE_TOKENS` for a state
    group), whether it is a state group, its index in ``kv_cache_groups``, and for
    state groups vLLM's speculative scratch blocks (dropped from a request's list)."""

    tokens_per_block: Tuple[int, ...]
    state: Tuple[bool, ...]
    kv_group: Tuple[int, ...]
    spec_blocks: Tuple[int, ...]


def group_tokens(kv_cache_config) -> GroupTokens:
    groups = kv_cache_config.transfer_groups
    state = tuple(is_state_group(g) for g in groups)
    spec_blocks = tuple(max((int(s.num_speculative_blocks) for s in iter_layer_specs(g.kv_cache_spec)
                             if isinstance(s, MambaSpec)), default=0) for g in groups)
    return GroupTokens(
        tuple(STATE_TOKENS if st else int(g.kv_cache_spec.block_size) for g, st in zip(groups, state)),
        state, tuple(kv_cache_config.transfer_group_ids), spec_blocks)


@dataclass(frozen=True)
class ArenaLayout:
    """A model's transfer groups as kvcopy's ``TransferManager`` takes them (see the
    module docstring): the views it registers, per group its layers and tokens per
    kernel page, and :class:`GroupTokens`."""

    caches: Dict[str, torch.Tensor]
    groups: Tuple[Tuple[str, ...], ...]
    tokens_per_page: Tuple[int, ...]
    tokens: GroupTokens


def arena_layout(kv_cache_config, kv_caches: Mapping[str, torch.Tensor], kv_sharing_layers=(),
                 use_mla: bool = False) -> ArenaLayout:
    """What an arena ``TransferManager`` registers for vLLM's caches (``kv_caches`` as
    ``register_kv_caches`` gets them). Raises ``ValueError`` naming the group where a
    group's layers disagree on tokens per page, or pages do not divide the block."""
    groups = transfer_layer_groups(kv_cache_config, kv_caches, kv_sharing_layers)
    tokens = group_tokens(kv_cache_config)
    views: Dict[str, torch.Tensor] = {}
    tpp = []
    for g, names in enumerate(groups):
        if not names:
            raise ValueError(f"transfer group {g} has no layer with a KV cache")
        if tokens.state[g]:
            for n in names:  # [NB, 1, 1, state bytes] int8, block stride the padded page
                views[n] = kv_caches[n][:, 0, 0, :]
            tpp.append(STATE_TOKENS)
            continue
        pages = {int(kv_caches[n].shape[2]) for n in names}  # [B, H, N, C]: N tokens per kernel page
        block = tokens.tokens_per_block[g]
        if len(pages) != 1 or block % next(iter(pages)):
            raise ValueError(f"transfer group {g}: tokens per page {sorted(pages)} of its layers do not divide "
                             f"its block size {block}")
        for n in names:
            views[n] = kv_caches[n][:, 0] if use_mla else kv_caches[n]  # MLA: [B, 1, N, C] -> [B, N, C]
        tpp.append(pages.pop())
    return ArenaLayout(views, tuple(tuple(n) for n in groups), tuple(tpp), tokens)


def positions(tokens: GroupTokens, block_ids: Sequence[Sequence[int]], num_tokens: int,
              skip: Optional[Sequence[Sequence[bool]]] = None) -> List[List[int]]:
    """A request's blocks per transfer group (vLLM's table, anchored at token 0) as the
    lists kvcopy plans with: attention groups cut or padded (``NO_BLOCK``) to the blocks
    holding ``num_tokens``, vLLM's null block (id 0) and blocks flagged in ``skip`` (a
    prefix-cache hit D must not write) as ``NO_BLOCK``; a state group's running-state
    block alone (vLLM's ``clip_ssm_state_blocks``)."""
    out = []
    for g, ids in enumerate(block_ids):
        ids = list(ids)
        if tokens.state[g]:
            keep = clip_ssm_state_blocks(ids, tokens.spec_blocks[g])
            out.append([keep[0] if keep and keep[0] != 0 else NO_BLOCK])
            continue
        n = -(-num_tokens // tokens.tokens_per_block[g])
        flags = list(skip[g]) if skip is not None else []
        row = [NO_BLOCK if b == 0 or (i < len(flags) and flags[i]) else int(b) for i, b in enumerate(ids[:n])]
        out.append(row + [NO_BLOCK] * (n - len(row)))
    return out
