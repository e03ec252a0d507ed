"""The shared wire frame: lengths, digest, optional HMAC, checked in order before any part is read."""
import pytest

from kvcopy.nixl.wire.framing import Framing, check_key

FRAME = Framing(b"KVCOPY-TEST\0", 2, ((1, 100), (0, 10)), "test payload", "test")
KEY = b"0123456789abcdef"


def test_parts_round_trip_with_and_without_a_key():
    assert FRAME.unframe(FRAME.frame((b"head", b"tail"))) == [b"head", b"tail"]
    assert FRAME.unframe(FRAME.frame((b"h", b""), KEY), KEY) == [b"h", b""]


@pytest.mark.parametrize("data, match", [
    (b"KVCOPY-TEST\0", "truncated before its header"),
    (b"NOT-A-FRAME-" + bytes(40), "bad magic"),
    (FRAME.frame((b"head", b"")).replace(b"\x02\x00\x00\x00", b"\x03\x00\x00\x00", 1), "version 3 is not supported"),
    (FRAME.frame((b"head", b""))[:-1], "truncated"),
    (FRAME.frame((b"head", b"")) + b"x", "extra bytes"),
    (FRAME.frame((b"x" * 101, b"")), r"declares parts of \[101, 0\] bytes"),
    (FRAME.frame((b"", b"")), "declares"),
    (FRAME.frame((b"h", b"t" * 11)), "declares"),
])
def test_refusals_say_what_is_wrong(data, match):
    with pytest.raises(ValueError, match=match):
        FRAME.unframe(data)


def test_digest_flags_and_keys():
    data = bytearray(FRAME.frame((b"head", b"")))
    data[-33] ^= 1  # the last byte of the parts
    with pytest.raises(ValueError, match="digest does not match"):
        FRAME.unframe(bytes(data))
    flags = bytearray(FRAME.frame((b"head", b"")))
    flags[16] |= 2
    with pytest.raises(ValueError, match="unknown bits"):
        FRAME.unframe(bytes(flags))
    keyed = FRAME.frame((b"head", b""), KEY)
    with pytest.raises(ValueError, match="this manager has none"):
        FRAME.unframe(keyed)
    with pytest.raises(ValueError, match="requires a shared key"):
        FRAME.unframe(FRAME.frame((b"head", b"")), KEY)
    with pytest.raises(ValueError, match="HMAC does not match"):
        FRAME.unframe(keyed, b"fedcba9876543210")
    with pytest.raises(TypeError, match="must be bytes"):
        FRAME.unframe("text")
    assert check_key(None) is None and check_key(bytearray(KEY)) == KEY
    with pytest.raises(ValueError, match="at least 16"):
        check_key(b"short")
