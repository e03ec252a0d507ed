"""A region's part of the handshake header: :class:`~kvcopy.nixl.engine.regions.RegionInfo`
to and from its JSON object, every field of a peer's checked (types and ranges here,
the fields against each other by ``RegionInfo.check_consistent``). Keys are the
dataclass's field names; tuples become lists."""
from __future__ import annotations

from dataclasses import asdict
from typing import Mapping, Optional, Tuple

from ...checks import shown
from ...core.layout import KV_LAYOUTS
from ..engine.regions import (
    AXIS_NAMES, DTYPE_SIZES, LAYOUT_KINDS, MAX_BYTES, MAX_CHUNKS, MAX_DEVICE_ID, MAX_DIMS, MAX_GROUPS, MAX_HEADS,
    MAX_LAYERS, MAX_NAME, MAX_PAGES, MAX_TOKENS_PER_PAGE, RegionInfo,
)
from .schema import Record, check_int, check_list, check_str


def region_to_dict(region: RegionInfo) -> dict:
    return asdict(region)


def region_from_dict(d) -> RegionInfo:
    """A region from a peer's handshake header: every field type- and range-checked,
    and the fields checked against each other (see :mod:`kvcopy.nixl.wire.schema`);
    ``ValueError`` on anything else. ``index`` and group numbers are checked
    against the engine record by :func:`kvcopy.nixl.wire.handshake.decode`."""
    r = Record(d, "region " + (shown(d.get("index")) if isinstance(d, Mapping) else "?"))
    members = tuple(_member(m, r.at(f"members[{i}]")) for i, m in enumerate(r.entries("members", 1, MAX_LAYERS)))
    dtype = r.name("dtype", 32)
    itemsize = r.integer("itemsize", 1, 16)
    if DTYPE_SIZES.get(dtype) != itemsize:
        raise ValueError(f"{r.where}: dtype {shown(dtype)} with itemsize {itemsize} is not a known "
                         f"dtype (known: {sorted(DTYPE_SIZES)})")
    page_shape = tuple(_size_stride(p, r.at(f"page_shape[{i}]"))
                       for i, p in enumerate(r.entries("page_shape", 0, MAX_DIMS)))
    total = r.integer_or_none("total_kv_heads", 1, MAX_HEADS)
    raw_heads = r.entries_or_none("heads", 2, 2)
    heads = None if raw_heads is None else (check_int(raw_heads[0], 0, MAX_HEADS - 1, r.at("heads[0]")),
                                            check_int(raw_heads[1], 1, MAX_HEADS, r.at("heads[1]")))
    raw_axes = r.entries_or_none("axes", 1, MAX_DIMS)
    axes = None if raw_axes is None else tuple(_axis(a, r.at(f"axes[{i}]")) for i, a in enumerate(raw_axes))
    info = RegionInfo(
        index=r.integer("index", 0, MAX_LAYERS - 1), members=members,
        address=r.integer("address", 0, (1 << 64) - 1), device_id=r.integer("device_id", 0, MAX_DEVICE_ID),
        num_pages=r.integer("num_pages", 1, MAX_PAGES), num_chunks=r.integer("num_chunks", 1, MAX_CHUNKS),
        chunk_bytes=r.integer("chunk_bytes", 1, MAX_BYTES), page_stride=r.integer("page_stride", 0, MAX_BYTES),
        chunk_stride=r.integer("chunk_stride", 0, MAX_BYTES), dtype=dtype, itemsize=itemsize,
        page_shape=page_shape, kind=r.choice("kind", LAYOUT_KINDS), kv_layout=r.choice("kv_layout", KV_LAYOUTS),
        tokens_per_page=r.integer("tokens_per_page", 1, MAX_TOKENS_PER_PAGE), total_kv_heads=total,
        heads=heads, head_size=r.integer_or_none("head_size", 1, MAX_BYTES), axes=axes,
    )
    r.done()
    info.check_consistent(r.where)
    return info


def _member(value, where: str) -> Tuple[str, int]:
    check_list(value, 2, 2, where)
    return check_str(value[0], MAX_NAME, f"{where} layer"), check_int(value[1], 0, MAX_GROUPS - 1, f"{where} group")


def _size_stride(value, where: str) -> Tuple[int, Optional[int]]:
    check_list(value, 2, 2, where)
    stride = None if value[1] is None else check_int(value[1], 0, MAX_BYTES, f"{where} stride")
    return check_int(value[0], 1, MAX_BYTES, f"{where} size"), stride


def _axis(value, where: str) -> Tuple[str, int, int]:
    check_list(value, 3, 3, where)
    if value[0] not in AXIS_NAMES:
        raise ValueError(f"{where}: axis name {shown(value[0])} is not one of {list(AXIS_NAMES)}")
    return value[0], check_int(value[1], 1, MAX_BYTES, f"{where} size"), check_int(value[2], 0, MAX_BYTES,
                                                                                    f"{where} stride")
