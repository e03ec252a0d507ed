"""Benchmark scenarios: KV caches, host buffers, block ids and the methods measured on them.

A :class:`Scenario` describes a model's KV geometry and one request-sync: which layers
each KV cache group holds, which layers share one storage, how many blocks each group
moves. :meth:`Scenario.build` allocates it (device caches, host staging buffers, ids)
as a :class:`Point`, and :meth:`Point.methods` returns the callables measured on it:

``memcpy``
    one contiguous copy of the same number of bytes (pinned host memory on a GPU,
    plain memory on the CPU): the floor every other row is compared with.
``vllm``
    vLLM's host-buffer path before the pull request that coalesced its copies across
    KV cache groups: per KV cache group, per layer of that group, an advanced-indexing
    gather on the source side, a copy through pageable memory to the other side, a
    scatter there. groups x layers copy ops, one index upload per group.
``coalesced``
    vLLM's path after that pull request: every group's ids concatenated, one
    gather/copy/scatter per KV storage (per layer in its benchmark's model), one index
    upload per call.
``<backend>``
    ``kvcopy.BlockCopier`` with that backend (``torch``, ``cpu``, ``triton``, ``cuda``,
    ``ce``, ``auto``).
``<backend>+sum``
    the same copier's copy with checksums (:mod:`kvcopy.core.checksum`) into an int64
    tensor on the copy's device: the checksum's cost is this row against the one above.

Layer maps. ``all`` is the model of that pull request's benchmark (the ``seeds2``
preset): ``copy_blocks`` applies each group's ids to every layer, so every group holds
every layer; here group ``g``'s layer ``l`` is a view of storage ``l`` (distinct names,
shared bytes, as hybrid models alias device tensors). ``hybrid`` is a sliding-window
hybrid (Gemma-3 style): every
``sliding_per_full + 1``-th layer is full attention and forms group 0, the sliding
layers are cut into groups of the same size, and layer ``i`` of every group shares
storage ``i``; sliding groups move only the window's blocks. In both maps all methods
move the same bytes, so their times compare directly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..testing import DTYPES, LAYOUTS, POISON_BYTE, page_pairing, physical_shape, shaped
from .presets import PRESETS as PRESET_DATA
from .units import fmt_bytes, plural

BASELINES = ("vllm", "coalesced")
KVCOPY_BACKENDS = ("torch", "cpu", "triton", "cuda", "ce", "auto")


@dataclass(frozen=True)
class Scenario:
    """One model geometry and one request-sync's worth of blocks per group."""

    name: str = "seeds2"
    num_layers: int = 16
    num_groups: int = 1  # "all" map only; "hybrid" derives it
    layer_map: str = "all"  # "all" | "hybrid"
    sliding_per_full: int = 5  # hybrid: 5 sliding layers to 1 full (Gemma-3)
    blocks_per_request: int = 6  # blocks each group moves ("all"); the full group ("hybrid")
    window_blocks: int = 32  # hybrid: blocks a sliding group moves
    block_size: int = 16  # tokens per block
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bf16"
    layout: str = "kv_first"  # a name from kvcopy.testing.LAYOUTS (converting ones included)
    ids: str = "random"  # "random" (scattered, one pool) | "contiguous" (one run per group)
    seed: int = 0

    # ------------------------------------------------------------- structure
    def groups(self) -> List[List[int]]:
        """Layer indices per KV cache group."""
        if self.layer_map == "all":
            return [list(range(self.num_layers)) for _ in range(self.num_groups)]
        if self.layer_map == "hybrid":
            period = self.sliding_per_full + 1
            full = [i for i in range(self.num_layers) if i % period == period - 1]
            sliding = [i for i in range(self.num_layers) if i % period != period - 1]
            size = max(1, len(full))
            out = [full] if full else []
            out += [sliding[k : k + size] for k in range(0, len(sliding), size)]
            return out
        raise ValueError(f"layer_map must be 'all' or 'hybrid', got {self.layer_map!r}")

    def blocks_per_group(self) -> List[int]:
        groups = self.groups()
        if self.layer_map == "all":
            return [self.blocks_per_request] * len(groups)
        has_full = self.num_layers >= self.sliding_per_full + 1
        return [self.blocks_per_request if (g == 0 and has_full) else
                min(self.window_blocks, self.blocks_per_request) for g in range(len(groups))]

    def layer_names(self) -> List[List[str]]:
        """Layer names per group, and (through :meth:`storage_of`) what they alias."""
        if self.layer_map == "all":
            return [[f"model.layers.{l}.attn#g{g}" for l in layers] for g, layers in enumerate(self.groups())]
        return [[f"model.layers.{l}.attn" for l in layers] for layers in self.groups()]

    def storage_of(self) -> Dict[str, int]:
        """Storage index of each layer name: position within its group."""
        return {name: i for names in self.layer_names() for i, name in enumerate(names)}

    def num_storages(self) -> int:
        return max((len(g) for g in self.groups()), default=0)

    def block_dim(self) -> int:
        return LAYOUTS[self.layout][1]

    def kv_layout(self) -> str:
        return LAYOUTS[self.layout][2]

    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def page_bytes(self) -> int:
        """Bytes of one block of one layer (all its chunks)."""
        shape = LAYOUTS[self.layout][0](1, self.block_size, self.num_kv_heads, self.head_size)
        return int(np.prod(shape)) * self.itemsize()

    def chunks_per_page(self) -> int:
        """Runs per page of the device/host pair: 2 for KV-first, 1 where both sides
        hold a page as one range, more for a layout-converting pair."""
        return page_pairing(self.layout, self.block_size, self.num_kv_heads, self.head_size,
                            DTYPES[self.dtype]).runs_per_page

    def chunk_bytes(self) -> int:
        """Bytes of one run contiguous on both sides (K or V for KV-first layouts, C
        elements for a head-major host page against a token-major cache)."""
        return self.page_bytes() // self.chunks_per_page()

    def call_bytes(self) -> int:
        groups, counts = self.groups(), self.blocks_per_group()
        return sum(len(layers) * n for layers, n in zip(groups, counts)) * self.page_bytes()

    def with_chunk_bytes(self, chunk: int) -> "Scenario":
        """The same scenario with the block size (tokens) set so a chunk is ``chunk`` bytes."""
        per_token = self.chunk_bytes() // self.block_size
        if self.layout == "mla" or chunk % per_token:
            raise ValueError(
                f"chunk size {chunk} B is not a whole number of tokens ({per_token} B each) "
                f"for layout {self.layout}"
            )
        return replace(self, block_size=chunk // per_token)

    def capped(self, max_call_bytes: int) -> "Scenario":
        """Fewer blocks per group (at least one), then for the ``all`` map fewer layers (at
        least one), so a call moves at most ``max_call_bytes`` where it can."""
        if self.call_bytes() <= max_call_bytes:
            return self
        per_block = self.call_bytes() / max(1, self.blocks_per_request)
        n = max(1, int(max_call_bytes // per_block))
        out = replace(self, blocks_per_request=n, window_blocks=min(self.window_blocks, n))
        if out.call_bytes() > max_call_bytes and self.layer_map == "all":
            per_layer = out.call_bytes() / self.num_layers
            out = replace(out, num_layers=max(1, int(max_call_bytes // per_layer)))
        return out

    def describe(self, group_counts: Sequence[int] = (), swept: bool = False) -> str:
        """One line; ``group_counts`` names the group counts of a multi-point run; ``swept``
        leaves out what a sweep varies (tokens per block, so chunk and bytes per call)."""
        shape = LAYOUTS[self.layout][0]("NB", "T" if swept else self.block_size, self.num_kv_heads, self.head_size)
        counts = self.blocks_per_group()
        blocks = f"{counts[0]} blocks/group" if len(set(counts)) == 1 else f"blocks/group {counts}"
        groups = "/".join(map(str, group_counts)) if len(group_counts) > 1 else str(len(self.groups()))
        per_call = fmt_bytes(self.call_bytes())
        if len(group_counts) > 1:
            per_group = self.call_bytes() // len(self.groups())
            per_call = f"{fmt_bytes(per_group * min(group_counts))}-{fmt_bytes(per_group * max(group_counts))}"
        return (
            f"{self.name}: {plural(self.num_layers, 'layer')}, {groups} "
            f"{'group' if groups == '1' else 'groups'} ({self.layer_map} map), "
            f"{self.layout} [{', '.join(map(str, shape))}] {self.dtype}, {blocks}, ids {self.ids}"
            + ("" if swept else f", chunk {fmt_bytes(self.chunk_bytes())}, {per_call}/call")
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(num_groups=len(self.groups()), blocks_per_group=self.blocks_per_group(),
                 chunk_bytes=self.chunk_bytes(), page_bytes=self.page_bytes(),
                 call_bytes=self.call_bytes())
        return d

    # ------------------------------------------------------------- allocation
    def block_ids(self) -> Tuple[int, List[List[int]]]:
        """(blocks per tensor, ids per group): unique across groups (one block pool)."""
        counts = self.blocks_per_group()
        total = sum(counts)
        num_blocks = max(8, 2 * total)
        if self.ids == "contiguous":
            starts = np.cumsum([0] + counts[:-1]).tolist()
            return num_blocks, [list(range(s, s + n)) for s, n in zip(starts, counts)]
        if self.ids != "random":
            raise ValueError(f"ids must be 'random' or 'contiguous', got {self.ids!r}")
        perm = np.random.default_rng(self.seed).permutation(num_blocks).tolist()
        out, k = [], 0
        for n in counts:
            out.append(perm[k : k + n])
            k += n
        return num_blocks, out

    def build(self, device: str = "cpu", pinned: bool = True) -> "Point":
        """Allocate the caches: each side's storages are consecutive page-aligned slices of
        one allocation (a slab), so the memcpy floor copies within the same memory."""
        num_blocks, ids = self.block_ids()
        dims = (num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        dtype = DTYPES[self.dtype]
        n = self.num_storages()
        pin = pinned and device != "cpu"
        # Random bytes, made where they are fastest to make (the GPU when there is one).
        gen = torch.Generator(device=device).manual_seed(self.seed)
        raws: Dict[str, List[torch.Tensor]] = {}
        slabs: Dict[str, torch.Tensor] = {}
        stores: Dict[str, List[torch.Tensor]] = {}
        for side in ("device", "host"):
            nbytes = int(np.prod(physical_shape(self.layout, side, *dims))) * self.itemsize()
            stride = -(-nbytes // _PAGE) * _PAGE
            if side == "device":
                slab = torch.empty(n * stride, dtype=torch.uint8, device=device)
            else:
                slab = torch.empty(n * stride, dtype=torch.uint8, pin_memory=pin)
            raws[side] = [slab[i * stride : i * stride + nbytes] for i in range(n)]
            for raw in raws[side]:  # one storage at a time: no slab-sized temporary
                raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device))
            slabs[side] = slab
            stores[side] = [shaped(raw, self.layout, side, dtype, *dims) for raw in raws[side]]
        names = self.layer_names()
        storage = self.storage_of()
        dev = {nm: stores["device"][storage[nm]] for g in names for nm in g}
        host = {nm: stores["host"][storage[nm]] for g in names for nm in g}
        return Point(self, device, pin, dev, host, stores["device"], stores["host"], names, ids,
                     slabs=slabs, raw=raws)


_PAGE = 4096  # storages start on their own page, as separate allocations would


# ------------------------------------------------------------------ presets
PRESETS: Dict[str, dict] = {
    name: dict(scenario=Scenario(name=name, **p["fields"]), num_groups=p["num_groups"], help=p["help"])
    for name, p in PRESET_DATA.items()
}


# ------------------------------------------------------------------ a built scenario
@dataclass
class Point:
    """Allocated tensors and ids of one scenario, and the methods that copy them."""

    scenario: Scenario
    device: str
    pinned: bool
    dev: Dict[str, torch.Tensor]
    host: Dict[str, torch.Tensor]
    dev_storages: List[torch.Tensor]
    host_storages: List[torch.Tensor]
    layer_groups: List[List[str]]
    ids: List[List[int]]  # per group; the host mirrors device numbering
    slabs: Dict[str, torch.Tensor] = field(default_factory=dict)  # "device"/"host": one allocation each
    raw: Dict[str, List[torch.Tensor]] = field(default_factory=dict)  # per side: each storage's bytes
    copiers: Dict[str, Any] = field(default_factory=dict)  # BlockCopier by backend and cap

    @property
    def total_bytes(self) -> int:
        return self.scenario.call_bytes()

    def sides(self, direction: str):
        """(source dict, destination dict, source storages, destination storages)."""
        if direction == "d2h":
            return self.dev, self.host, self.dev_storages, self.host_storages
        if direction == "h2d":
            return self.host, self.dev, self.host_storages, self.dev_storages
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")

    def _ends(self, direction: str) -> Tuple[str, str]:
        """(source side, destination side) of ``direction``."""
        self.sides(direction)  # checks the name
        return ("device", "host") if direction == "d2h" else ("host", "device")

    def synchronize(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    # ------------------------------------------------------------- methods
    def method(self, name: str, direction: str, max_ctas: Optional[int] = None) -> Callable[[], None]:
        """A zero-argument callable doing one request-sync with method ``name``."""
        if name == "memcpy":
            return self._memcpy(direction)
        if name == "vllm":
            return self._vllm_loop(direction)
        if name == "coalesced":
            return self._coalesced(direction)
        return self._kvcopy(name, direction, max_ctas)

    def _memcpy(self, direction: str) -> Callable[[], None]:
        """One contiguous copy of the call's bytes from the start of the source slab to
        the start of the destination slab: the memory every other method copies within."""
        n = self.total_bytes
        src_side, dst_side = self._ends(direction)
        src, dst = self.slabs[src_side][:n], self.slabs[dst_side][:n]
        if src.numel() < n or dst.numel() < n:  # every storage holds twice a call's blocks
            raise ValueError(f"slabs of {src.numel()}/{dst.numel()} bytes hold no {n}-byte copy")
        non_blocking = self.device != "cpu"

        def run() -> None:
            dst.copy_(src, non_blocking=non_blocking)

        return run

    def _index(self, ids: torch.Tensor):
        return (slice(None),) * self.scenario.block_dim() + (ids,)

    def _vllm_loop(self, direction: str) -> Callable[[], None]:
        src, dst, _, _ = self.sides(direction)
        groups, ids = self.layer_groups, self.ids
        src_dev = next(iter(src.values())).device
        dst_dev = next(iter(dst.values())).device

        def run():
            for names, g_ids in zip(groups, ids):
                if not g_ids:
                    continue
                # One index tensor per side per call, as vLLM's copy op builds them.
                s_idx = self._index(torch.tensor(g_ids, dtype=torch.int64, device=src_dev))
                d_idx = self._index(torch.tensor(g_ids, dtype=torch.int64, device=dst_dev))
                for name in names:
                    dst[name][d_idx] = src[name][s_idx].to(dst_dev)

        return run

    def _coalesced(self, direction: str) -> Callable[[], None]:
        src, dst, _, _ = self.sides(direction)
        groups, ids = self.layer_groups, self.ids
        storage = self.scenario.storage_of()
        # For each storage: one layer name standing for it and the groups that touch it.
        touching: Dict[int, List[int]] = {}
        rep: Dict[int, str] = {}
        for g, names in enumerate(groups):
            for name in names:
                touching.setdefault(storage[name], []).append(g)
                rep.setdefault(storage[name], name)
        src_dev = next(iter(src.values())).device
        dst_dev = next(iter(dst.values())).device
        every = list(range(len(groups)))

        def run():
            # vLLM after coalescing: one concatenated id list, uploaded once; one op per layer.
            all_ids = [i for g_ids in ids for i in g_ids]
            s_all = torch.tensor(all_ids, dtype=torch.int64, device=src_dev)
            d_all = torch.tensor(all_ids, dtype=torch.int64, device=dst_dev)
            for s, gs in touching.items():
                if gs == every:
                    s_idx, d_idx = s_all, d_all
                else:  # hybrid maps: only the groups with a layer on this storage
                    sel = [i for g in gs for i in ids[g]]
                    s_idx = torch.tensor(sel, dtype=torch.int64, device=src_dev)
                    d_idx = torch.tensor(sel, dtype=torch.int64, device=dst_dev)
                name = rep[s]
                dst[name][self._index(d_idx)] = src[name][self._index(s_idx)].to(dst_dev)

        return run

    def copier(self, backend: str, max_ctas: Optional[int] = None):
        """A ``BlockCopier`` for ``backend`` (cached per backend and cap)."""
        from ..core.copier import BlockCopier

        key = f"{backend}@{max_ctas}"
        if key not in self.copiers:
            kwargs: Dict[str, Any] = dict(copy_backend=backend, block_dim=self.scenario.block_dim(),
                                          kv_layout=self.scenario.kv_layout())
            if max_ctas and copier_accepts("max_ctas"):
                kwargs["max_ctas"] = max_ctas
            self.copiers[key] = BlockCopier(self.dev, self.host, self.layer_groups, **kwargs)
        return self.copiers[key]

    def _kvcopy(self, backend: str, direction: str, max_ctas: Optional[int]) -> Callable[[], None]:
        sums = backend.endswith("+sum")
        copier = self.copier(backend[: -len("+sum")] if sums else backend, max_ctas)
        ids = self.ids
        if sums:
            out = torch.empty(sum(map(len, ids)), dtype=torch.int64, device=self.device)
            if direction == "d2h":
                return lambda: copier.to_host(ids, checksums=out)
            return lambda: copier.to_device(ids, checksums=out)
        return (lambda: copier.to_host(ids)) if direction == "d2h" else (lambda: copier.to_device(ids))

    # ------------------------------------------------------------- checking
    def expected(self, direction: str) -> List[torch.Tensor]:
        """Destination storages after the reference copy over poisoned destinations (CPU)."""
        from ..testing.reference import reference_copy_groups

        src, dst, _, _ = self.sides(direction)
        self.poison(direction)
        bd = {n: self.scenario.block_dim() for g in self.layer_groups for n in g}
        reference_copy_groups(src, dst, self.layer_groups, self.ids, self.ids, bd)
        self.synchronize()
        return [t.cpu().clone() for t in self.raw[self._ends(direction)[1]]]

    def poison(self, direction: str) -> None:
        for t in self.raw[self._ends(direction)[1]]:
            t.fill_(POISON_BYTE)

    def check(self, fn: Callable[[], None], direction: str, expected: Sequence[torch.Tensor]) -> Optional[str]:
        """None when ``fn`` reproduces ``expected`` bit for bit, else what differs."""
        self.poison(direction)
        fn()
        self.synchronize()
        # Every byte of each storage (a cross-layer view's neighbours included).
        for i, (got, exp) in enumerate(zip(self.raw[self._ends(direction)[1]], expected)):
            a, b = got.cpu(), exp
            if not torch.equal(a, b):
                bad = int((a != b).sum())
                return f"storage {i}: {bad} of {a.numel()} elements differ from the reference"
        return None

    def close(self) -> None:
        for c in self.copiers.values():
            c.close()
        self.copiers.clear()


_ACCEPTS: Dict[str, bool] = {}


def copier_accepts(param: str) -> bool:
    """Whether this install's ``BlockCopier`` takes keyword ``param`` (e.g. ``max_ctas``)."""
    if param not in _ACCEPTS:
        import inspect

        from ..core.copier import BlockCopier

        sig = inspect.signature(BlockCopier.__init__)
        _ACCEPTS[param] = param in sig.parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return _ACCEPTS[param]
