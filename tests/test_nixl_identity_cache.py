"""IdentityCache: LRU by object identity, entries gone with their objects or on forget."""
import gc

import pytest

from kvcopy.nixl.handshake import EngineInfo
from kvcopy.nixl.identity_cache import IdentityCache


def engine(name: str) -> EngineInfo:
    return EngineInfo(name, "arena", "DRAM", 0, 1, (16,), (16,), (), b"")


def test_bounded_least_recently_used_and_keyed_by_identity():
    infos = [engine(f"e{i}") for i in range(4)]
    cache = IdentityCache(size=2)
    made = []

    def get(peer, key=("k", 3)):
        return cache.get((infos[0], peer), key, lambda: made.append(peer.name) or object())

    first = get(infos[1])
    assert get(infos[1]) is first and (cache.hits, cache.misses) == (1, 1)
    get(infos[1], ("k", 4))  # another key: a miss
    get(infos[1])  # refreshes the first entry
    get(infos[2])  # evicts the ("k", 4) entry, the least recently used
    assert len(cache) == 2 and made == ["e1", "e1", "e2"]
    get(infos[1], ("k", 4))
    assert made == ["e1", "e1", "e2", "e1"]  # it was gone; adding it evicted ("k", 3) of e1
    assert (cache.holds(infos[0]), cache.holds(infos[1]), cache.holds(infos[2])) == (2, 1, 1)
    cache.forget(infos[1])
    assert len(cache) == 1 and cache.holds(infos[1]) == 0
    # an equal record that is another object is not served (keys are identities)
    get(infos[1])
    twin = engine("e1")
    assert twin == infos[1] and get(twin) is not get(infos[1])
    assert made[-1] == "e1" and len(cache) == 2


def test_an_entry_goes_with_its_objects_and_a_failed_make_caches_nothing():
    keep, gone = engine("keep"), engine("gone")
    cache = IdentityCache(size=8)
    cache.get((keep, gone), (), lambda: "value")
    cache.get((keep,), (), lambda: "other")
    assert len(cache) == 2
    del gone
    gc.collect()
    assert len(cache) == 1 and cache.values() == ["other"]  # at once, not at the next miss
    with pytest.raises(ValueError):
        cache.get((keep,), ("x",), lambda: (_ for _ in ()).throw(ValueError("no")))
    assert len(cache) == 1 and cache.misses == 3
