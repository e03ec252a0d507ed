"""A bounded cache of values keyed by what the caller says they depend on.

Three caches of :mod:`kvcopy.nixl` use it: the planner's routes per set of peers (the
host and device modes, :mod:`kvcopy.nixl.modes`), and arena mode's request shapes and
layer pairings (:mod:`kvcopy.nixl.modes.arena`). The key is explicit: the caller builds it
from values (a peer's *key*, an int the manager gives each ``add_peer`` and never gives
again, the staging order, page counts), never from object identity. So a hit never
depends on the caller handing in the same objects, and an entry made for a peer can
never be served for another peer, or for the same name added again: that one has
another key.

Each entry is also tagged with the peer keys it was made for; :meth:`KeyedCache.forget`
drops a removed peer's entries at once, so nothing cached keeps its records (and
regions) alive. The least recently used entry goes first when the cache is full; a
``make`` that raises caches nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable, List, Tuple


class KeyedCache:
    """LRU of ``make()`` results per explicit hashable key, tagged with peer keys."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"cache size {size} must be at least 1")
        self.size = int(size)
        self._entries: "OrderedDict[Hashable, Tuple[frozenset, object]]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: Hashable, make: Callable[[], object], tags: Iterable[Hashable] = ()):
        """The value for ``key``, made by ``make()`` on a miss and tagged with ``tags``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[1]
        self.misses += 1
        value = make()
        while len(self._entries) >= self.size:
            self._entries.popitem(last=False)
        self._entries[key] = (frozenset(tags), value)
        return value

    def holds(self, tag: Hashable) -> int:
        """How many entries are tagged with ``tag``."""
        return sum(tag in tags for tags, _ in self._entries.values())

    def values(self) -> List[object]:
        return [v for _, v in self._entries.values()]

    def forget(self, tag: Hashable) -> None:
        """Drop every entry tagged with ``tag``."""
        for key in [k for k, (tags, _) in self._entries.items() if tag in tags]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
