"""``kvcopy-bench nixl``: :mod:`.measure` the subcommand (a P/D pull over NIXL against one
bulk READ of the same bytes, its rows and its report); :mod:`.request` one request of a
scenario as the NIXL rows pull it (D's block ids, padded block lists, D's KV checked
against P's), shared with the two-host variant and ``bench/arena_plan_cost.py``."""
