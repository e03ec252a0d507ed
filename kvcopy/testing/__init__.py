"""kvcopy's test tooling: references, case matrices, fuzzers and byte oracles.

Not part of the library: nothing under ``kvcopy/`` outside this package imports it
(``tests/test_contracts.py`` checks), except the benchmark CLI (``kvcopy.bench``),
which checks the copies it times against the reference. Shipped with the package so
the tests, ``kvcopy-bench`` and ``python -m kvcopy.testing...`` can reach it.

* :mod:`.reference`: the torch reference every copy is checked against
  (``reference_copy``, ``reference_copy_groups``, ``reference_offload_job``).
* :mod:`.vllm_offload`: vLLM 0.33's own CPU offloading worker run on CPU tensors, the
  reference of :mod:`kvcopy.vllm.offload` (imports vLLM; not imported here).
* :mod:`.cases`: the shared case matrix and the bit-exact check every backend is held
  to (``CopyCase``, ``check_copy``, ``standard_cases``); its names are re-exported here.
* :mod:`.nixl`: toy engines, the byte oracle (``replay``) and the fuzzers of the NIXL
  transfer manager (``python -m kvcopy.testing.nixl.fuzz``,
  ``python -m kvcopy.testing.nixl.handshake_fuzz``; ``kvcopy-bench fuzz`` is the first).
"""
from .cases import (
    CONVERTING, CROSS_LAYERS, DTYPES, LAYOUTS, POISON_BYTE, VIEWS, CopyCase, PreparedCheck, bytes_equal, check_copy,
    page_pairing, physical_shape, prepare_check, shaped, standard_cases, storage_bytes,
)

__all__ = [
    "CONVERTING",
    "CROSS_LAYERS",
    "CopyCase",
    "DTYPES",
    "LAYOUTS",
    "POISON_BYTE",
    "PreparedCheck",
    "VIEWS",
    "bytes_equal",
    "check_copy",
    "page_pairing",
    "physical_shape",
    "prepare_check",
    "shaped",
    "standard_cases",
    "storage_bytes",
]
