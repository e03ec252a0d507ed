"""Page checksums computed by the copies themselves: the definition, and its numpy oracle.

``BlockCopier.to_host(ids, checksums=out)`` (and ``to_device``, ``run``) fills ``out``
with one 64-bit sum per block of the call (per ``(group, i)``, summed over the group's
layers), computed by the copy from the words it moves: no second pass over memory
(``csrc/cpu_copy.cpp``, ``kernels/block_copy_kernel.cuh``, ``kernels/triton_copy.py``).
``torch`` computes it here after its copy (:func:`table_checksums`: a second pass, and a
host wait on a GPU copy), which is also the oracle every backend is held to, bit for
bit. ``ce`` cannot (copy engines never bring the bytes into an SM): it raises, and
``auto`` hands such a call to its SM kernel.

Definition (``kernels/page_checksum.cuh`` is the same in C++)
---------------------------------------------------------------
For block ``i`` of group ``g``::

    sum[g, i] = SUM over k, r, j of  term(word(k, r, j) XOR key(pos, k))   (mod 2^64)
    key(pos, k) = (pos + 1) * 0x9E3779B97F4A7C15 + k * 0xC2B2AE3D27D4EB4F
    term(x)     = lo32(x) * hi32(x) + x     (the 64-bit product of x's two 32-bit halves)

* ``k``: the layer's position in the group (the copier's deduplicated entry list);
* ``r``: a run of the page: the bytes contiguous on both sides of the copy
  (:class:`~kvcopy.core.layout.PagePairing`; the whole page, a K or V half, or ``C``
  elements of a layout-converting copy);
* ``j``: the run's 8-byte words counted from its first byte, read little-endian; when
  the run is not a multiple of 8 bytes its last word is zero-padded (odd head sizes,
  1- and 2-byte aligned pages: the pad is part of the definition, so every backend
  adds the same term);
* ``pos``: the word's byte position in the **staging** page (the host buffer: the
  destination of ``to_host``, the source of ``to_device``) read chunk after chunk,
  i.e. chunk ``c`` of a KV-first page counts from ``c * chunk bytes`` whatever the
  buffer's block count. Runs are contiguous in that order and tile it, so run ``r``
  starts at ``r * run bytes`` there.

Why a sum of this term (order-free, so any work split adds the same value; one 32 x
32 -> 64-bit multiply per 8 bytes, which AVX2 and GPUs do in one instruction), the
functions it was weighed against, the proofs of what follows and its measured cost:
docs/backends.md, "Checksums".

What it catches, comparing the sums of two copies of the same pages (P's pack and D's
scatter):

* any change confined to one 32-bit half of one word (every single-bit flip, any burst
  of up to 4 bytes inside an aligned half): always;
* torn pages, pages swapped or replaced by another request's (or a stale) page, words
  or layers swapped inside a page, a READ truncated or shifted: missed with probability
  of the order of 2^-64 to 2^-61 when the changed bytes look random to the term (it is
  not one-to-one: a word shares its term with ~8 others);
* structured two-bit changes only with probability up to ~2^-32: bits 31 and 63 of one
  word flipped together, or the same bit flipped in the same half of two words;
* pages that trade places, once per-page sums are compared position by position, or
  bound to the request and position with :func:`seal` before :func:`fold` adds them.

What it does not: it is not a MAC (public function, public keys: authenticity is the
handshake's HMAC); it says nothing about bytes the copy does not move; two copies agree
only over the same staging pages cut into the same 8-byte words (a layout-converting
copy with odd run sizes zero-pads each run, which a whole-page copy does not).

Output: ``out`` is a caller-owned int64 tensor of ``sum(len(ids[g]))`` elements on the
copy's device (the GPU for a GPU copier, else the CPU), group after group in call
order, each value the sum's 64 bits (read with ``.view(torch.uint64)`` or
``numpy ... .view(np.uint64)``). The copy overwrites it, stream-ordered like the copy
itself (the GPU kernels zero it first on the copy's stream): no host synchronization
but the ``torch`` backend's.
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import native
from .layout import PageLayout, describe
from .tables import RUN_BYTES, CallPlan, CopyTables

POSITION_MUL = 0x9E3779B97F4A7C15
ORDINAL_MUL = 0xC2B2AE3D27D4EB4F
MIX1 = 0xFF51AFD7ED558CCD
MIX2 = 0xC4CEB9FE1A85EC53
WORD_BYTES = 8
_U64 = np.uint64


def mix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer on uint64 values (wrapping arithmetic): one-to-one, used by
    :func:`seal` to bind a page sum to its request and position (per page, not per word)."""
    x = np.asarray(x, dtype=_U64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(33))
        x = x * _U64(MIX1)
        x = x ^ (x >> _U64(33))
        x = x * _U64(MIX2)
        return x ^ (x >> _U64(33))


def word_keys(positions: np.ndarray, ordinal: int) -> np.ndarray:
    """``key(pos, k)`` for an array of staging positions."""
    pos = np.asarray(positions, dtype=_U64)
    with np.errstate(over="ignore"):
        return (pos + _U64(1)) * _U64(POSITION_MUL) + _U64((ordinal * ORDINAL_MUL) % (1 << 64))


def product_term(x: np.ndarray) -> np.ndarray:
    """``term(x)`` on uint64 keyed words: the product of their 32-bit halves, plus them
    (wrapping arithmetic)."""
    x = np.asarray(x, dtype=_U64)
    with np.errstate(over="ignore"):
        return (x & _U64(0xFFFFFFFF)) * (x >> _U64(32)) + x


def page_sums(pages: np.ndarray, run_bytes: int, ordinal: int) -> np.ndarray:
    """The checksums of ``pages`` (uint8 ``[n, page bytes]``, each in staging order)
    of the layer at position ``ordinal`` of its group, whose copy moves runs of
    ``run_bytes``: uint64 ``[n]``."""
    pages = np.ascontiguousarray(pages, dtype=np.uint8)
    n, page_bytes = pages.shape
    if run_bytes <= 0 or page_bytes % run_bytes:
        raise ValueError(f"a page of {page_bytes} bytes is not a whole number of {run_bytes}-byte runs")
    runs = page_bytes // run_bytes
    per_run = -(-run_bytes // WORD_BYTES)
    padded = np.zeros((n, runs, per_run * WORD_BYTES), dtype=np.uint8)
    padded[:, :, :run_bytes] = pages.reshape(n, runs, run_bytes)
    words = padded.view("<u8").astype(_U64)
    pos = np.arange(runs, dtype=np.int64)[:, None] * run_bytes + WORD_BYTES * np.arange(per_run)[None, :]
    terms = product_term(words ^ word_keys(pos, ordinal)[None])
    with np.errstate(over="ignore"):
        return terms.reshape(n, -1).sum(axis=1, dtype=_U64)


def staging_pages(tensor: torch.Tensor, layout: PageLayout, ids: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """Blocks ``ids`` of a CPU ``tensor`` as uint8 ``[n, page bytes]`` in staging order
    (its chunks one after the other), read from the tensor's storage directly."""
    if tensor.device.type != "cpu":
        raise ValueError(f"staging pages are host memory; got a tensor on {tensor.device}")
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    view = raw.as_strided((layout.num_blocks, layout.num_chunks, layout.chunk_bytes),
                          (layout.block_stride, max(layout.chunk_stride, 1), 1),
                          tensor.storage_offset() * tensor.element_size())
    idx = torch.from_numpy(np.array(ids, dtype=np.int64))  # a copy: plans hand out read-only ids
    return view.index_select(0, idx).reshape(len(idx), -1).numpy()


def reference_checksums(staging: Mapping[str, torch.Tensor], entries_per_group: Sequence[Sequence[str]],
                        ids_per_group: Sequence[Sequence[int]], run_bytes: Mapping[str, int],
                        block_dims: Optional[Mapping[str, int]] = None, kv_layout: str = "NHD") -> np.ndarray:
    """The oracle: the checksums of one call, uint64 ``[sum(len(ids))]``, from the
    staging tensors' bytes (after a ``to_host``, before or after a ``to_device``).

    ``entries_per_group``: per group, its layers in the order the copier copies them
    (``tables.entry_names`` of ``group_entry_ids``: two names for the same bytes count
    once); ``ids_per_group``: the staging side's block ids; ``run_bytes``: per layer,
    the run length of its copy (``pair_pages(...).run_bytes``)."""
    out: List[np.ndarray] = []
    for names, ids in zip(entries_per_group, ids_per_group):
        total = np.zeros(len(ids), dtype=_U64)
        if len(ids):
            for k, name in enumerate(names):
                t = staging[name]
                layout = describe(t, (block_dims or {}).get(name), kv_layout)
                with np.errstate(over="ignore"):
                    total += page_sums(staging_pages(t, layout, ids), int(run_bytes[name]), k)
        out.append(total)
    return np.concatenate(out) if out else np.zeros(0, dtype=_U64)


def table_checksums(tables: CopyTables, call: CallPlan) -> np.ndarray:
    """The oracle over a copier direction's own tables and a planned call (the
    ``torch`` backend's checksums): uint64 ``[blocks of the call]``."""
    tensors = tables.dst_tensors if tables.staging == "dst" else tables.src_tensors
    block_dims = tables.dst_block_dims if tables.staging == "dst" else tables.src_block_dims
    ids = call.dst_ids if tables.staging == "dst" else call.src_ids
    out: List[np.ndarray] = []
    for g in range(tables.num_groups):
        total = np.zeros(len(ids[g]), dtype=_U64)
        if len(ids[g]):
            for k, e in enumerate(tables.group_entry_ids(g).tolist()):
                pages = staging_pages(tensors[e], describe(tensors[e], block_dims[e]), ids[g])
                with np.errstate(over="ignore"):
                    total += page_sums(pages, int(tables.entries[e, RUN_BYTES]), k)
        out.append(total)
    return np.concatenate(out) if out else np.zeros(0, dtype=_U64)


# ---------------------------------------------------------------- the output tensor
def check_output(out, num_blocks: int, device: torch.device, on_cpu: Optional[bool] = None) -> None:
    """``TypeError``/``ValueError`` unless ``out`` can receive a call's checksums:
    an int64 tensor of ``num_blocks`` contiguous elements on ``device`` (``on_cpu``:
    whether that is the CPU, when the caller knows it)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"checksums must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != torch.int64:
        raise TypeError(f"checksums must be an int64 tensor (the sums' bits), got {out.dtype}")
    if out.shape != (num_blocks,) or not out.is_contiguous():
        raise ValueError(f"checksums must be a contiguous 1-D tensor of {num_blocks} elements (one per "
                         f"block of the call), got shape {tuple(out.shape)}")
    # Few attributes read: this runs per checksummed call, and right after a copy that
    # swept the caches each tensor attribute cost 3-10 us, a torch.device's type 15-20 us
    # (scratch timing of the arena's complete, 6 MiB, not saved).
    if on_cpu if on_cpu is not None else device.type == "cpu":
        if not out.is_cpu:
            raise ValueError(f"checksums must be on the copy's device cpu, got {out.device}")
        return
    want, got = _indexed(device), _indexed(out.device)
    if got != want:
        raise ValueError(f"checksums must be on the copy's device {want}, got {out.device}")


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` without an index is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def copy_device(src: torch.device, dst: torch.device) -> torch.device:
    """Where a copy's checksums go: its GPU if it has one, else the CPU."""
    return src if src.type == "cuda" else dst if dst.type == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------- a fold in the copy's call
class SumFold:
    """A fold of one call's page sums, compared with the values it must give, that the
    ``cpu`` backend makes inside the copy's own host call
    (:meth:`~kvcopy.core.copier.BlockCopier.run_and_fold`; ``kvcopy_cpu_copy_sums_fold``)::

        value[v] = SUM over i in segment v of  mix64(sums[gather[i]] XOR bounds[i])   (mod 2^64)

    segment ``v`` running from ``starts[v]`` to ``starts[v + 1]`` (the last to the end of
    ``gather``). With ``bounds = mix64(position * POSITION_MUL)`` each term is
    :func:`seal`'s with seed 0, so a value is :func:`fold` of the sealed sums it gathers
    (kvcopy's arena folds its page sums so, :mod:`kvcopy.nixl.modes.span_sums`). ``want``:
    the values a match gives, one per segment; :meth:`collecting` makes the same fold
    that writes its values out instead of comparing them.

    Immutable: the arrays are copied into ``bytes`` (numpy refuses to make a view of
    ``bytes`` writable), as is the block of their addresses and lengths the library
    reads; a collecting fold's values live in a ``bytearray`` its view cannot resize;
    attributes can be neither set nor deleted. The library re-checks every index
    against the call's sums at each call."""

    __slots__ = ("_arrays", "_block", "_at", "_values")
    _arrays: Tuple[np.ndarray, ...]  # gather, bounds, starts, want: views of bytes
    _block: np.ndarray  # the library's kvcopy_fold struct (kvcopy.native.Fold), a view of bytes
    _at: int  # its address
    _values: Optional[np.ndarray]  # a collecting fold's values: a view of a bytearray

    def __init__(self, gather, bounds, starts, want):
        g, b, st, w = (_int_array(name, a, dtype) for name, a, dtype in
                       (("gather", gather, np.int64), ("bounds", bounds, _U64), ("starts", starts, np.int64),
                        ("want", want, _U64)))
        if len(b) != len(g) or len(w) != len(st):
            raise ValueError(f"SumFold: {len(g)} gather indices with {len(b)} bounds, {len(st)} segments with "
                             f"{len(w)} wanted values")
        if len(st) and (st[0] < 0 or (np.diff(st) < 0).any() or st[-1] > len(g)):
            raise ValueError(f"SumFold: segment starts must rise within the {len(g)} gathered sums")
        self._set((g, b, st, w))

    def wanting(self, want) -> "SumFold":
        """The same fold compared with other values: only ``want`` is copied (the
        arena's D makes one per request, each with that request's values from P; its
        gather, bounds and starts are shared by every request reading the same pages)."""
        w = _int_array("want", want, _U64)
        g, b, st, _ = self._arrays
        if len(w) != len(st):
            raise ValueError(f"SumFold: {len(st)} segments with {len(w)} wanted values")
        fold = SumFold.__new__(SumFold)
        fold._set((g, b, st, w))
        return fold

    def collecting(self) -> "SumFold":
        """The same fold, compared with nothing: the library writes the values into
        :attr:`values`, this fold's own array (the arena's P records its pack's values
        so; make one per call)."""
        g, b, st, _ = self._arrays
        fold = SumFold.__new__(SumFold)
        fold._set((g, b, st, _int_array("want", [], _U64)), np.frombuffer(bytearray(8 * len(st)), _U64))
        return fold

    @property
    def values(self) -> Optional[np.ndarray]:
        """A collecting fold's values, written by the library's last fold (zeros before
        one); None for a fold compared with ``want``."""
        return self._values

    def _set(self, arrays: Tuple[np.ndarray, ...], values: Optional[np.ndarray] = None) -> None:
        g, b, st, w = arrays
        block = np.frombuffer(bytes(native.Fold.make(
            gather=address_of(g), bounds=address_of(b), num_gather=len(g), starts=address_of(st), num_values=len(st),
            values=0 if values is None else address_of(values), want=0 if values is not None else address_of(w))),
            np.uint8)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_arrays", arrays)
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_at", address_of(block))

    def __setattr__(self, name, value):
        raise AttributeError("SumFold is immutable")

    def __delattr__(self, name):
        raise AttributeError("SumFold is immutable")

    @property
    def at(self) -> int:
        """The address of the ``kvcopy_fold`` struct ``kvcopy_cpu_copy_sums_fold`` reads."""
        return self._at

    def values_of(self, sums: np.ndarray) -> np.ndarray:
        """The oracle of the library's fold: the values of ``sums`` (the call's, uint64)."""
        g, b, st, _ = self._arrays
        s = np.asarray(sums, dtype=_U64)
        if len(g) and (g.min() < 0 or g.max() >= len(s)):
            raise ValueError(f"SumFold: a gather index outside the call's {len(s)} sums")
        return fold_segments(s, g, b, st)

    def differ(self, sums: np.ndarray) -> int:
        """The oracle of the library's count: how many values of ``sums`` differ from ``want``."""
        if self._values is not None:
            raise ValueError("SumFold: a collecting fold compares nothing")
        return int((self.values_of(sums) != self._arrays[3]).sum())

    def __repr__(self) -> str:
        return f"SumFold({len(self._arrays[0])} sums into {len(self._arrays[2])} values)"


def fold_segments(sums: np.ndarray, gather: np.ndarray, bounds: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """:class:`SumFold`'s values in numpy, the definition the host library's folds are
    held to: per segment ``v`` (``starts[v]`` to the next start, the last to the end of
    ``gather``) the sum of ``mix64(sums[gather[i]] ^ bounds[i])`` mod 2^64; a segment
    of no sums gives 0. ``sums`` uint64, indices in range (not checked here)."""
    with np.errstate(over="ignore"):
        ends = np.cumsum(np.concatenate([np.zeros(1, _U64), mix64(sums[gather] ^ bounds)]), dtype=_U64)
        return ends[np.append(starts[1:], len(gather)).astype(np.int64)] - ends[starts]  # wraps as the sums do


def address_of(a: np.ndarray) -> int:
    """The address of an array's first element (what the host library is handed)."""
    return a.__array_interface__["data"][0]


def _int_array(name: str, a, dtype) -> np.ndarray:
    """The 1-D integer array ``a`` as ``dtype``, copied into ``bytes``: read-only for good."""
    a = np.asarray(a)
    if a.ndim != 1 or (a.dtype.kind not in "iu" and len(a)):
        raise TypeError(f"SumFold: {name} must be a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return np.frombuffer(a.astype(dtype).tobytes(), dtype)


# ---------------------------------------------------------------- host side
def as_unsigned(sums) -> np.ndarray:
    """Checksums (an int64 tensor or array) as uint64 numpy (synchronizes a GPU tensor)."""
    if isinstance(sums, torch.Tensor):
        sums = sums.detach().cpu().numpy()
    return np.asarray(sums).view(_U64) if np.asarray(sums).dtype == np.int64 else np.asarray(sums, dtype=_U64)


def seal(sums, seed: int, positions: Optional[Sequence[int]] = None) -> np.ndarray:
    """Page sums bound to a request and to each page's logical position:
    ``mix64(sum XOR mix64(seed + position * POSITION_MUL))``, uint64. ``seed`` is any
    64-bit value naming the request (e.g. from its id and the transfer's nonce);
    ``positions`` default to ``0..n-1``. Sealed values can be folded (:func:`fold`)
    into one value per request that still changes when two pages trade places or a
    page of another request is served."""
    s = as_unsigned(sums)
    pos = np.arange(len(s), dtype=_U64) if positions is None else np.asarray(positions, dtype=np.int64).astype(_U64)
    with np.errstate(over="ignore"):
        bound = mix64(_U64(seed % (1 << 64)) + pos * _U64(POSITION_MUL))
    return mix64(s ^ bound)


def fold(sealed) -> int:
    """One 64-bit value for many sealed sums (their sum mod 2^64)."""
    with np.errstate(over="ignore"):
        return int(np.asarray(sealed, dtype=_U64).sum(dtype=_U64))
