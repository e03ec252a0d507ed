"""ManagerOptions: every keyword option of a TransferManager checked once, by name."""
import pytest

from kvcopy.nixl.options import ManagerOptions


def test_defaults_and_overrides():
    base = ManagerOptions()
    assert base.arena_order == "token" and base.pull_timeout_s is None and base.tp_size == 1
    opts = ManagerOptions.make(ManagerOptions(tp_size=4, tp_rank=1), {"tp_rank": 3, "pull_timeout_s": 2})
    assert (opts.tp_rank, opts.tp_size, opts.pull_timeout_s) == (3, 4, 2.0)
    assert ManagerOptions.make(None, {}) == base
    assert "key" not in repr(ManagerOptions(key=b"0123456789abcdef"))  # a secret never printed


@pytest.mark.parametrize("kw, exc, match", [
    ({"no_such_option": 1}, TypeError, "unknown option"),
    ({"tp_rank": 2, "tp_size": 2}, ValueError, "tp_rank 2 out of range"),
    ({"tp_size": 1.5}, TypeError, "tp_size"),
    ({"tp_rank": True}, TypeError, "tp_rank"),
    ({"pull_timeout_s": 0}, ValueError, "pull_timeout_s"),
    ({"pull_timeout_s": "1"}, TypeError, "pull_timeout_s"),
    ({"arena_ttl_s": -1}, ValueError, "arena_ttl_s"),
    ({"arena_ttl_s": None}, TypeError, "arena_ttl_s"),
    ({"arena_bytes": 2.5}, TypeError, "arena_bytes"),
    ({"arena_order": "heads"}, ValueError, "arena_order"),
    ({"key": "a string key, long enough"}, TypeError, "key must be bytes"),
    ({"key": b"short"}, ValueError, "at least 16"),
    ({"progress_delay_us": -1}, ValueError, "progress_delay_us"),
    ({"nixl_thread_nice": -1}, ValueError, "nixl_thread_nice"),  # a higher priority than the engine's
    ({"nixl_thread_nice": 20}, ValueError, "nixl_thread_nice"),
    ({"nixl_thread_nice": True}, TypeError, "nixl_thread_nice"),
    # a span freed before any D could ask for it and read it
    ({"arena_ttl_s": 0}, ValueError, "arena_ttl_s"),
    ({"arena_ttl_s": 1e-9}, ValueError, "arena_ttl_s must be at least 0.5"),
    ({"arena_ttl_s": 0.49}, ValueError, "arena_ttl_s must be at least 0.5"),
    ({"require_checksum": 1}, TypeError, "require_checksum must be True or False"),
    ({"require_checksum": True, "checksum": False}, ValueError, "require_checksum needs checksum=True"),
    # the fields every copying surface shares (kvcopy.core.options), one rule each
    ({"checksum": 1}, TypeError, "checksum must be true or false"),
    ({"copy_backend": None}, TypeError, "copy_backend must be a backend name"),
    ({"max_ctas": 0}, ValueError, "max_ctas must be a positive integer"),
    ({"max_ctas": 2.0}, TypeError, "max_ctas must be a positive integer"),
])
def test_bad_options_raise_naming_them(kw, exc, match):
    with pytest.raises(exc, match=match):
        ManagerOptions.make(None, kw)


def test_options_must_be_options():
    with pytest.raises(TypeError, match="ManagerOptions"):
        ManagerOptions.make({"tp_rank": 0}, {})
    assert ManagerOptions(arena_ttl_s=0.5).arena_ttl_s == 0.5  # the floor itself is taken
