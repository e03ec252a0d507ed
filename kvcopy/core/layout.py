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

Copies between two layouts (:func:`pair_pages`). A copy needs the same logical page
on both sides (shape without the block axis and size-1 dims, element size), not the
same order: each side keeps its own strides and the copy moves element ``[i, j, ...]``
to element ``[i, j, ...]``, as ``dst[ids] = src[ids]`` does. The pair is cut into
equal runs contiguous on both sides (a :class:`PagePairing`: run bytes, runs per page,
up to three nested (count, src stride, dst stride) dims), computed once when a copier
is built. Identical orders keep whole pages (two chunks for KV-first); a converting
pair moves the longest runs both orders allow. Pairs that work, in both directions:

* every layout above against the same layout;
* vLLM 0.33's per-layer ``[B, H, N, C]`` views of one int8 allocation in any of its six
  stride orders (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) against a contiguous
  ``[B, H, N, C]`` host buffer or another order: LBNHC/BLNHC move ``C``-element runs,
  BHLNC/LHBNC ``N x C``, LBHNC/BLHNC whole pages;
* legacy KV-first ``[2, NB, N, H, D]`` and FlashInfer ``[NB, 2, N, H, D]`` caches in
  HND stride order (views of ``[2, NB, H, N, D]`` / ``[NB, 2, H, N, D]``) against plain
  host buffers: ``D``-element runs over three dims (K/V, tokens, heads);
* any other pair of strided pages of one logical shape whose runs need at most three
  dims beyond the contiguous run (else ``ValueError`` naming both layouts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..checks import integer

KV_LAYOUTS = ("NHD", "HND")

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the same element width (a view): what
    kvcopy compares and moves, bit for bit, whatever the dtype (bf16 NaN payloads, fp8)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


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
    page_dims: Tuple[Tuple[int, int], ...]  # in-page (size, stride) in elements, logical order, size-1 dims dropped
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

    Supported: blocks-first NHD/HND, HND views of NHD storage, packed ``[NB, H, BS,
    2D]``, ``[NB, 2, BS, H, D]`` (also as an HND-order view), KV-first ``[2, NB, ...]``
    (also HND-order views), MLA ``[NB, BS, latent]``, head slices of NHD, and per-layer
    views of a cross-layer allocation (vLLM 0.33's six stride orders): any page that
    is one byte range or equal chunks along one axis. Which pairs of layouts copy into
    each other, and as which runs: :func:`pair_pages` (the module docstring lists them).
    ``block_dim`` is inferred when unambiguous (see :func:`infer_block_dim`);
    ``kv_layout`` ("NHD" or "HND") only names the token and head axes, which shapes
    alone cannot tell apart; it never changes which bytes are copied.
    """
    _check_plain_tensor(tensor)
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    shape = tuple(tensor.shape)
    if block_dim is None:
        block_dim = infer_block_dim(shape)
    else:
        block_dim = integer(block_dim, "block_dim")
    if not 0 <= block_dim < len(shape):
        raise ValueError(f"block_dim {block_dim} out of range for shape {shape}")
    itemsize = tensor.element_size()
    strides = tensor.stride()
    if tensor.numel() == 0:
        raise ValueError(f"empty KV tensor of shape {shape}")
    # In-page dims; size-1 dims carry no bytes and their strides are arbitrary (a
    # permuted single-head tensor), so they are not part of the geometry.
    live = [(shape[d], strides[d]) for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    page_geometry: Tuple[Tuple[int, Optional[int]], ...] = tuple(live)
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
        page_dims=tuple(live),
        token_dim=token_dim,
        head_dim=head_dim,
        kind=kind,
    )


def _check_plain_tensor(tensor) -> None:
    """A strided tensor whose bytes are its values: kvcopy moves bytes, so a view that
    holds its values lazily (``conj()``, a negative-bit view: the bytes are the
    unconjugated, unnegated values) would be copied as values it does not have, and a
    nested tensor has no one block axis."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise TypeError("a nested tensor has no fixed page layout: pass a strided tensor")
    if tensor.is_conj():
        raise TypeError("a conj() view holds other bytes than its values: pass tensor.resolve_conj()")
    if tensor.is_neg():
        raise TypeError("a negative-bit view holds other bytes than its values: pass tensor.resolve_neg()")
    if tensor.layout != torch.strided:
        raise TypeError(f"a {tensor.layout} tensor has no page layout: pass a strided tensor")


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


# ---------------------------------------------------------------------- page pairs
MAX_RUN_DIMS = 3  # nested (count, stride) dims the item body expands a run index with


@dataclass(frozen=True)
class PagePairing:
    """How one page of a source layout maps onto one page of a destination layout.

    A page is ``runs_per_page`` runs of ``run_bytes`` contiguous bytes on both sides;
    run ``r`` of a page starts at ``sum(i_k * src_stride_k)`` bytes into the source
    page and ``sum(i_k * dst_stride_k)`` bytes into the destination page, where
    ``r = (i_0 * count_1 + i_1) * count_2 + i_2`` over ``dims`` (outermost first, at
    most :data:`MAX_RUN_DIMS`; trivial dims are ``(1, 0, 0)``, so ``dims`` always
    has three). Identical orders give today's chunks: one run per dense page, two
    for KV-first; differing orders give the longest runs both orders allow.
    """

    run_bytes: int
    runs_per_page: int
    dims: Tuple[Tuple[int, int, int], ...]  # (count, src stride, dst stride) bytes, outermost first

    @property
    def page_bytes(self) -> int:
        return self.run_bytes * self.runs_per_page


def _coalesce(dims, key):
    """Dims sorted innermost-first by ``key``, adjacent ones merged where both sides
    continue the inner one (``stride_outer == count_inner * stride_inner``)."""
    out = []
    for n, a, b in sorted(dims, key=key):
        if out and a == out[-1][0] * out[-1][1] and b == out[-1][0] * out[-1][2]:
            m, x, y = out.pop()
            out.append((m * n, x, y))
        else:
            out.append((n, a, b))
    return out


def _layout_name(layout: PageLayout) -> str:
    strides = tuple(st for _, st in layout.page_dims)
    return (f"{layout.kind} {tuple(layout.shape)} {str(layout.dtype).replace('torch.', '')} "
            f"(block axis {layout.block_dim}, in-page strides {strides})")


def pair_pages(src: PageLayout, dst: PageLayout) -> PagePairing:
    """The run structure that copies a page of ``src`` into a page of ``dst``.

    The two pages must have the same logical shape (the dims other than the block
    axis, size-1 dims ignored) and the same element size; the copy then moves
    element ``[i, j, ...]`` of the source page to element ``[i, j, ...]`` of the
    destination page, as ``dst[ids] = src[ids]`` does, whatever either side's strides
    are. Both sides' dims are permuted alike (the order of runs is free) and merged
    where both sides are contiguous, so identical orders keep whole pages (or
    KV-first's two chunks) and converting orders get the longest common runs:
    ``C`` elements for a head-major page against a token-major one. Anything else
    raises a ``ValueError`` naming both layouts.
    """
    src_shape = tuple(n for n, _ in src.page_dims)
    dst_shape = tuple(n for n, _ in dst.page_dims)
    if src.itemsize != dst.itemsize or src_shape != dst_shape:
        what = (f"element size {src.itemsize} vs {dst.itemsize} bytes" if src.itemsize != dst.itemsize
                else f"logical page shape {src_shape} ({math.prod(src_shape)} elements) vs "
                     f"{dst_shape} ({math.prod(dst_shape)} elements)")
        raise ValueError(f"pages differ: {what}; {_layout_name(src)} vs {_layout_name(dst)}")
    isz = src.itemsize
    dims = [(n, a * isz, b * isz) for (n, a), (_, b) in zip(src.page_dims, dst.page_dims)]
    best: Optional[Tuple[Tuple[bool, int, int], int, list]] = None
    for key in (lambda d: (d[1], d[2]), lambda d: (d[2], d[1])):  # by src, then by dst stride
        merged = _coalesce(dims, key) if dims else []
        if merged and merged[0][1] == isz and merged[0][2] == isz:
            run, rest = merged[0][0] * isz, merged[1:]
        else:
            run, rest = isz, merged
        score = (len(rest) > MAX_RUN_DIMS, -run, len(rest))
        if best is None or score < best[0]:
            best = (score, run, rest)
    assert best is not None  # the loop ran twice
    _, run, rest = best
    if len(rest) > MAX_RUN_DIMS:
        raise ValueError(
            f"pages differ in more than {MAX_RUN_DIMS} nested dims beyond a contiguous run "
            f"({len(rest)}); {_layout_name(src)} vs {_layout_name(dst)}")
    runs = math.prod(n for n, _, _ in rest)
    if runs >= 2**31:
        raise ValueError(f"{runs} runs per page: more than the kernels index; "
                         f"{_layout_name(src)} vs {_layout_name(dst)}")
    outer_first = [(1, 0, 0)] * (MAX_RUN_DIMS - len(rest)) + list(reversed(rest))
    return PagePairing(run_bytes=run, runs_per_page=runs, dims=tuple(outer_first))
