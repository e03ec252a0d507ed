"""Where each block's bytes sit in a paged KV tensor.

A KV tensor has one block axis. Selecting block ``b`` on it gives the block's page;
kvcopy moves pages as bytes, so all it needs to know is where those bytes are:

* blocks-first ``[NB, ...]``: NHD ``[NB, BS, H, D]``, HND ``[NB, H, BS, D]``, packed
  ``[NB, H, BS, 2D]``, ``[NB, 2, BS, H, D]``, MLA ``[NB, BS, latent]``, and HND views of
  NHD storage (a ``(B, N, H, 2D)`` allocation viewed ``(B, H, N, 2D)``): the page is one
  contiguous byte range (one chunk).
* KV-first ``[2, NB, ...]``: the page is two chunks, K and V, ``NB`` pages apart.

A page is described as ``num_chunks`` byte ranges of ``chunk_bytes`` each, chunk ``c``
of block ``b`` starting at ``b * block_stride + c * chunk_stride`` bytes from the
tensor's first element. One axis may index chunks: K/V of a KV-first tensor, or the
tokens of a head slice of an NHD tensor (one chunk per token). A page that needs more
than that, or whose chunks overlap other blocks' bytes, is refused with a
``ValueError``: kvcopy never copies bytes it cannot place exactly.

Two tensors hold the same page geometry when their pages have the same element size
and the same in-page (shape, stride) list: then byte ``k`` of a page means the same
element on both sides, whatever the dtype is called (bf16 vs int16 host buffers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

KV_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class PageLayout:
    """Byte geometry of a paged KV tensor; built by :func:`describe`."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    itemsize: int
    block_dim: int
    num_blocks: int
    block_stride: int  # bytes between block b and b+1
    num_chunks: int  # contiguous byte ranges per page (1, or 2 for KV-first)
    chunk_stride: int  # bytes between chunk c and c+1 of one page (0 if one chunk)
    chunk_bytes: int
    page_geometry: Tuple[Tuple[int, Optional[int]], ...]  # in-page (size, stride), elements; None: the chunk axis
    token_dim: Optional[int]  # axis of tokens within the tensor, where known
    head_dim: Optional[int]  # axis of KV heads, where the tensor has one
    kind: str  # "kv_first", "blocks_first", "mla" or "flat"

    @property
    def page_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def same_page_geometry(self, other: "PageLayout") -> bool:
        return (
            self.itemsize == other.itemsize
            and self.page_geometry == other.page_geometry
            and self.num_chunks == other.num_chunks
            and self.chunk_bytes == other.chunk_bytes
        )

    def describe_difference(self, other: "PageLayout") -> str:
        parts = []
        if self.itemsize != other.itemsize:
            parts.append(f"element size {self.itemsize} vs {other.itemsize} bytes")
        if self.page_geometry != other.page_geometry:
            parts.append(
                f"page (size, stride) {list(self.page_geometry)} vs {list(other.page_geometry)}"
            )
        if (self.num_chunks, self.chunk_bytes) != (other.num_chunks, other.chunk_bytes):
            parts.append(
                f"{self.num_chunks}x{self.chunk_bytes} vs {other.num_chunks}x{other.chunk_bytes} chunk bytes"
            )
        return "; ".join(parts) or "none"


def infer_block_dim(shape: Tuple[int, ...]) -> int:
    """The block axis when the shape says it unambiguously, else ``ValueError``.

    Blocks-first unless the tensor is 5-D and starts with a K/V axis of 2 (KV-first
    ``[2, NB, BS, H, D]``). ``[2, 2, ...]`` cannot be told apart: pass ``block_dim``.
    """
    if len(shape) < 2:
        raise ValueError(f"a paged KV tensor has at least 2 dims, got shape {tuple(shape)}")
    if len(shape) == 5 and shape[0] == 2:
        if shape[1] == 2:
            raise ValueError(
                f"shape {tuple(shape)} is KV-first [2, NB, ...] or blocks-first "
                "[NB=2, 2, ...]: pass block_dim=0 or block_dim=1"
            )
        return 1
    return 0


def _axes(ndim: int, block_dim: int, kv_layout: str) -> Tuple[Optional[int], Optional[int], str]:
    """(token axis, head axis, kind) for the known layouts."""
    if block_dim == 1 and ndim == 5:  # [2, NB, BS, H, D] or [2, NB, H, BS, D]
        return (2, 3, "kv_first") if kv_layout == "NHD" else (3, 2, "kv_first")
    if block_dim == 0 and ndim == 5:  # [NB, 2, BS, H, D] or [NB, 2, H, BS, D]
        return (2, 3, "blocks_first") if kv_layout == "NHD" else (3, 2, "blocks_first")
    if block_dim == 0 and ndim == 4:  # [NB, BS, H, D] or [NB, H, BS, D(2D)]
        return (1, 2, "blocks_first") if kv_layout == "NHD" else (2, 1, "blocks_first")
    if block_dim == 0 and ndim == 3:  # MLA [NB, BS, latent]
        return 1, None, "mla"
    return None, None, "flat"


def _dense_span(sizes_strides) -> Optional[int]:
    """Elements covered if these (size, stride) dims tile one contiguous range."""
    expected = 1
    for size, stride in sorted(sizes_strides, key=lambda p: p[1]):
        if stride != expected:
            return None
        expected *= size
    return expected


def describe(
    tensor: torch.Tensor, block_dim: Optional[int] = None, kv_layout: str = "NHD"
) -> PageLayout:
    """Describe where each block's bytes sit in ``tensor``.

    ``block_dim`` is inferred when unambiguous (see :func:`infer_block_dim`);
    ``kv_layout`` ("NHD" or "HND") only names the token and head axes, which shapes
    alone cannot tell apart; it never changes which bytes are copied.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    shape = tuple(tensor.shape)
    if block_dim is None:
        block_dim = infer_block_dim(shape)
    if not 0 <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for shape {shape}")
    itemsize = tensor.element_size()
    strides = tensor.stride()
    if tensor.numel() == 0:
        raise ValueError(f"empty KV tensor of shape {shape}")
    # In-page dims; size-1 dims carry no bytes and their strides are arbitrary (a
    # permuted single-head tensor), so they are not part of the geometry.
    live = [(shape[d], strides[d]) for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    page_geometry = tuple(live)
    span = _dense_span(live)
    if span is not None:
        num_chunks, chunk_stride, chunk_elems = 1, 0, span
    else:
        # KV-first: the slowest in-page dim indexes chunks; the rest must be dense.
        outer = max(live, key=lambda p: p[1])
        rest = list(live)
        rest.remove(outer)
        span = _dense_span(rest)
        if span is None or outer[1] < span:
            raise ValueError(
                f"a block of the tensor of shape {shape} and strides {strides} "
                f"(block_dim={block_dim}) is not one contiguous byte range or a set of "
                "equal contiguous chunks; kvcopy cannot place its bytes"
            )
        num_chunks, chunk_stride, chunk_elems = outer[0], outer[1] * itemsize, span
        # Where the chunks sit is the tensor's business (it depends on the number of
        # blocks in KV-first tensors); what a chunk holds is the page geometry.
        page_geometry = tuple((sz, None if (sz, st) == outer else st) for sz, st in live)
    token_dim, head_dim, kind = _axes(len(shape), block_dim, kv_layout)
    block_stride = strides[block_dim] * itemsize
    chunk_bytes = chunk_elems * itemsize
    num_blocks = shape[block_dim]
    if num_blocks > 1 and not chunks_disjoint(num_blocks, block_stride, num_chunks, chunk_stride, chunk_bytes):
        raise ValueError(f"blocks of the tensor of shape {shape} overlap (strides {strides})")
    return PageLayout(
        shape=shape,
        dtype=tensor.dtype,
        itemsize=itemsize,
        block_dim=block_dim,
        num_blocks=num_blocks,
        block_stride=block_stride,
        num_chunks=num_chunks,
        chunk_stride=chunk_stride,
        chunk_bytes=chunk_bytes,
        page_geometry=page_geometry,
        token_dim=token_dim,
        head_dim=head_dim,
        kind=kind,
    )


def chunks_disjoint(nb: int, block_stride: int, nc: int, chunk_stride: int, chunk_bytes: int) -> bool:
    """Whether every (block, chunk) byte range is disjoint from the others: chunks inside
    blocks (blocks outermost) or blocks inside chunks (KV-first: chunks outermost)."""
    if nc == 1:
        return block_stride >= chunk_bytes
    blocks_outer = chunk_stride >= chunk_bytes and block_stride >= nc * chunk_stride
    chunks_outer = block_stride >= chunk_bytes and chunk_stride >= nb * block_stride
    return blocks_outer or chunks_outer


def byte_extent(tensor: torch.Tensor) -> Tuple[int, int]:
    """[start, end) byte range the tensor's elements can touch."""
    start = tensor.data_ptr()
    span = 1 + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride()) if s > 0)
    return start, start + span * tensor.element_size()


def alignment(*values: int) -> int:
    """Largest power of two up to 16 dividing every value (the widest safe word)."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    a = 16
    while a > 1 and g % a:
        a //= 2
    return a
