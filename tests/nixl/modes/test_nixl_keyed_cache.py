"""KeyedCache: LRU by explicit keys, entries tagged with peer keys and dropped on forget."""
import pytest

from kvcopy.nixl.modes.keyed_cache import KeyedCache


def test_bounded_least_recently_used_and_keyed_by_value():
    cache = KeyedCache(size=2)
    made = []

    def get(peer, key=("k", 3)):
        return cache.get((peer,) + key, lambda: made.append(peer) or object(), tags=(peer,))

    first = get(1)
    assert get(1) is first and (cache.hits, cache.misses) == (1, 1)
    get(1, ("k", 4))  # another key: a miss
    get(1)  # refreshes the first entry
    get(2)  # evicts the ("k", 4) entry, the least recently used
    assert len(cache) == 2 and made == [1, 1, 2]
    get(1, ("k", 4))
    assert made == [1, 1, 2, 1]  # it was gone; adding it evicted (1, "k", 3)
    assert (cache.holds(1), cache.holds(2), cache.holds(3)) == (1, 1, 0)
    cache.forget(1)
    assert len(cache) == 1 and cache.holds(1) == 0 and cache.values() == [cache.get((2, "k", 3), object)]
    # keys are values: an equal key built from other objects is a hit
    assert get(2, ("k", 3)) is get(2, tuple(["k", 3]))


def test_forget_drops_every_entry_of_a_peer_and_a_failed_make_caches_nothing():
    cache = KeyedCache(size=8)
    cache.get(("pair", 1, 2), lambda: "both", tags=(1, 2))
    cache.get(("one", 1), lambda: "one", tags=(1,))
    cache.get(("two", 2), lambda: "two", tags=(2,))
    cache.forget(2)
    assert cache.values() == ["one"]
    with pytest.raises(ValueError):
        cache.get(("x",), lambda: (_ for _ in ()).throw(ValueError("no")))
    assert len(cache) == 1 and cache.misses == 4
    with pytest.raises(ValueError, match="at least 1"):
        KeyedCache(0)
