"""Test tooling of the NIXL transfer manager (:mod:`kvcopy.nixl`); never imported by it.

* :mod:`.engines`: toy engines with the shapes that broke real deployments, an
  independent expectation of D's caches after a pull, a prefill engine in a child
  process.
* :mod:`.oracle`: the byte oracle: a plan's descriptors (``replay``) or READ rows
  (``replay_rows``) applied to CPU tensors without NIXL.
* :mod:`.fuzz`: random P/D geometries checked against the oracle
  (``python -m kvcopy.testing.nixl.fuzz``, also ``kvcopy-bench fuzz``).
* :mod:`.handshake_fuzz`: mutated handshake bytes, each refused with a
  ``ValueError`` (``python -m kvcopy.testing.nixl.handshake_fuzz``).
* :mod:`.stopped_peer`: a prefill engine stopped mid-READ over TCP, and the late-READ
  cases run on it.
* :mod:`.hostile`: hostile inputs to a manager: every edit of a plan handed out,
  mutations of a staged-request record.
"""
