"""The handshake: versioned bytes, and peers refused with a ValueError saying what differs."""
import dataclasses
import hashlib
import json
import struct

import pytest
import torch

from kvcopy.nixl.wire.handshake import HANDSHAKE_VERSION, decode, encode
from kvcopy.nixl.wire.handshake import MAGIC, frame, header_of
from kvcopy.testing.nixl.handshake_fuzz import misplaced, set_field
from kvcopy.testing.nixl.engines import ToyEngine, build_case, engine_info

NP = 16


def test_encode_decode_round_trip_keeps_every_region_field():
    info = dataclasses.replace(engine_info(build_case("hybrid", NP), "P"), agent_metadata=b"\x00agent\xff")
    data = encode(info)
    assert data.startswith(MAGIC)
    assert decode(data) == info


def test_unknown_version_truncation_and_garbage_are_refused():
    data = encode(engine_info(build_case("one_group", NP), "P"))
    newer = data[: len(MAGIC)] + struct.pack("<I", HANDSHAKE_VERSION + 1) + data[len(MAGIC) + 4 :]
    with pytest.raises(ValueError, match=f"version {HANDSHAKE_VERSION + 1} is not supported"):
        decode(newer)
    with pytest.raises(ValueError, match="truncated"):
        decode(data[: len(MAGIC) + 20])
    with pytest.raises(ValueError, match="truncated"):
        decode(data[:-1])
    with pytest.raises(ValueError, match="extra bytes"):
        decode(data + b"\0")
    with pytest.raises(ValueError, match="bad magic"):
        decode(b"not a handshake")
    with pytest.raises(TypeError, match="must be bytes"):
        decode("KVCOPY-NIXL")


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


def test_digest_refuses_a_flipped_bit_anywhere_past_the_lengths():
    """The SHA-256 covers the header and NIXL's agent metadata: one flipped bit in
    either is refused before NIXL sees a byte (v2 handed such bytes to NIXL, which
    crashed in UCX)."""
    info = dataclasses.replace(engine_info(build_case("hybrid", NP), "P"), agent_metadata=b"nixl-agent" * 20)
    data = encode(info)
    body = len(MAGIC) + 24
    for at in list(range(body, len(data), 7)) + [len(data) - 1]:
        with pytest.raises(ValueError, match="digest does not match"):
            decode(_flip(data, at))


def test_a_shared_key_authenticates_and_each_mismatch_is_refused():
    info = dataclasses.replace(engine_info(build_case("one_group", NP), "P"), agent_metadata=b"agent")
    key, other = b"k" * 32, b"o" * 32
    signed = encode(info, key)
    assert decode(signed, key) == info
    with pytest.raises(ValueError, match="HMAC does not match"):
        decode(signed, other)
    with pytest.raises(ValueError, match="this manager has none"):
        decode(signed)
    with pytest.raises(ValueError, match="not authenticated: this manager requires"):
        decode(encode(info), key)
    # tampering and recomputing the digest does not get past the key
    tampered = _flip(signed[:-64], len(MAGIC) + 30)
    forged = tampered + hashlib.sha256(tampered).digest() + signed[-32:]
    with pytest.raises(ValueError, match="HMAC does not match"):
        decode(forged, key)
    # dropping the HMAC and clearing the flag is a downgrade, refused by a keyed decoder
    with pytest.raises(ValueError):
        decode(signed[:-32], key)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        decode(signed, b"short")
    with pytest.raises(TypeError, match="key must be bytes"):
        encode(info, "a string key of enough length")


def _with_header(info, edit) -> bytes:
    """A well-formed payload (valid lengths and digest) carrying an edited header."""
    header = json.loads(json.dumps(header_of(info)))
    edit(header)
    return frame(json.dumps(header).encode(), info.agent_metadata)


def _drop(path):
    def edit(h):
        obj = h
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return edit


R0 = ("regions", 0)


@pytest.mark.parametrize("edit, match", [
    (set_field(R0 + ("tokens_per_page",), -16), r"tokens_per_page: -16 out of range"),
    (set_field(("tokens_per_page",), [-16]), r"tokens_per_page\[0\]: -16 out of range"),
    (set_field(("tokens_per_page",), [0]), r"out of range"),
    (set_field(("tokens_per_block",), [24]), r"not a multiple"),
    (set_field(("tp_size",), 0), r"tp_size: 0 out of range"),
    (set_field(("tp_rank",), 2), r"tp_rank: 2 out of range \[0, 0\]"),
    (set_field(("tp_rank",), True), r"expected an integer, got True"),
    (set_field(("tp_rank",), 0.0), r"expected an integer, got 0.0"),
    (set_field(("name",), ""), r"is not a name"),
    (set_field(("name",), 7), r"expected a string"),
    (set_field(("buffer",), "disk"), r"'disk' is not one of"),
    (set_field(("mem_type",), "VRAM"), r"host buffers in VRAM"),
    (set_field(("regions",), []), r"0 entries"),
    (set_field(("regions",), {}), r"expected a list"),
    (set_field(R0 + ("num_pages",), 0), r"num_pages: 0 out of range"),
    (set_field(R0 + ("num_pages",), 10**30), r"num_pages: .* out of range"),
    (set_field(R0 + ("num_chunks",), -1), r"num_chunks: -1 out of range"),
    (set_field(R0 + ("chunk_bytes",), 0), r"chunk_bytes: 0 out of range"),
    (set_field(R0 + ("page_stride",), -512), r"page_stride: -512 out of range"),
    (set_field(R0 + ("page_stride",), 8), r"overlap"),
    (set_field(R0 + ("address",), 2**64 - 8), r"overflows 64 bits"),
    (set_field(R0 + ("dtype",), "float17"), r"not a known dtype"),
    (set_field(R0 + ("itemsize",), 4), r"not a known dtype"),
    (set_field(R0 + ("kind",), "paged"), r"'paged' is not one of"),
    (set_field(R0 + ("kv_layout",), "NDH"), r"'NDH' is not one of"),
    (set_field(R0 + ("heads",), [1, 2]), r"outside 2 total"),
    (set_field(R0 + ("heads",), [0, 0]), r"heads\[1\]: 0 out of range"),
    (set_field(R0 + ("total_kv_heads",), 0), r"total_kv_heads: 0 out of range"),
    (set_field(R0 + ("members",), [["a0", 5]]), r"group 5 of 1"),
    (set_field(R0 + ("members",), [["a0"]]), r"1 entries, expected 2"),
    (set_field(R0 + ("members",), "a0"), r"expected a list"),
    (set_field(R0 + ("index",), 3), r"region 0 says it is region 3"),
    (set_field(R0 + ("axes",), [["token", 16, 16], ["qq", 2, 8]]), r"axis name 'qq'"),
    (set_field(R0 + ("axes",), [["token", 8, 16], ["head", 2, 8], ["o0", 8, 1]]), r"hold 256 bytes"),
    (set_field(R0 + ("page_shape",), [[16, "x"]]), r"stride: expected an integer"),
    (_drop(R0 + ("chunk_stride",)), r"'chunk_stride' is missing"),
    (_drop(("tp_size",)), r"'tp_size' is missing"),
    (set_field(R0 + ("surprise",), 1), r"unknown field"),
    (set_field(("surprise",), 1), r"unknown field"),
])
def test_every_header_field_is_type_and_range_checked(edit, match):
    """One schema over the header: each field's type, range and agreement with the
    others; v2 took a negative tokens_per_page, and plan_pull then never returned."""
    info = dataclasses.replace(engine_info(_engine(), "P"), agent_metadata=b"agent")
    with pytest.raises(ValueError, match=match):
        decode(_with_header(info, edit))


def test_a_layer_in_two_regions_and_deep_or_odd_json_are_refused():
    eng = ToyEngine({n: torch.empty(NP, 16, 2, 8, dtype=torch.float16) for n in ("a0", "a1")}, [["a0"], ["a1"]],
                    [16, 16], 16)
    info = dataclasses.replace(engine_info(eng, "P"), agent_metadata=b"agent")
    with pytest.raises(ValueError, match="is in region 0 and region 1"):
        decode(_with_header(info, set_field(("regions", 1, "members"), [["a0", 1]])))
    for body in (b"[" * 100000 + b"]" * 100000, b'{"name": NaN}', b"\xff\xfe", b"1" * 5000, b"[]"):
        with pytest.raises(ValueError):
            decode(frame(body, b"x"))


def _engine(dtype=torch.float16, tokens=16, heads=2, tpb=16, names=("a0", "a1"), head_size=8):
    caches = {n: torch.empty(NP, tokens, heads, head_size, dtype=dtype) for n in names}
    return ToyEngine(caches, [list(names)], [tpb], tokens)


def test_add_peer_refuses_before_any_transfer():
    d = _engine().manager("D-hs")
    try:
        bad = _engine(dtype=torch.float32).manager("P-hs-bad")
        with pytest.raises(ValueError, match="element size"):
            d.add_peer(bad.metadata())
        assert d.peers() == []
        with pytest.raises(ValueError, match="own name"):
            d.add_peer(d.metadata())
        good = _engine().manager("P-hs")
        assert d.add_peer(good.metadata()) == "P-hs"
        with pytest.raises(ValueError, match="already added"):
            d.add_peer(good.metadata())
        bad.close()
        good.close()
    finally:
        d.close()


def test_add_peer_refuses_regions_nixl_does_not_know():
    """A handshake advertising memory its agent never registered: NIXL rejects the
    descriptors when D prepares them, and add_peer raises (nothing added)."""
    d = _engine().manager("D-lie")
    p = _engine().manager("P-lie")
    try:
        with pytest.raises(ValueError, match="not what it registered"):
            d.add_peer(encode(misplaced(decode(p.metadata()))))
        assert d.peers() == []
        assert d.add_peer(p.metadata()) == "P-lie"  # the truthful handshake still works
    finally:
        d.close()
        p.close()
