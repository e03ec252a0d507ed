"""A handshake fuzzer: bad metadata against a real ``add_peer`` (NIXL over UCX, loopback).

    python -m kvcopy.testing.nixl.handshake_fuzz --batch flips,keys --seed 0

One process holds a prefill manager P (alive, its agent reachable) and a decode
manager D. Each variant of P's genuine metadata goes to ``D.add_peer``; its outcome is
**refused** (``ValueError``/``TypeError``), **accepted** (allowed only for the genuine
bytes) or **unexpected** (any other exception, or bad bytes accepted: a bug). A crash
or a hang kills the process, which is why the tests run each batch in a subprocess.
Batches (``--batch``):

* ``random``: random bytes of random lengths, bare and behind a valid magic and version;
* ``truncations``: every prefix of the genuine payload, and each with one byte more;
* ``flips``: one flipped bit in every byte of the payload (lengths, header, NIXL's
  agent metadata, digest);
* ``counts``: oversized declared counts with valid digests: header and agent lengths
  up to 2^64-1, page counts 10^7 to 10^8 and 2^31, 100,000 extra regions (and as
  many as the byte limit allows), thousands of layers, groups, tokens;
* ``types``: every header and region field replaced by values of other types
  (``null``, booleans, floats, strings, lists, objects, negative and huge ints),
  with valid digests;
* ``keys``: a keyed D given unkeyed, wrongly keyed, forged and downgraded metadata.

After a batch the genuine metadata must still be accepted (then removed), NIXL must
hold no agent of P except the parked one, and D must hold no peer. The report is
one JSON line: variants, outcomes, the slowest variant (seconds), unexpected cases.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import struct
import sys
import time
from collections import Counter
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ...nixl.wire.handshake import MAGIC, HANDSHAKE_VERSION, decode, frame
from ...nixl.engine.info import EngineInfo

BATCHES = ("random", "truncations", "flips", "counts", "types", "keys")
_FIELD_VALUES: Tuple[object, ...] = (None, True, False, 1.5, -1, 2 ** 70, -(2 ** 70), "1", "", [], [1], {}, {"a": 1})
KEY = b"kvcopy-fuzz-key-0123456789abcdef"
# Variants that are valid metadata, meaning what the genuine one means: accepted.
EQUIVALENT = {
    "regions[0].axes=None": "a region without named axes moves whole, equal pages only",
    "sums=None": "a host-mode peer without page sums (checksum off): its pulls are unchecked",
}


def _header(data: bytes) -> dict:
    _, _, length, _ = struct.unpack_from("<IIQQ", data, len(MAGIC))
    return json.loads(data[len(MAGIC) + 24: len(MAGIC) + 24 + length])


def _edited(header: dict, agent: bytes, edit: Callable[[dict], None]) -> bytes:
    h = json.loads(json.dumps(header))
    edit(h)
    return frame(json.dumps(h).encode(), agent)


def misplaced(info: EngineInfo, offset: int = 1 << 40) -> EngineInfo:
    """``info`` advertising its regions ``offset`` bytes away: memory its NIXL agent
    never registered, so NIXL loads the agent and then rejects the descriptors."""
    return dataclasses.replace(info, regions=tuple(
        dataclasses.replace(r, address=r.address + offset) for r in info.regions))


def set_field(path: Sequence, value) -> Callable[[dict], None]:
    """An edit of a header dict: the field at ``path`` (keys and indices) set to ``value``."""
    def edit(h):
        obj = h
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return edit


def _many_regions(header: dict, agent: bytes, count: int) -> bytes:
    """The genuine header with ``count - 1`` extra one-layer regions (text built by
    substitution: 100,000 ``json.dumps`` calls would dominate the batch)."""
    region = header["regions"][0]
    template = json.dumps(dict(region, index=-7777, members=[["x-7777", 0]]))
    extra = ",".join(template.replace("-7777", str(i)) for i in range(1, count))
    text = json.dumps(dict(header, regions=[region]))
    return frame((text[:-2] + "," + extra + "]}").encode(), agent)


Variants = Iterator[Tuple[str, bytes]]


def _random(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    n = len(genuine)
    for i in range(600):
        size = int(rng.integers(0, 2 * n))
        junk = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        yield f"random{i}", junk if i % 2 else MAGIC + struct.pack("<I", HANDSHAKE_VERSION) + junk


def _truncations(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    n = len(genuine)
    for cut in range(n):
        yield f"prefix{cut}", genuine[:cut]
    for cut in range(0, n, 3):
        yield f"prefix{cut}+1", genuine[:cut] + bytes([int(rng.integers(0, 256))])


def _flips(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    for at in range(len(genuine)):
        bit = 1 << int(rng.integers(0, 8))
        yield f"flip{at}", genuine[:at] + bytes([genuine[at] ^ bit]) + genuine[at + 1:]


def _counts(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    """Every declared size and count out of bounds: the frame's lengths, then the header's."""
    head = MAGIC + struct.pack("<I", HANDSHAKE_VERSION)
    rest = genuine[len(head) + 4 + 16:]
    for length, alen in ((2 ** 64 - 1, 0), (2 ** 63, 10), (0, 2 ** 64 - 1), (2 ** 40, 2 ** 40), (1, 2 ** 30)):
        yield f"lengths{length},{alen}", head + struct.pack("<IQQ", 0, length, alen) + rest
    header = _header(genuine)
    for pages in (10 ** 7, 3 * 10 ** 7, 10 ** 8, 2 ** 31 - 1, 2 ** 31, 2 ** 63):
        yield f"num_pages={pages}", _edited(header, agent, set_field(("regions", 0, "num_pages"), pages))
    for count in (1000, 8192, 100000):
        yield f"regions={count}", _many_regions(header, agent, count)
    for members in (10 ** 4, 10 ** 5):
        yield f"members={members}", _edited(header, agent, set_field(
            ("regions", 0, "members"), [[f"m{i}", 0] for i in range(members)]))
    for groups in (65, 10 ** 4):
        def wide(h, groups=groups):
            h["tokens_per_block"] = [16] * groups
            h["tokens_per_page"] = [16] * groups
        yield f"groups={groups}", _edited(header, agent, wide)
    yield from _huge_fields(header, agent)
    yield "deep-json", frame(b"[" * 200000 + b"]" * 200000, agent)
    yield "huge-int-json", frame(b'{"tp_size": ' + b"9" * 100000 + b"}", agent)


def _huge_fields(header: dict, agent: bytes) -> Variants:
    for field in ("tokens_per_page", "chunk_bytes", "page_stride", "chunk_stride", "num_chunks", "address",
                  "total_kv_heads", "head_size"):
        for value in (2 ** 62, 2 ** 64, 10 ** 30):
            yield f"{field}={value}", _edited(header, agent, set_field(("regions", 0, field), value))
    for value in (2 ** 31, 10 ** 6):
        yield f"tp_size={value}", _edited(header, agent, set_field(("tp_size",), value))
        yield f"tokens_per_block={value}", _edited(header, agent, set_field(("tokens_per_block",), [value]))


def _types(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    """Every header field, and every field of a region, set to a value of each JSON type."""
    header = _header(genuine)
    for field in list(header):
        for v in _FIELD_VALUES:
            yield f"{field}={v!r}", _edited(header, agent, set_field((field,), v))
    for field in list(header["regions"][0]):
        for v in _FIELD_VALUES:
            yield f"regions[0].{field}={v!r}", _edited(header, agent, set_field(("regions", 0, field), v))
    for v in _FIELD_VALUES:
        yield f"regions[0].members[0]={v!r}", _edited(header, agent, set_field(("regions", 0, "members", 0), v))
        yield f"regions[0].page_shape[0]={v!r}", _edited(
            header, agent, set_field(("regions", 0, "page_shape", 0), v))
        yield f"header={v!r}", frame(json.dumps(v).encode(), agent)


def _keys(genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    """The keyed handshake: the genuine keyed payload, then every way to forge one."""
    body = genuine[len(MAGIC) + 24: len(genuine) - 32]
    header_bytes = body[: len(body) - len(agent)]
    signed = frame(header_bytes, agent, KEY)
    yield "keyed-genuine", signed  # accepted (the keyed D's one genuine variant)
    yield "unkeyed", genuine
    yield "wrong-key", frame(header_bytes, agent, b"x" * 32)
    yield "hmac-dropped", signed[:-32]
    yield "flag-cleared", signed[:len(MAGIC) + 4] + struct.pack("<I", 0) + signed[len(MAGIC) + 8:]
    for at in range(len(MAGIC) + 24, len(signed) - 64, 11):
        t = bytearray(signed[:-64])
        t[at] ^= 1
        yield f"forged{at}", bytes(t) + hashlib.sha256(bytes(t)).digest() + signed[-32:]
    for at in range(len(signed) - 32, len(signed)):
        yield f"hmac-flip{at}", signed[:at] + bytes([signed[at] ^ 4]) + signed[at + 1:]


_BATCH_VARIANTS: Dict[str, Callable[[bytes, bytes, np.random.Generator], Variants]] = {
    "random": _random, "truncations": _truncations, "flips": _flips, "counts": _counts, "types": _types,
    "keys": _keys,
}


def variants(batch: str, genuine: bytes, agent: bytes, rng: np.random.Generator) -> Variants:
    """(label, payload) of one batch, built from P's genuine payload."""
    if batch not in _BATCH_VARIANTS:
        raise ValueError(f"unknown batch {batch!r}; one of {BATCHES}")
    return _BATCH_VARIANTS[batch](genuine, agent, rng)


def run_batch(batch: str, seed: int = 0) -> Dict[str, object]:
    """Run one batch against real managers in this process; the report as a dict."""
    from .engines import build_case, one_torch_thread
    from .oracle import fill_random

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL traffic on loopback only
    rng = np.random.default_rng(seed)
    keyed = batch == "keys"
    pe, de = build_case("one_group", 8), build_case("one_group", 8)
    fill_random(pe.device_caches, 1)
    fill_random(de.device_caches, 2)
    tag = f"{os.getpid()}-{batch}"
    outcomes: Counter = Counter()
    unexpected: List[str] = []
    slowest = (0.0, "")
    with one_torch_thread():
        p = pe.manager(f"P-{tag}")
        d = de.manager(f"D-{tag}", key=KEY if keyed else None)
        try:
            genuine = p.metadata()
            agent = decode(genuine).agent_metadata
            good = frame(genuine[len(MAGIC) + 24: len(genuine) - 32 - len(agent)], agent, KEY) if keyed else genuine
            count = 0
            for label, data in variants(batch, genuine, agent, rng):
                count += 1
                t0 = time.perf_counter()
                try:
                    name = d.add_peer(data)
                except (ValueError, TypeError):
                    outcomes["refused"] += 1
                except Exception as exc:  # noqa: BLE001 - what the fuzzer is for
                    outcomes["unexpected"] += 1
                    unexpected.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
                else:
                    d.remove_peer(name)
                    if data == good:
                        outcomes["accepted"] += 1
                    elif label in EQUIVALENT:
                        outcomes["accepted (equivalent)"] += 1
                    else:
                        outcomes["unexpected"] += 1
                        unexpected.append(f"{label}: bad metadata accepted")
                dt = time.perf_counter() - t0
                if dt > slowest[0]:
                    slowest = (dt, label)
            after = []
            if d.peers():
                after.append(f"peers left: {d.peers()}")
            stray = [n for n in (p.name,) if d._agent.has_remote(n) and n not in d._agent.parked]
            if stray:
                after.append(f"NIXL holds unparked agents {stray}")
            try:
                d.remove_peer(d.add_peer(good))
            except Exception as exc:  # noqa: BLE001
                after.append(f"genuine metadata refused after the batch: {type(exc).__name__}: {exc}")
        finally:
            d.close()
            p.close()
    return {"batch": batch, "seed": seed, "variants": count, "outcomes": dict(outcomes),
            "slowest_s": round(slowest[0], 4), "slowest": slowest[1], "unexpected": unexpected[:20],
            "after": after}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcopy.testing.nixl.handshake_fuzz",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--batch", default="all", help=f"comma-separated batches of {list(BATCHES)}, or all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    bad = 0
    batches = BATCHES if args.batch == "all" else tuple(args.batch.split(","))
    unknown = [b for b in batches if b not in BATCHES]
    if unknown:
        ap.error(f"unknown batch(es) {unknown}; choose from {list(BATCHES)}")
    for batch in batches:
        report = run_batch(batch, args.seed)
        print(json.dumps(report), flush=True)
        bad += bool(report["unexpected"] or report["after"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
