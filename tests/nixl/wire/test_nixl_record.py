"""StagedRequest's wire form (kvcopy/nixl/wire/record.py): framed like the handshake (lengths,
SHA-256, optional HMAC), canonical JSON, every field through the schema. Every bit flip,
byte change, truncation and extension of a serialized record is refused; edits of the
JSON re-framed with a fresh digest are refused where they are not a record (duplicate
keys, booleans, floats, strings for numbers, nesting, a changed encoding) and always
where a key is used. No case raises anything but ValueError/TypeError."""
import json
import re

import numpy as np
import pytest

from kvcopy.nixl.planning.pack_order import HEAD_ORDER, ORDER
from kvcopy.nixl.wire.record import MAX_RECORD_BYTES, RECORD, PageSums, StagedRequest, canonical

KEY = b"kvcopy-record-test-key-0123456789"
SUMS = PageSums.of("0123456789abcdef" * 2, [np.array([1, 2**64 - 1, 3, 0, 5, 6], np.uint64),
                                             np.array([0, 2**63, 7], np.uint64)])
GENUINE = StagedRequest("prefill-0", "cmpl-7f3a-0", 8192 * 37, 16384 * 3, 90, ((1, 1, 1, 0, 1, 1), (0, 1, 1)), ORDER,
                        SUMS)
WIRE = GENUINE.to_bytes()
KEYED = GENUINE.to_bytes(KEY)


def parse(data, key=None):
    """The record a reader takes from ``data``, or None where it refuses it (ValueError)."""
    try:
        return StagedRequest.from_bytes(data, key)
    except ValueError:
        return None


def test_round_trip_and_one_encoding():
    assert StagedRequest.from_bytes(WIRE) == GENUINE
    assert StagedRequest.from_bytes(KEYED, KEY) == GENUINE
    body = canonical(GENUINE.to_dict())
    assert RECORD.unframe(WIRE) == [body] and b" " not in body
    assert list(json.loads(body)) == sorted(json.loads(body))  # keys sorted


@pytest.mark.parametrize("at", range(len(KEYED)))
def test_every_bit_flip_is_refused(at):
    """All 8 flips of byte ``at``, read with and without the key (2 x 8 x len variants)."""
    for bit in range(8):
        for data, key in ((WIRE, None), (KEYED, KEY)):
            if at >= len(data):
                continue
            flipped = data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:]
            assert parse(flipped, key) is None, (at, bit, key is not None)


def test_flips_in_the_offset_digits_and_the_order_field_are_refused():
    """The flips that completed ok=True with foreign bytes before records had a digest."""
    body = canonical(GENUINE.to_dict())
    start = len(WIRE) - 32 - len(body)
    for field in (b'"offset":', b'"order":', b'"nbytes":', b'"blocks":'):
        at = start + body.index(field) + len(field)
        for i in range(at, at + 8):
            for bit in range(8):
                assert parse(WIRE[:i] + bytes([WIRE[i] ^ (1 << bit)]) + WIRE[i + 1:]) is None


def test_byte_changes_truncations_and_extensions_are_refused():
    rng = np.random.default_rng(0)
    count = 0
    for at in range(len(WIRE)):
        new = int(rng.integers(0, 255))
        new += new >= WIRE[at]  # any other byte
        assert parse(WIRE[:at] + bytes([new]) + WIRE[at + 1:]) is None
        assert parse(WIRE[:at]) is None
        count += 2
    for extra in (b"\0", b"x" * 31, b"}" * 64, WIRE):
        assert parse(WIRE + extra) is None
    assert count >= 2 * len(WIRE)


def edited(edit) -> bytes:
    """The record's JSON text edited (``edit``: text -> text), as the bytes that would
    arrive (text that is not UTF-8 included)."""
    return edit(canonical(GENUINE.to_dict()).decode()).encode("utf-8", "surrogateescape")


def reframed(edit) -> bytes:
    """The edited JSON framed with a fresh digest (what a faulty or hostile peer sends)."""
    return RECORD.frame((edited(edit),))


def field_value(name: str, value: str):
    def edit(text):
        obj = json.loads(text)
        return text.replace(f'"{name}":{json.dumps(obj[name], separators=(",", ":"))}', f'"{name}":{value}', 1)
    return edit


NOT_A_RECORD = {
    "duplicate offset": lambda t: t.replace('"offset":', '"offset":0,"offset":', 1),
    "duplicate order": lambda t: t.replace('"order":', f'"order":"{HEAD_ORDER}","order":', 1),
    "offset true": field_value("offset", "true"),
    "offset float": field_value("offset", "302848.0"),
    "offset exponent": field_value("offset", "3.02848e5"),
    "offset string": field_value("offset", '"302848"'),
    "offset negative": field_value("offset", "-8192"),
    "offset -0": field_value("offset", "-0"),
    "offset 2**64": field_value("offset", str(2**64)),
    "offset 1e400": field_value("offset", "1e400"),
    "offset NaN": field_value("offset", "NaN"),
    "offset Infinity": field_value("offset", "Infinity"),
    "offset null": field_value("offset", "null"),
    "offset list": field_value("offset", "[302848]"),
    "nbytes float": field_value("nbytes", "49152.5"),
    "num_tokens bool": field_value("num_tokens", "false"),
    "num_tokens string": field_value("num_tokens", '"90"'),
    "block flag 2": field_value("blocks", "[[1,1,1,0,1,2],[0,1,1]]"),
    "block flag bool": field_value("blocks", "[[true,1,1,0,1,1],[0,1,1]]"),
    "block flag float": field_value("blocks", "[[1.0,1,1,0,1,1],[0,1,1]]"),
    "blocks nested": field_value("blocks", "[[[1],1,1,0,1,1],[0,1,1]]"),
    "blocks not a list": field_value("blocks", '{"0":[1]}'),
    "blocks no groups": field_value("blocks", "[]"),
    "order unknown": field_value("order", '"unit/page:v9"'),
    "order not a string": field_value("order", "1"),
    "engine empty": field_value("engine", '""'),
    "engine number": field_value("engine", "7"),
    "request id empty": field_value("request_id", '""'),
    "request id too long": field_value("request_id", json.dumps("r" * 5000)),
    "field missing": lambda t: t.replace('"num_tokens":90,', "", 1),
    "field unknown": lambda t: t[:-1] + ',"zz":1}',
    "not an object": lambda t: "[" + t + "]",
    "deep nesting": lambda t: "[" * 100_000 + "]" * 100_000,
    "spaces": lambda t: t.replace(",", ", "),
    "keys reordered": lambda t: json.dumps(dict(reversed(list(json.loads(t).items()))), separators=(",", ":")),
    "unicode escape": lambda t: t.replace('"prefill-0"', '"\\u0070refill-0"', 1),
    "not utf-8": lambda t: t.replace("prefill", "pr\udcffefill", 1),
    "empty": lambda t: "",
    "sums null": field_value("sums", "null"),
    "sums not an object": field_value("sums", "[]"),
    "sums field unknown": lambda t: t.replace('"pages":', '"zz":1,"pages":', 1),
    "sums layout short": lambda t: t.replace('"layout":"0123456789abcdef', '"layout":"123456789abcdef', 1),
    "sums layout upper": lambda t: t.replace('"layout":"0123456789abcdef', '"layout":"0123456789ABCDEF', 1),
    "sums page upper": lambda t: t.replace("ffffffffffffffff", "FFFFFFFFFFFFFFFF", 1),
    "sums page not hex": lambda t: t.replace("ffffffffffffffff", "fffffffffffffffg", 1),
    "sums page spaces": lambda t: t.replace("ffffffffffffffff", "ffffffff ffffffff"[:16], 1),
    "sums page odd length": lambda t: t.replace("ffffffffffffffff", "fffffffffffffff", 1),
    "sums pages not a list": lambda t: t.replace('"pages":[', '"pages":{"0":', 1).replace('"]}', '"}}', 1),
    "sums page a number": lambda t: re.sub(r'"pages":\["[0-9a-f]*"', '"pages":[7', t, count=1),
    "sums no groups": lambda t: re.sub(r'"pages":\[[^]]*\]', '"pages":[]', t, count=1),
}


@pytest.mark.parametrize("name", list(NOT_A_RECORD))
def test_json_that_is_not_a_record_is_refused_even_with_a_fresh_digest(name):
    with pytest.raises(ValueError):
        StagedRequest.from_bytes(reframed(NOT_A_RECORD[name]))


VALID_EDITS = {  # records with another meaning that a digest cannot tell from genuine ones
    "another offset": field_value("offset", str(8192 * 38)),
    "other sums": lambda t: t.replace("ffffffffffffffff", "fffffffffffffffe", 1),
    "no sums": lambda t: re.sub(r',"sums":\{[^}]*\}', "", t, count=1),
    "the other order": field_value("order", json.dumps(HEAD_ORDER)),
    "another request": field_value("request_id", '"cmpl-0000-0"'),
}


@pytest.mark.parametrize("name", list(VALID_EDITS) + list(NOT_A_RECORD))
def test_a_keyed_reader_refuses_every_edit_made_without_the_key(name):
    """A peer without the key re-framing edited JSON with a fresh digest (and even an
    HMAC made with another key) is refused by a reader with the key."""
    body = edited({**VALID_EDITS, **NOT_A_RECORD}[name])
    for data in (RECORD.frame((body,)), RECORD.frame((body,), b"another-key-of-enough-length")):
        with pytest.raises(ValueError, match="authenticated|HMAC|declares"):  # declares: an empty body
            StagedRequest.from_bytes(data, KEY)


@pytest.mark.parametrize("name", list(VALID_EDITS))
def test_edits_that_are_records_mean_what_they_say(name):
    """Unkeyed, a re-framed valid record is read as exactly what its fields say (a
    hostile peer can describe its own arena; D checks the span against the peer's
    arena). This is what the key is for."""
    got = StagedRequest.from_bytes(reframed(VALID_EDITS[name]))
    assert got != GENUINE and got.to_bytes() == reframed(VALID_EDITS[name])


def test_key_misuse_and_declared_sizes():
    with pytest.raises(ValueError, match="this manager has none"):
        StagedRequest.from_bytes(KEYED)
    with pytest.raises(ValueError, match="requires a shared key"):
        StagedRequest.from_bytes(WIRE, KEY)
    with pytest.raises(ValueError, match="HMAC does not match"):
        StagedRequest.from_bytes(GENUINE.to_bytes(b"another-key-of-enough-length"), KEY)
    with pytest.raises(TypeError, match="must be bytes"):
        StagedRequest.from_bytes(GENUINE.to_dict())
    with pytest.raises(TypeError, match="key must be bytes"):
        StagedRequest.from_bytes(WIRE, "a string key of enough length")
    head = WIRE[:12 + 8]
    for length in (0, 1, MAX_RECORD_BYTES + 1, 2**63, 2**64 - 1):  # declared before anything is read
        with pytest.raises(ValueError, match="declares|truncated"):
            StagedRequest.from_bytes(head + length.to_bytes(8, "little") + WIRE[28:])


def test_sums_round_trip_and_are_read_as_uint64():
    assert StagedRequest.from_bytes(WIRE).sums == SUMS
    assert SUMS.values(0).tolist() == [1, 2**64 - 1, 3, 0, 5, 6] and SUMS.values(1).tolist() == [0, 2**63, 7]
    bare = GENUINE.with_sums(None)
    assert "sums" not in bare.to_dict() and StagedRequest.from_bytes(bare.to_bytes()).sums is None
    with pytest.raises(ValueError, match="sums"):
        StagedRequest.from_dict(dict(GENUINE.to_dict(), sums={"layout": "0" * 32, "pages": ["0" * 17]}))


def test_from_dict_checks_every_field():
    good = GENUINE.to_dict()
    assert StagedRequest.from_dict(good) == GENUINE
    for name, value in [("offset", True), ("offset", 1.0), ("offset", "1"), ("nbytes", -1), ("num_tokens", None),
                        ("blocks", [[1, 0.0]]), ("blocks", [[2]]), ("order", "x"), ("engine", ""), ("request_id", 5)]:
        with pytest.raises(ValueError, match=name):
            StagedRequest.from_dict(dict(good, **{name: value}))
    with pytest.raises(ValueError, match="unknown field"):
        StagedRequest.from_dict(dict(good, extra=1))
    with pytest.raises(ValueError, match="expected an object"):
        StagedRequest.from_dict([good])
