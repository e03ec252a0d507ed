"""The byte oracle: a plan's descriptors applied to CPU tensors, without NIXL.

``replay(plan, local, remote)`` does, with plain byte slices, what a pull and its
completion do with NIXL and the copy kernels: for each region pair, each page pair
``(local_pages[i], remote_pages[i])``, each chunk ``c`` and each byte segment, from
the pair's peer, it
copies the bytes at ``remote_page * page_stride + c * chunk_stride + remote offset``
of the remote layer's tensor to the local offset in the local layer's tensor, and then
zeroes the pages listed for zeroing (whole chunks, or a pair's ``zero_segments``: the
rows of a read page past the prompt). ``local`` and ``remote`` map layer names to CPU
tensors with the geometry the plan was made for: the two engines' device caches (the
result is what D's caches hold after ``complete``), or the host buffers NIXL reads and
writes. Offsets are taken relative to each tensor's first element, so the tensors need
not be the registered ones.

It loops over pages in Python on purpose: slow, and sharing no code with the
descriptor tables, the NIXL index lists or the copy kernels it checks. Every byte it
touches is bounds-checked against the tensor's storage; a plan that would reach
outside raises ``ValueError``.

``replay_rows(reads, local, remote)`` is the arena mode's READ without NIXL: each
descriptor row pair ``(local address, bytes)``, ``(remote address, bytes)`` copies
those bytes from the peer's arena buffer to the local one, bounds-checked against both
(D's span is then scattered by the real copier: :mod:`kvcopy.nixl.modes.arena`).

Beside them, the byte comparisons of whole cache sets the tests and the fuzzer use
(:func:`clone_caches` keeps aliasing, :func:`same_bytes` compares every storage).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch

from ...core.layout import as_words, describe
from ...nixl.planning.plan import PullPlan
from ...nixl.engine.regions import RegionRef


def _bytes_of(t: torch.Tensor, name: str):
    """(uint8 view of the tensor's whole storage, byte offset of its first element)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"layer {name!r}: replay needs a CPU tensor")
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage, t.storage_offset() * t.element_size()


def _page_chunk(ref: RegionRef, page: int, chunk: int) -> int:
    return page * ref.page_stride + chunk * ref.chunk_stride


def _check(buf: torch.Tensor, start: int, n: int, what: str) -> None:
    if start < 0 or start + n > buf.numel():
        raise ValueError(f"{what}: bytes [{start}, {start + n}) outside the tensor's storage of {buf.numel()}")


def _remote_for(plan: PullPlan, remote: Mapping, peer: str) -> Mapping[str, torch.Tensor]:
    """``remote`` is layer -> tensor (one peer) or peer name -> (layer -> tensor)."""
    if remote and all(isinstance(v, Mapping) for v in remote.values()):
        if peer not in remote:
            raise ValueError(f"replay: no tensors for peer {peer!r}")
        return remote[peer]
    if len(plan.all_peers) > 1:
        raise ValueError(f"replay: the plan reads from {list(plan.all_peers)}: pass peer name -> tensors")
    return remote


def replay(plan: PullPlan, local: Mapping[str, torch.Tensor], remote: Mapping,
           zero: bool = True) -> None:
    """Apply ``plan`` to ``local`` from ``remote`` in place (then zero, unless ``zero=False``).

    ``remote`` maps layer names to tensors, or, for a plan that reads from several
    peers, peer names to such mappings."""
    for pair in plan.pairs:
        if not pair.local_pages:
            continue
        tensors = _remote_for(plan, remote, plan.peer_of(pair))
        for name in pair.layers:
            dst, dst0 = _bytes_of(local[name], name)
            src, src0 = _bytes_of(tensors[name], name)
            for lp, rp in zip(pair.local_pages, pair.remote_pages):
                for c in range(pair.local.num_chunks):
                    for l_off, r_off, n in pair.byte_segments():
                        d = dst0 + _page_chunk(pair.local, lp, c) + l_off
                        s = src0 + _page_chunk(pair.remote, rp, c) + r_off
                        _check(dst, d, n, f"layer {name!r}, local page {lp}")
                        _check(src, s, n, f"layer {name!r}, remote page {rp}")
                        dst[d : d + n] = src[s : s + n]
    if not zero:
        return
    for pair in plan.pairs:
        runs = pair.zero_segments or ((0, pair.local.chunk_bytes),)
        for name in pair.layers:
            dst, dst0 = _bytes_of(local[name], name)
            for lp in pair.pages_to_zero:
                for c in range(pair.local.num_chunks):
                    for off, n in runs:
                        d = dst0 + _page_chunk(pair.local, lp, c) + off
                        _check(dst, d, n, f"layer {name!r}, local page {lp}")
                        dst[d : d + n] = 0


def replay_rows(reads: Mapping[str, tuple], local: torch.Tensor, remote: Mapping[str, torch.Tensor]) -> None:
    """Apply NIXL READ rows (``peer -> (local rows, remote rows)``, uint64 ``[N, 3]``
    address/bytes/device) between uint8 CPU buffers addressed by ``data_ptr()``."""
    dst0 = local.data_ptr()
    for peer, (lrows, rrows) in reads.items():
        if len(lrows) != len(rrows):
            raise ValueError(f"peer {peer!r}: {len(lrows)} local rows vs {len(rrows)} remote rows")
        src = remote[peer]
        src0 = src.data_ptr()
        for (la, ln, _), (ra, rn, _) in zip(lrows.tolist(), rrows.tolist()):
            if ln != rn:
                raise ValueError(f"peer {peer!r}: row sizes {ln} vs {rn}")
            d, s = la - dst0, ra - src0
            _check(local, d, ln, f"local row at {la:#x}")
            _check(src, s, rn, f"remote row at {ra:#x} of {peer!r}")
            local[d : d + ln] = src[s : s + rn]


def unique_storages(caches: Dict[str, torch.Tensor]) -> Dict[int, torch.Tensor]:
    """storage address -> a uint8 tensor over the whole storage."""
    out = {}
    for t in caches.values():
        s = t.untyped_storage()
        if s.data_ptr() not in out:
            out[s.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(s)
    return out


def fill_random(caches: Dict[str, torch.Tensor], seed: int) -> None:
    """Random bytes into every storage (the same bytes for the same seed and shapes)."""
    gen = torch.Generator().manual_seed(seed)
    for _, buf in sorted(unique_storages(caches).items(), key=lambda kv: kv[1].numel()):
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=gen))


def clone_caches(caches: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Deep copy keeping aliasing: views of one storage stay views of one new storage."""
    new = {ptr: buf.clone() for ptr, buf in unique_storages(caches).items()}
    out = {}
    for name, t in caches.items():
        base = new[t.untyped_storage().data_ptr()]
        out[name] = torch.as_strided(base.view(t.dtype), t.shape, t.stride(), t.storage_offset())
    return out


def storage_bytes(caches: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """Every storage's bytes, in an order that depends only on the layer names."""
    seen, out = set(), []
    for name in sorted(caches):
        s = caches[name].untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(torch.empty(0, dtype=torch.uint8).set_(s))
    return out


def same_bytes(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of every storage of two cache sets built alike."""
    sa, sb = storage_bytes(a), storage_bytes(b)
    return len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb))


def first_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Optional[str]:
    """Which layer and page first differ (for assertion messages), or None."""
    for name in sorted(a):
        x, y = as_words(a[name]), as_words(b[name])
        if not torch.equal(x, y):
            bd = describe(a[name]).block_dim
            diff = (x != y).movedim(bd, 0).reshape(x.shape[bd], -1).any(dim=1).nonzero().flatten()
            return f"layer {name!r}: pages {diff.tolist()[:16]} differ"
    return None
