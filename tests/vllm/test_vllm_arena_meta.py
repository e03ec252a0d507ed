"""kvcopy.vllm.arena.meta: the arena connector's options, notifications and worker reports (vLLM env)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

from vllm.config import KVTransferConfig  # noqa: E402


def test_options_are_checked(monkeypatch):
    from kvcopy.vllm.config import ARENA_SURFACE, PREFIX, from_transfer_config

    def opts(**kw):
        return from_transfer_config(KVTransferConfig(kv_connector="KvcopyArenaConnector", kv_role="kv_both",
                                                     kv_connector_extra_config={"kvcopy": kw}), ARENA_SURFACE)
    assert opts(arena_bytes=1 << 20, pull_timeout_s=2).manager.pull_timeout_s == 2
    assert opts().manager.pull_timeout_s == 30  # the arena's default; a TransferManager's is None
    for bad, match in [({"arena_bytes": 0}, "arena_bytes"), ({"arena_bytes": True}, "arena_bytes"),
                       ({"pull_timeout_s": float("nan")}, "pull_timeout_s"),
                       ({"pull_timeout_s": None}, "pull_timeout_s"), ({"arena_ttl_s": "60"}, "arena_ttl_s"),
                       ({"arena_order": "row"}, "arena_order"), ({"arena_size": 1}, "unknown key"),
                       ({"key_env": ""}, "key_env"), ({"checksum": "yes"}, "checksum"), ({"checksum": 1}, "checksum"),
                       ({"require_checksum": 1}, "require_checksum"),
                       ({"require_checksum": True, "checksum": False}, "needs checksum"),
                       # a span freed before it could be served (0 and 1e-9 were taken)
                       ({"arena_ttl_s": 0}, "arena_ttl_s"), ({"arena_ttl_s": 1e-9}, "at least 0.5"),
                       ({"arena_ttl_s": 0.5}, "at least 2"),
                       ({"arena_ttl_s": 1.9}, "at least 2"), ({"max_ctas": 0}, "max_ctas"),
                       ({"copy_backend": 1}, "copy_backend"), ({"key": "00" * 16}, "unknown key"),
                       ({"tp_rank": 1}, "unknown key"), ({"stage_timeout_s": 0}, "stage_timeout_s")]:
        with pytest.raises(ValueError, match=match) as raised:
            opts(**bad)
        assert str(raised.value).startswith(PREFIX), raised.value
    monkeypatch.delenv("KVCOPY_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="KVCOPY_TEST_KEY.*not set"):
        opts(key_env="KVCOPY_TEST_KEY")
    monkeypatch.setenv("KVCOPY_TEST_KEY", "ab" * 16)
    assert opts(key_env="KVCOPY_TEST_KEY").manager.key == b"\xab" * 16  # read once, by the parser
    monkeypatch.setenv("KVCOPY_TEST_KEY", "ab" * 8)
    with pytest.raises(ValueError, match="at least 16"):
        opts(key_env="KVCOPY_TEST_KEY")
    monkeypatch.setenv("KVCOPY_TEST_KEY", "not hex")
    with pytest.raises(ValueError, match="in hex"):
        opts(key_env="KVCOPY_TEST_KEY")
    assert opts().manager.checksum is True and opts(checksum=False).manager.checksum is False
    assert opts().manager.require_checksum is False and opts(require_checksum=True).manager.require_checksum is True
    assert opts(arena_ttl_s=2).manager.arena_ttl_s == 2


def test_nixl_thread_nice_reaches_the_manager_and_is_bounded():
    from kvcopy.vllm.config import ARENA_SURFACE, from_transfer_config

    def opts(**kw):
        return from_transfer_config(KVTransferConfig(kv_connector="KvcopyArenaConnector", kv_role="kv_both",
                                                     kv_connector_extra_config={"kvcopy": kw}), ARENA_SURFACE)
    assert opts().manager.nixl_thread_nice == 0 and opts(nixl_thread_nice=19).manager.nixl_thread_nice == 19
    for bad in (-1, 20, True, "5", 1.0):  # the parser names the key in a ValueError
        with pytest.raises(ValueError, match="nixl_thread_nice"):
            opts(nixl_thread_nice=bad)


def test_push_chunk_bytes_is_parsed_and_bounded():
    from kvcopy.vllm.config import ARENA_SURFACE, PREFIX, PUSH_CHUNK_BYTES, from_transfer_config

    def opts(**kw):
        return from_transfer_config(KVTransferConfig(kv_connector="KvcopyArenaConnector", kv_role="kv_both",
                                                     kv_connector_extra_config={"kvcopy": kw}), ARENA_SURFACE)
    assert opts().push_chunk_bytes == PUSH_CHUNK_BYTES == 1 << 20
    assert opts(push_chunk_bytes=0).push_chunk_bytes == 0  # every run of copied units its own chunk
    assert opts(push_chunk_bytes=4096).push_chunk_bytes == 4096
    # bounded by the arena_bytes set, not the default's 1 GiB
    assert opts(arena_bytes=4 << 30, push_chunk_bytes=2 << 30).push_chunk_bytes == 2 << 30
    assert opts(arena_bytes=1 << 20, push_chunk_bytes=1 << 20).push_chunk_bytes == 1 << 20
    assert opts(arena_bytes=1 << 16).push_chunk_bytes == 1 << 20  # the default: no chunk in so small an arena
    for bad, match in [({"push_chunk_bytes": -1}, "0 or more"), ({"push_chunk_bytes": True}, "0 or more"),
                       ({"push_chunk_bytes": 1.5}, "0 or more"), ({"push_chunk_bytes": 1048576.0}, "0 or more"),
                       ({"push_chunk_bytes": "1MiB"}, "0 or more"), ({"push_chunk_bytes": None}, "0 or more"),
                       ({"arena_bytes": 1 << 20, "push_chunk_bytes": (1 << 20) + 1}, r"at most arena_bytes \(1048576"),
                       ({"push_chunk_bytes": (1 << 30) + 1}, r"at most arena_bytes \(1073741824: no span is larger")]:
        with pytest.raises(ValueError, match=r"push_chunk_bytes must be .*" + match) as raised:
            opts(**bad)
        assert str(raised.value).startswith(PREFIX), raised.value


def _mirror_options(extra):
    from kvcopy.vllm.config import MIRROR_SURFACE, from_transfer_config

    return from_transfer_config(KVTransferConfig(kv_connector="KvcopyNixlConnector", kv_role="kv_both",
                                                 kv_connector_extra_config=extra), MIRROR_SURFACE)


def test_the_mirror_connector_refuses_checksum_true():
    """The mirror connector's bytes go by vLLM's own transfers, with no sums to compare:
    checksum=true is refused, not ignored; false (or absent) is what it does."""
    from kvcopy.vllm.config import MirrorOptions

    assert _mirror_options({}) == MirrorOptions() == _mirror_options({"kvcopy": {"checksum": False}})
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['kvcopy'\]\.checksum=true"
                                         r".*KvcopyArenaConnector"):
        _mirror_options({"kvcopy": {"checksum": True}})
    with pytest.raises(ValueError, match="checksum must be true or false"):
        _mirror_options({"kvcopy": {"checksum": "on"}})


def test_the_mirror_connector_refuses_unknown_keys():
    """As the arena and offloading connectors do (it ignored them before 42)."""
    with pytest.raises(ValueError,
                       match=r"unknown key\(s\) \['host_buffer'\]; known: \['checksum', 'copy_backend', "
                             r"'host_buffer_on_cpu', 'max_ctas'\]"):
        _mirror_options({"kvcopy": {"host_buffer": True}})
    with pytest.raises(ValueError, match="must be an object"):
        _mirror_options({"kvcopy": ["host_buffer_on_cpu"]})


def test_reader_notifications_are_parsed_strictly():
    from kvcopy.vllm.arena.meta import GAVE_UP, READ, notify_bytes, parse_notify

    assert parse_notify(notify_bytes("req-1", 4)) == ("req-1", 4, READ)
    assert parse_notify(notify_bytes("req-1", 2, GAVE_UP)) == ("req-1", 2, GAVE_UP)
    for bad in [b"req-1", b"kvcopy-arena\0req", b"kvcopy-arena\0req\0x\0r", b"kvcopy-arena\0req\x000\0r",
                b"kvcopy-arena\0req\x0099999\0r", b"kvcopy-arena\0\xff\xfe\x001\0r", b"kvcopy-arena\0\x001\0r",
                b"kvcopy-arena\0req\x001", b"kvcopy-arena\0req\x001\0x", b"kvcopy-arena\0a\0b\x001\0r", "str"]:
        assert parse_notify(bad) is None, bad
    with pytest.raises(ValueError, match="NUL"):
        notify_bytes("a\0b", 2)


def test_worker_reports_merge_over_tp_ranks():
    from kvcopy.vllm.arena.meta import KvcopyArenaWorkerMeta

    a = KvcopyArenaWorkerMeta(staged={"r": {0: b"x"}}, released={"q": {0}})
    b = KvcopyArenaWorkerMeta(staged={"r": {1: b"y"}}, failed={"s": {1: "full"}}, released={"q": {1}})
    m = a.aggregate(b)
    assert m.staged == {"r": {0: b"x", 1: b"y"}} and m.failed == {"s": {1: "full"}} and m.released == {"q": {0, 1}}
    assert not KvcopyArenaWorkerMeta() and m


def test_the_mirror_connector_takes_host_buffer_on_cpu_as_a_flag():
    assert _mirror_options({}).host_buffer_on_cpu is False
    mirror = _mirror_options({"kvcopy": {"copy_backend": "cpu", "max_ctas": 4}})
    assert (mirror.copy_backend, mirror.max_ctas) == ("cpu", 4)
    with pytest.raises(ValueError, match="max_ctas must be a positive integer"):
        _mirror_options({"kvcopy": {"max_ctas": 0}})
    assert _mirror_options({"kvcopy": {"host_buffer_on_cpu": True}}).host_buffer_on_cpu is True
    with pytest.raises(ValueError, match="host_buffer_on_cpu must be true or false"):
        _mirror_options({"kvcopy": {"host_buffer_on_cpu": "yes"}})


def test_split_pages_and_the_conv_layout_join_the_compatibility_hash():
    """vLLM's CPU attention keeps a page's K rows before its V rows: engines of different
    page sizes, or of different Mamba conv-state layouts, must not match (D refuses P's
    handshake and recomputes); the page sizes are readable at the front of the value."""
    from types import SimpleNamespace

    from kvcopy.vllm.arena.connector import split_page_tokens
    from kvcopy.vllm.arena.meta import compatibility_hash

    # what the two functions read of a VllmConfig
    cfg = SimpleNamespace(model_config=SimpleNamespace(model="tiny", dtype="float32"),
                          cache_config=SimpleNamespace(cache_dtype="auto"),
                          compilation_config=SimpleNamespace(static_forward_context={}))
    plain = compatibility_hash(cfg)
    p32, p64 = compatibility_hash(cfg, (32,)), compatibility_hash(cfg, (64,))
    assert len({plain, p32, p64, compatibility_hash(cfg, None, "DS"), compatibility_hash(cfg, None, "SD")}) == 5
    assert p32.startswith("kvcopy-arena:kv-split-pages-32:") and plain.startswith("kvcopy-arena:") and \
        "split" not in plain
    layout = SimpleNamespace(groups=(("l0", "l1"),), tokens_per_page=(32,))

    def backend(name):
        return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name))
    ctx = cfg.compilation_config.static_forward_context
    assert split_page_tokens(cfg, layout) is None  # no attention layers known: nothing to refuse
    ctx.update({"l0": backend("FLASH_ATTN"), "l1": backend("FLASH_ATTN")})
    assert split_page_tokens(cfg, layout) is None
    ctx["l1"] = backend("CPU_ATTN")
    assert split_page_tokens(cfg, layout) == (32,)
