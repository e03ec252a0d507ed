"""kvcopy.nixl.wire.schema: untrusted JSON objects read field by field, every bad value a ValueError."""
import pytest

from kvcopy.checks import SHOWN
from kvcopy.nixl.wire.schema import Record, check_int, check_list, check_str, shown


def test_fields_read_with_their_types_and_ranges():
    r = Record({"pages": 12, "kind": "mla", "name": "model.layers.0", "ids": [1, 2, 3], "skip": None}, "region 3")
    assert r.integer("pages", 1, 100) == 12
    assert r.choice("kind", ("mla", "kv_first")) == "mla"
    assert r.name("name") == "model.layers.0"
    assert r.integers("ids", 1, 8, 0, 10) == [1, 2, 3]
    assert r.integer_or_none("skip", 0, 1) is None
    assert r.integer_or_none("absent", 0, 1) is None
    r.done()


@pytest.mark.parametrize("obj,read,match", [
    ({"n": True}, lambda r: r.integer("n", 0, 9), r"region 3, n: expected an integer, got True"),
    ({"n": 1.0}, lambda r: r.integer("n", 0, 9), "expected an integer, got 1.0"),
    ({"n": "1"}, lambda r: r.integer("n", 0, 9), "expected an integer, got '1'"),
    ({"n": 10}, lambda r: r.integer("n", 0, 9), r"10 out of range \[0, 9\]"),
    ({"n": -1}, lambda r: r.integer("n", 0, 9), r"-1 out of range"),
    ({}, lambda r: r.integer("n", 0, 9), "field 'n' is missing"),
    ({"n": None}, lambda r: r.integer("n", 0, 9), "field 'n' is null"),
    ({"k": "hnd"}, lambda r: r.choice("k", ("nhd",)), r"'hnd' is not one of \['nhd'\]"),
    ({"k": 1}, lambda r: r.choice("k", ("nhd",)), "is not one of"),
    ({"s": ""}, lambda r: r.name("s"), "is not a name"),
    ({"s": "a\0b"}, lambda r: r.name("s"), "is not a name"),
    ({"s": "x" * 300}, lambda r: r.name("s"), "is not a name"),
    ({"s": b"x"}, lambda r: r.name("s"), "expected a string"),
    ({"l": {"a": 1}}, lambda r: r.entries("l", 0, 4), "expected a list"),
    ({"l": [0] * 5}, lambda r: r.entries("l", 0, 4), "5 entries, expected 0 to 4"),
    ({"l": [1, False]}, lambda r: r.integers("l", 0, 4, 0, 9), r"l\[1\]: expected an integer, got False"),
    ({"n": 1, "extra": 2}, lambda r: (r.integer("n", 0, 9), r.done()), r"unknown field\(s\) \['extra'\]"),
])
def test_every_bad_value_is_a_value_error_naming_record_and_field(obj, read, match):
    with pytest.raises(ValueError, match=match):
        read(Record(obj, "region 3"))


@pytest.mark.parametrize("obj", [[1, 2], "x", 3, None])
def test_a_record_is_an_object(obj):
    with pytest.raises(ValueError, match="header: expected an object"):
        Record(obj, "header")


def test_helpers_and_shortened_values():
    assert check_int(5, 0, 5, "w") == 5
    assert check_list([1], 1, 1, "w") == [1]
    assert check_str("a", 1, "w") == "a"
    long = shown("y" * 10_000)
    assert len(long) <= SHOWN and long.endswith("...")
    with pytest.raises(ValueError, match=r"w: expected an integer, got 'yyy.*\.\.\.$"):
        check_int("y" * 10_000, 0, 1, "w")
