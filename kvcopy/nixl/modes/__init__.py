"""Buffer modes: the memory a manager's transfers go through, and what each step of a
request does in it. :mod:`.base` the interface; :mod:`.paged` ``"host"`` (a pinned mirror)
and ``"device"``; :mod:`.arena` ``"arena"`` (one span of a pinned arena per request, with
:mod:`.spans` the span allocator, :mod:`.span_copiers` / :mod:`.span_sums` packing and
its page sums); :mod:`.mirror_sums` host mode's page sums; :mod:`.rows`,
:mod:`.keyed_cache` shared helpers."""
