"""Test hooks inside an engine's worker: a vLLM ``worker_extension_cls``.

    LLM(..., worker_extension_cls="kvcopy.testing.engine.hooks.KvcopyHooks")

vLLM mixes the class into its worker; :meth:`kvcopy.testing.engine.process.Engine.rpc`
calls a method on every worker (``LLM.collective_rpc``) and returns what each returned.
Only the tests load it: nothing in the connectors knows of it.
"""
from __future__ import annotations

from typing import Dict


def _connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError("this engine has no KV connector")
    return get_kv_transfer_group()


def _arena_manager():
    worker = getattr(_connector(), "arena_worker", None)
    if worker is None or worker.manager is None:
        raise RuntimeError("this engine's connector is not a registered KvcopyArenaConnector")
    return worker.manager


class KvcopyHooks:
    """Methods vLLM adds to its worker (see the module docstring)."""

    def kvcopy_arena_stats(self) -> Dict[str, int]:
        """The arena connector's ``TransferManager.stats()`` (pulls, spans, checksum outcomes)."""
        return dict(_arena_manager().stats())

    def kvcopy_layerwise_stats(self) -> Dict[str, int]:
        """P, ``layerwise``: unit copies queued by ``save_kv_layer``, made by the sweep,
        and requests with no span at their first step (kvcopy.vllm.arena.layerwise)."""
        stager = getattr(getattr(_connector(), "arena_worker", None), "stager", None)
        layers = getattr(stager, "layers", None)
        if layers is None:
            return {"at_layer": 0, "swept": 0, "no_span": 0}
        return {"at_layer": layers.at_layer, "swept": layers.swept, "no_span": layers.no_span}

    def kvcopy_staging_bytes(self) -> Dict[str, int]:
        """Host memory the connector stages KV through (pinned on a GPU): the arena's
        ``arena_bytes``, or vLLM's host buffers (none where NIXL reads the KV in place)."""
        conn = _connector()
        arena = getattr(conn, "arena_worker", None)
        if arena is not None and arena.manager is not None:  # the arena's allocation (stats() give its usable part)
            return {"bytes": int(arena.manager.arena.buffer.untyped_storage().nbytes()), "buffers": 1}
        buffers = getattr(getattr(conn, "connector_worker", None), "host_xfer_buffers", None) or {}
        return {"bytes": int(sum(t.untyped_storage().nbytes() for t in buffers.values())), "buffers": len(buffers)}

    def kvcopy_flip_staged_byte(self, offset: int = 5) -> int:
        """P: flip one bit of byte ``offset`` of every span staged now (as a faulty link or
        memory would, after P's pack computed its sums); returns how many spans."""
        arena = _arena_manager().arena
        spans = [entry.span for entry in arena._staged.values()]
        for span in spans:
            if offset >= span.nbytes:
                raise ValueError(f"offset {offset} is outside a {span.nbytes}-byte span")
            arena.buffer[span.offset + offset] ^= 0x10
        return len(spans)

    def kvcopy_mirror_copies(self) -> Dict[str, object]:
        """The mirror connector: whether its copier was built, and how many ``to_host`` /
        ``to_device`` calls it made since this hook first ran (it counts from then on)."""
        worker = getattr(_connector(), "connector_worker", None)
        copier = getattr(worker, "kvcopy_copier", None)
        if copier is None:
            return {"copier": False, "use_host_buffer": bool(getattr(worker, "use_host_buffer", False))}
        counts = getattr(copier, "_kvcopy_test_counts", None)
        if counts is None:
            counts = copier._kvcopy_test_counts = {"to_host": 0, "to_device": 0}
            for name in ("to_host", "to_device"):
                real = getattr(copier, name)

                def counted(*args, _real=real, _name=name, **kwargs):
                    counts[_name] += 1
                    return _real(*args, **kwargs)
                setattr(copier, name, counted)
        return {"copier": True, "use_host_buffer": bool(getattr(worker, "use_host_buffer", False)),
                "backend": copier.backend,
                **counts}
