"""The copy core: one masked copy of paged KV blocks, all layers and groups in one call.

:mod:`.layout` page geometry of each tensor view; :mod:`.storages` views grouped by the
memory they share; :mod:`.tables` the entry table a copy backend runs; :mod:`.planner`
block ids -> the packed call; :mod:`.copier` ``BlockCopier``; :mod:`.checksum` page sums;
:mod:`.copy_op` vLLM's ``CopyBlocksOp`` signature; :mod:`.options` the options every copying
surface shares. Imports no ``kvcopy.nixl``, ``kvcopy.vllm``, ``kvcopy.offload``, test tooling
or benchmark (tests/test_contracts.py).
"""
