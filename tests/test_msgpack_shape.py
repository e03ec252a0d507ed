"""kvcopy.msgpack_shape: the bound checked before a msgpack decoder sees a peer's bytes
(msgspec's recursion on deep nesting killed P's side-channel listener). The decoder
cross-check and the listener fuzz: tests/vllm/test_vllm_arena_channel.py (vLLM env)."""
import struct

import pytest

from kvcopy.msgpack_shape import check_shape

OK = [
    (b"\xc0", 1), (b"\x05", 1), (b"\xff", 1), (b"\xa3abc", 1), (b"\xc4\x02xy", 1), (b"\x92\x01\x02", 3),
    (b"\x81\xa1k\x01", 3), (b"\x93\xae" + b"kvcopy_records" + b"\xa1r\x91\x00", 5),  # (RECORDS_MSG, "r", [0])
    (b"\xdc\x00\x02\x01\x02", 3), (b"\xde\x00\x01\x01\x02", 3), (b"\xcb" + struct.pack(">d", 1.5), 1),
    (b"\xd4\x01\x02", 1), (b"\xc7\x01\x05x", 1), (b"\xdb\x00\x00\x00\x01z", 1), (b"\x90", 1), (b"\x80", 1),
]


@pytest.mark.parametrize("data,items", OK)
def test_well_formed_messages_pass(data, items):
    check_shape(data, len(data), 4, items)
    with pytest.raises(ValueError, match="values"):
        check_shape(data, len(data), 4, items - 1)


@pytest.mark.parametrize("data,words", [
    (b"\x91" * 1000 + b"\xc0", "deeper"),  # the question that killed the listener
    (b"\x81\xa1k" * 1000 + b"\xc0", "deeper"),  # deep maps
    (b"\x93\xa1x\x91" + b"\x91" * 1000 + b"\xc0\x90", "deeper"),  # deep inside a question's slot
    (b"", "truncated"), (b"\x92\x01", "truncated"), (b"\xa5ab", "past the message"),
    (b"\xdd\xff\xff\xff\xff", "past the message"),  # a count of 4 billion in 5 bytes
    (b"\xc6\xff\xff\xff\xff", "past the message"), (b"\xdb\x00\x00", "truncated"),
    (b"\xc1", "not a msgpack type"), (b"\x01\x02", "after the message"),
])
def test_bad_messages_are_refused_without_recursion(data, words):
    with pytest.raises(ValueError, match=words):
        check_shape(data, 1 << 16, 4, 1 << 16)


def test_size_depth_and_type_bounds():
    with pytest.raises(ValueError, match="more than 3"):
        check_shape(b"\xa4abcd", 3, 4, 10)
    check_shape(b"\x91" * 4 + b"\xc0", 5, 4, 10)
    with pytest.raises(ValueError, match="deeper than 4"):
        check_shape(b"\x91" * 5 + b"\xc0", 6, 4, 10)
    with pytest.raises(ValueError, match="must be bytes"):
        check_shape("\x90", 10, 4, 10)


def test_every_byte_string_of_up_to_two_bytes_and_every_truncation_only_raises_value_error():
    for a in range(256):
        for data in [bytes([a])] + [bytes([a, b]) for b in range(256)]:
            try:
                check_shape(data, 10, 4, 10)
            except ValueError:
                pass
    msg = OK[7][0]
    for n in range(len(msg)):
        with pytest.raises(ValueError):
            check_shape(msg[:n], 100, 4, 100)
