"""A bounded cache of values made for some objects, keyed by those objects' identity.

Two caches of :mod:`kvcopy.nixl` use it: the planner's routes (:mod:`kvcopy.nixl.plan`,
keyed by the local engine record, each peer's and their layer pairs) and arena mode's
request shapes and layer pairings (:mod:`kvcopy.nixl.staging`). Both key by
``EngineInfo`` records, which are frozen, so identity stands for content and a hit
costs a few ``id`` calls instead of comparing regions.

Entries hold those objects only weakly: an entry is served only while every object it
was made for is alive and is the same object (an ``id`` reused by a new object
misses), an entry goes as soon as one of its objects dies (a weakref callback),
:meth:`IdentityCache.forget` drops an object's entries at once (a removed peer), and
the least recently used entry goes first when the cache is full. A value that holds its objects strongly keeps them alive
until it leaves the cache: ``forget`` is what frees a removed peer then.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Sequence, Tuple


class IdentityCache:
    """LRU of ``make()`` results per (objects by identity, key)."""

    def __init__(self, size: int):
        self.size = int(size)
        self._entries: "OrderedDict[tuple, Tuple[tuple, object]]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, objects: Sequence[object], key: tuple, make: Callable[[], object]):
        """The value for ``objects`` and ``key``, made by ``make()`` on a miss (a ``make``
        that raises caches nothing)."""
        full = tuple(id(o) for o in objects) + key
        entry = self._entries.get(full)
        if entry is not None and len(entry[0]) == len(objects) and all(
                r() is o for r, o in zip(entry[0], objects)):
            self._entries.move_to_end(full)
            self.hits += 1
            return entry[1]
        self.misses += 1
        value = make()
        while len(self._entries) >= self.size:
            self._entries.popitem(last=False)
        drop = _dropper(weakref.ref(self), full)
        self._entries[full] = (tuple(weakref.ref(o, drop) for o in objects), value)
        return value

    def holds(self, obj: object) -> int:
        """How many entries were made for ``obj``."""
        return sum(any(r() is obj for r in refs) for refs, _ in self._entries.values())

    def values(self):
        return [v for _, v in self._entries.values()]

    def forget(self, obj: object) -> None:
        """Drop every entry made for ``obj``."""
        for key in [k for k, (refs, _) in self._entries.items() if any(r() is obj for r in refs)]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _dropper(cache_ref, key: tuple):
    """The weakref callback of one entry: the entry goes when any of its objects dies
    (unless the key now holds a newer entry, made for other objects)."""
    def drop(ref):
        cache = cache_ref()
        entry = None if cache is None else cache._entries.get(key)
        if entry is not None and any(r is ref for r in entry[0]):
            del cache._entries[key]
    return drop
