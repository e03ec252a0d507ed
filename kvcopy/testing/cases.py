"""Copy cases and the bit-exact check every backend is held to.

A :class:`CopyCase` is a small model: KV cache groups of layers, device caches and
host buffers of one layout and dtype, optional aliasing (layer ``i`` of every group is
a view of one storage, as in hybrid models) and KV-sharing layers (in the dicts, in no
group, pointing at another layer's device tensor with a host buffer of their own), and
one call's block ids per group (unique across groups: one block pool).

:func:`check_copy` builds the case twice from one seed with the source random and the
destination poisoned, runs the reference (:mod:`kvcopy.testing.reference`) on one copy and the
backend on the other, and compares every destination tensor byte for byte, including
the ones that must not change. Sizes are small so the Triton interpreter (which runs
each program instance in Python) can run the whole matrix.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core.copier import BlockCopier
from ..core.layout import as_words
from .reference import reference_copy_groups

# name -> (logical shape builder (nb, bs, h, d) -> shape, block_dim, kv_layout)
LAYOUTS = {
    "nhd": (lambda nb, bs, h, d: (nb, bs, h, d), 0, "NHD"),
    "hnd": (lambda nb, bs, h, d: (nb, h, bs, d), 0, "HND"),
    "hnd_view_of_nhd": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # both sides (nb, bs, h, 2d) viewed
    "kv_first": (lambda nb, bs, h, d: (2, nb, bs, h, d), 1, "NHD"),
    "blocks_first_kv": (lambda nb, bs, h, d: (nb, 2, bs, h, d), 0, "NHD"),
    "mla": (lambda nb, bs, h, d: (nb, bs, h * d), 0, "NHD"),
    # Layout-converting pairs (vLLM 0.33, v1/kv_cache_layout.py): the device cache is a
    # strided view, the host buffer contiguous in the logical shape, unless named below.
    "lbnhc": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # [B,H,N,C] view of [B,N,H,C]
    "blnhc": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # layer view of [B,L,N,H,C]
    "bhlnc": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # layer view of [B,H,L,N,C]
    "lhbnc": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # layer view of [L,H,B,N,C]
    "kv_first_hnd": (lambda nb, bs, h, d: (2, nb, bs, h, d), 1, "NHD"),  # [2,NB,N,H,D] view of [2,NB,H,N,D]
    "flashinfer_hnd": (lambda nb, bs, h, d: (nb, 2, bs, h, d), 0, "NHD"),  # [NB,2,N,H,D] view of [NB,2,H,N,D]
    "host_lbnhc": (lambda nb, bs, h, d: (nb, h, bs, 2 * d), 0, "HND"),  # the host is the LBNHC view
}

# Layers a cross-layer allocation holds in the cases; a case's tensor is layer 1 of it,
# so its pages sit between bytes of other layers that must never change.
CROSS_LAYERS = 3

# How a side of a layout is made from raw bytes: (physical shape (nb, bs, h, d) ->
# shape, view of that physical tensor). A side not named is contiguous in the logical
# shape. Each view has the logical shape of LAYOUTS.
VIEWS: Dict[str, Dict[str, Tuple[Callable[..., Tuple[int, ...]], Callable[[torch.Tensor], torch.Tensor]]]] = {
    "hnd_view_of_nhd": {side: (lambda nb, bs, h, d: (nb, bs, h, 2 * d), lambda t: t.transpose(1, 2))
                        for side in ("device", "host")},
    "lbnhc": {"device": (lambda nb, bs, h, d: (nb, bs, h, 2 * d), lambda t: t.permute(0, 2, 1, 3))},
    "blnhc": {"device": (lambda nb, bs, h, d: (nb, CROSS_LAYERS, bs, h, 2 * d),
                         lambda t: t[:, 1].permute(0, 2, 1, 3))},
    "bhlnc": {"device": (lambda nb, bs, h, d: (nb, h, CROSS_LAYERS, bs, 2 * d), lambda t: t[:, :, 1])},
    "lhbnc": {"device": (lambda nb, bs, h, d: (CROSS_LAYERS, h, nb, bs, 2 * d),
                         lambda t: t[1].transpose(0, 1))},
    "kv_first_hnd": {"device": (lambda nb, bs, h, d: (2, nb, h, bs, d), lambda t: t.transpose(2, 3))},
    "flashinfer_hnd": {"device": (lambda nb, bs, h, d: (nb, 2, h, bs, d), lambda t: t.transpose(2, 3))},
    "host_lbnhc": {"host": (lambda nb, bs, h, d: (nb, bs, h, 2 * d), lambda t: t.permute(0, 2, 1, 3))},
}
CONVERTING = ("lbnhc", "blnhc", "bhlnc", "lhbnc", "kv_first_hnd", "flashinfer_hnd", "host_lbnhc")


def physical_shape(layout: str, side: str, nb: int, bs: int, h: int, d: int) -> Tuple[int, ...]:
    """Shape of the allocation that holds a ``side`` ("device"/"host") tensor."""
    made = VIEWS.get(layout, {}).get(side)
    return tuple((made[0] if made else LAYOUTS[layout][0])(nb, bs, h, d))


def page_pairing(layout: str, bs: int, h: int, d: int, dtype: torch.dtype):
    """The :class:`~kvcopy.core.layout.PagePairing` of a layout's device page against its
    host page (run bytes and runs per page), from two-block tensors of each side."""
    from ..core.layout import describe, pair_pages

    itemsize = torch.empty((), dtype=dtype).element_size()
    sides = []
    for side in ("device", "host"):
        raw = torch.zeros(int(np.prod(physical_shape(layout, side, 2, bs, h, d))) * itemsize, dtype=torch.uint8)
        sides.append(describe(shaped(raw, layout, side, dtype, 2, bs, h, d), LAYOUTS[layout][1], LAYOUTS[layout][2]))
    return pair_pages(*sides)


def shaped(raw: torch.Tensor, layout: str, side: str, dtype: torch.dtype, nb: int, bs: int, h: int,
           d: int) -> torch.Tensor:
    """The ``side`` tensor of ``layout`` over ``raw`` (uint8, ``physical_shape`` bytes)."""
    made = VIEWS.get(layout, {}).get(side)
    t = raw.view(dtype).reshape(physical_shape(layout, side, nb, bs, h, d))
    return made[1](t) if made else t

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "fp32": torch.float32,
}

POISON_BYTE = 0xA5


@dataclass(frozen=True)
class CopyCase:
    layout: str = "nhd"
    dtype: str = "bf16"
    num_groups: int = 2
    layers_per_group: int = 2
    ids: str = "scattered"  # empty | one | odd | runs | scattered | all
    aliasing: bool = False
    separate_host_buffers: bool = False  # aliasing as vLLM does it: one host buffer per layer
    kv_sharing: int = 0  # KV-sharing layers (in no group)
    num_blocks: int = 24
    host_num_blocks: Optional[int] = None  # None: as the device
    host_ids_differ: bool = False  # host block ids are a different mapping
    block_size: int = 4
    num_heads: int = 2
    head_size: int = 8  # elements; odd values give odd byte sizes
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.layout, self.dtype, f"g{self.num_groups}", self.ids]
        if self.aliasing:
            parts.append("alias-hostperlayer" if self.separate_host_buffers else "alias")
        if self.kv_sharing:
            parts.append(f"share{self.kv_sharing}")
        if self.host_ids_differ:
            parts.append("hostids")
        if self.head_size % 2:
            parts.append(f"d{self.head_size}")
        return "-".join(parts)

    # ---------------------------------------------------------------- structure
    def layer_groups(self) -> List[List[str]]:
        return [
            [f"model.layers.{g + self.num_groups * i}.attn" for i in range(self.layers_per_group)]
            for g in range(self.num_groups)
        ]

    def sharing_layers(self) -> List[Tuple[str, str]]:
        """(KV-sharing layer, the layer whose KV it reads)."""
        groups = self.layer_groups()
        n = self.num_groups * self.layers_per_group
        return [(f"model.layers.{n + k}.attn", groups[k % len(groups)][0]) for k in range(self.kv_sharing)]

    def block_dim(self) -> int:
        return LAYOUTS[self.layout][1]

    def kv_layout(self) -> str:
        return LAYOUTS[self.layout][2]

    def block_ids(self) -> Tuple[List[List[int]], List[List[int]]]:
        """(device ids per group, host ids per group); unique across groups."""
        rng = np.random.default_rng(self.seed + 1)
        nb, g = self.num_blocks, self.num_groups
        per = {"empty": 0, "one": 1, "odd": 3, "runs": 6, "scattered": 5,
               "all": nb // g}[self.ids]
        if self.ids == "runs":  # contiguous runs inside each group, groups disjoint
            dev = [list(range(k * per, (k + 1) * per)) for k in range(g)]
            dev = [d[:2] + d[3:] for d in dev]  # one break in each run
        else:
            perm = rng.permutation(nb).tolist()
            dev = [perm[k * per:(k + 1) * per] for k in range(g)]
        host_nb = self.host_num_blocks or nb
        if self.host_ids_differ:
            perm = rng.permutation(host_nb).tolist()
            flat = iter(perm)
            host = [[next(flat) for _ in d] for d in dev]
        else:
            host = [list(d) for d in dev]
        return dev, host

    # ---------------------------------------------------------------- tensors
    def _tensor(self, nb: int, device, fill: Optional[int], gen: torch.Generator, side: str) -> torch.Tensor:
        dims = (nb, self.block_size, self.num_heads, self.head_size)
        dtype = DTYPES[self.dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(physical_shape(self.layout, side, *dims))) * itemsize
        if fill is None:
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        else:
            raw = torch.full((nbytes,), fill, dtype=torch.uint8)
        return shaped(raw.to(device), self.layout, side, dtype, *dims)

    def build(self, device="cpu", poison: str = "host") -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """(device caches, host buffers): the ``poison`` side filled with POISON_BYTE,
        the other random from the case's seed. Same seed, same bytes."""
        gen = torch.Generator().manual_seed(self.seed)
        groups = self.layer_groups()
        host_nb = self.host_num_blocks or self.num_blocks
        dev: Dict[str, torch.Tensor] = {}
        host: Dict[str, torch.Tensor] = {}
        dev_fill = POISON_BYTE if poison == "device" else None
        host_fill = POISON_BYTE if poison == "host" else None
        for i in range(self.layers_per_group):
            shared_dev = shared_host = None
            if self.aliasing:
                shared_dev = self._tensor(self.num_blocks, device, dev_fill, gen, "device")
                if not self.separate_host_buffers:
                    shared_host = self._tensor(host_nb, "cpu", host_fill, gen, "host")
            for layers in groups:
                name = layers[i]
                dev[name] = (shared_dev if shared_dev is not None
                             else self._tensor(self.num_blocks, device, dev_fill, gen, "device"))
                host[name] = (shared_host if shared_host is not None
                              else self._tensor(host_nb, "cpu", host_fill, gen, "host"))
        for name, target in self.sharing_layers():
            dev[name] = dev[target]
            # Never filled by a transfer: random junk that must never reach the device.
            host[name] = self._tensor(host_nb, "cpu", None, gen, "host")
        return dev, host


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_words(a.cpu()), as_words(b.cpu()))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of the allocation ``t`` views (uint8, on the CPU): a cross-layer
    view's neighbours included, so a stray write between its pages shows."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage()).cpu()


@dataclass
class PreparedCheck:
    """A case built twice: ``expected`` already holds the reference's result, ``got``
    is poisoned and waits for the copier (built on it) to run."""

    copier: BlockCopier
    dev_ids: List[List[int]]
    host_ids: List[List[int]]
    expected: Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]  # (device, host)
    got: Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]
    label: str

    def run(self, direction: str, max_ctas: Optional[int] = None) -> None:
        """The copy (``max_ctas``: the call's own grid cap, ``BlockCopier.run``'s)."""
        if direction == "d2h":
            self.copier.to_host(self.dev_ids, self.host_ids, max_ctas=max_ctas)
        else:
            self.copier.to_device(self.dev_ids, self.host_ids, max_ctas=max_ctas)

    def assert_matches(self) -> None:
        """Every tensor of both dicts, byte for byte: a stray write fails too."""
        if any(t.is_cuda for d in self.got for t in d.values()):
            torch.cuda.synchronize()
        for side, exp, got in zip(("device", "host"), self.expected, self.got):
            for name in exp:
                if not bytes_equal(exp[name], got[name]):
                    diff = (as_words(exp[name].cpu()) != as_words(got[name].cpu())).nonzero()
                    raise AssertionError(
                        f"{self.label}: {side} tensor of {name!r} differs from the reference at "
                        f"{diff.shape[0]} elements, first at index {diff[0].tolist()}"
                    )
                e_all, g_all = storage_bytes(exp[name]), storage_bytes(got[name])
                if not torch.equal(e_all, g_all):
                    first = int((e_all != g_all).nonzero()[0])
                    raise AssertionError(
                        f"{self.label}: the allocation under the {side} tensor of {name!r} differs "
                        f"from the reference outside the tensor, first at byte {first}"
                    )


def prepare_check(backend: str, case: CopyCase, direction: str, device="cpu", **copier_kw) -> PreparedCheck:
    """Build ``case`` for a ``direction`` ("d2h": to_host, "h2d": to_device) check."""
    poison = "host" if direction == "d2h" else "device"
    dev_ids, host_ids = case.block_ids()
    groups = case.layer_groups()
    bd = {n: case.block_dim() for g in groups for n in g}
    exp_dev, exp_host = case.build(device, poison)
    if direction == "d2h":
        reference_copy_groups(exp_dev, exp_host, groups, dev_ids, host_ids, bd)
    else:
        reference_copy_groups(exp_host, exp_dev, groups, host_ids, dev_ids, bd)
    got_dev, got_host = case.build(device, poison)
    copier = BlockCopier(got_dev, got_host, groups, copy_backend=backend,
                         block_dim=case.block_dim(), kv_layout=case.kv_layout(), **copier_kw)
    return PreparedCheck(copier, dev_ids, host_ids, (exp_dev, exp_host), (got_dev, got_host),
                         f"{case.id} {direction} backend={backend}")


def check_copy(backend: str, case: CopyCase, direction: str, device="cpu", **copier_kw) -> BlockCopier:
    """Run ``case`` through ``backend`` and assert it matches the reference bit for bit."""
    check = prepare_check(backend, case, direction, device, **copier_kw)
    check.run(direction)
    check.assert_matches()
    return check.copier


def standard_cases(quick: bool = False) -> List[CopyCase]:
    """The matrix every backend runs: layouts x dtypes x groups x ids, aliasing (host
    buffers shared, or one per layer as vLLM allocates them) and KV-sharing, odd
    sizes, host id remapping. ``quick`` keeps a covering subset."""
    cases = []
    layouts = [name for name in LAYOUTS if name not in CONVERTING]  # those: below
    dtypes = ["bf16", "fp8", "uint8", "fp16", "fp32"]
    for layout, dtype in itertools.product(layouts, dtypes[: 2 if quick else 5]):
        cases.append(CopyCase(layout=layout, dtype=dtype))
    for g in (1, 2, 3, 7):
        for ids in ("empty", "one", "odd", "runs", "scattered"):
            if quick and ids in ("odd", "one") and g in (3, 7):
                continue
            cases.append(CopyCase(num_groups=g, ids=ids, num_blocks=48, layout="kv_first"))
    cases += [
        CopyCase(aliasing=True, kv_sharing=2, num_groups=2, layout="kv_first"),
        CopyCase(aliasing=True, separate_host_buffers=True, kv_sharing=1, num_groups=3, layout="kv_first"),
        CopyCase(aliasing=True, separate_host_buffers=True, num_groups=2, layout="nhd", ids="runs"),
        CopyCase(aliasing=True, kv_sharing=1, num_groups=3, layout="nhd", dtype="fp8"),
        CopyCase(aliasing=True, num_groups=7, layers_per_group=1, layout="hnd_view_of_nhd"),
        CopyCase(kv_sharing=3, num_groups=1, layout="mla"),
        CopyCase(head_size=7, dtype="uint8", layout="nhd", ids="runs"),  # 1-byte alignment
        CopyCase(head_size=3, dtype="fp16", layout="kv_first"),  # 2-byte alignment
        CopyCase(host_ids_differ=True, host_num_blocks=17, layout="blocks_first_kv"),
        CopyCase(host_ids_differ=True, host_num_blocks=13, layout="kv_first"),  # K/V apart by a different NB
        CopyCase(ids="all", num_groups=2, layout="kv_first"),
        CopyCase(ids="all", num_groups=1, layout="nhd", num_blocks=64, dtype="fp32"),
    ]
    # Layout-converting pairs: several and odd head counts, fp8 (uint8 in vLLM), MLA
    # (one head: the orders agree, whole pages), aliasing, KV-sharing, merged runs.
    for layout in CONVERTING:
        cases.append(CopyCase(layout=layout, num_heads=3, ids="runs"))
        if not quick:
            cases.append(CopyCase(layout=layout, dtype="fp8", num_heads=4, host_ids_differ=True,
                                  host_num_blocks=17))
    cases += [
        CopyCase(layout="lbnhc", dtype="uint8", num_heads=5, head_size=7, ids="scattered"),  # 1-byte runs of 14
        CopyCase(layout="flashinfer_hnd", dtype="fp8", num_heads=2, ids="all", num_groups=1),
        CopyCase(layout="blnhc", num_heads=1, head_size=16, ids="runs"),  # MLA-like: one head
        CopyCase(layout="lhbnc", aliasing=True, kv_sharing=1, num_groups=3, ids="odd"),
        CopyCase(layout="kv_first_hnd", aliasing=True, separate_host_buffers=True, num_groups=2,
                 ids="runs", num_heads=3),
        CopyCase(layout="bhlnc", num_groups=7, layers_per_group=1, num_blocks=48, dtype="fp16"),
    ]
    return cases
