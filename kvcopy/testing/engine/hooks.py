"""Test hooks inside an engine's worker: a vLLM ``worker_extension_cls``.

    LLM(..., worker_extension_cls="kvcopy.testing.engine.hooks.KvcopyHooks")

vLLM mixes the class into its worker; :meth:`kvcopy.testing.engine.process.Engine.rpc`
calls a method on every worker (``LLM.collective_rpc``) and returns what each returned.
Only the tests load it: nothing in the connectors knows of it.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any, Dict, List


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


TIMELINE_KEPT = 512  # steps (P) and requests (D) the timeline keeps, oldest dropped


class _Timeline:
    """``time.monotonic()`` events of one worker's arena connector (one clock for every
    process of the host, so P's and D's events compare): P's steps and D's pulls."""

    def __init__(self, conn) -> None:
        self.steps: "deque[Dict[str, Any]]" = deque(maxlen=TIMELINE_KEPT)  # P: one per step with a save
        self.pulls: "deque[Dict[str, Any]]" = deque(maxlen=TIMELINE_KEPT)  # D: one per request pulled
        self.pushes: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()  # P: per reservation token (hex)
        self._landing: Dict[bytes, float] = {}  # D: token -> when D saw every f (reservations.complete called)
        self._chunks_seen: Dict[bytes, List[List[Any]]] = {}  # D: token -> [lo, hi, when D read P's c]
        self._tokens: Dict[str, bytes] = {}  # D: request -> its reservation's token, while _finish runs
        self._step: Dict[str, Any] = {}
        self._started: Dict[str, float] = {}  # D: P's request id -> when D's puller took it
        worker = conn.arena_worker
        if worker is None or worker.stager is None or worker.puller is None:
            raise RuntimeError("this engine's connector is not a registered KvcopyArenaConnector")
        self._puller = worker.puller
        self._house = worker.housekeeper  # its turns, whole and hurried (a stuck hurry: ~1,000 a second)
        self._turns_seen = self._house_turns()
        self._wrap(conn, "bind_connector_metadata", self._bind)
        self._wrap(conn, "save_kv_layer", self._layer)
        self._wrap(conn, "wait_for_save", None, self._saved)
        layers = worker.stager.layers
        if layers is not None:
            arena = worker.manager.arena
            units = arena.span_copiers(arena.order).units
            self._unit_layers = [sorted(u.layers) for u in units]
            self._wrap(layers, "_copy", self._copy_start, self._copy_end)
            # a final request's units handed to the chunked push, from inside _copy: its copies' end
            self._wrap(layers, "_copied", self._copy_handed, self._copy_handed_end)
        self._wrap(worker.puller, "start", self._pull_start)
        self._wrap(worker.puller, "_finish", self._pull_end, self._pulled)
        self._wrap(worker.manager.reservations, "complete", self._land)  # D: once P's f (or x) is in from every rank
        self._reservations = worker.manager.reservations
        self._chunks_counted = self._reservations.chunks_landed
        self._wrap(self._reservations, "_chunk", None, self._chunk_seen)  # D: P's c (a chunk WRITE ended) taken
        if worker.sender is not None:  # P: a reservation taken from the listener, its WRITE, its end
            push = worker.manager.push_writes
            self._wrap(worker.sender, "_reservation", self._took)
            self._wrap(push, "post", None, self._posted)
            self._wrap(push, "post_units", None, self._chunk_posted)  # a layer-wise push's chunk WRITE
            real = push.take_closed

            def take_closed():
                out = real()
                t = time.monotonic()
                for token, _rid, _target in out:
                    self._push(token)["closed"] = t
                return out
            push.take_closed = take_closed

    @staticmethod
    def _wrap(obj, name: str, before=None, after=None) -> None:
        real = getattr(obj, name)

        def wrapped(*args, **kwargs):
            t0 = time.monotonic()
            if before is not None:
                before(t0, *args, **kwargs)
            out = real(*args, **kwargs)
            if after is not None:
                after(t0, time.monotonic(), *args, **kwargs)
            return out
        setattr(obj, name, wrapped)

    # P: the step's forward (bind .. wait_for_save), its layers and copies
    def _bind(self, t: float, meta, *_args) -> None:
        self._step = {"bind": t, "layers": [], "copies": [], "final": sorted(getattr(meta, "stage", {}) or {})}

    def _layer(self, t: float, name: str, *_args, **_kwargs) -> None:
        self._step.setdefault("layers", []).append((name, t))

    def _copy_start(self, t: float, units: List[int], steps) -> None:
        self._step.setdefault("copies", []).append({"units": list(units), "start": t,
                                                    "requests": [rid for rid, _ in steps]})

    def _copy_end(self, t0: float, t1: float, units: List[int], steps) -> None:
        for c in reversed(self._step.get("copies", [])):
            if c["start"] == t0:
                c["end"] = t1
                break

    def _copy_handed(self, t: float, rid: str, _units) -> None:
        """``_copy`` hands ``rid``'s units on (a chunked push's post, the early record and
        its final WRITE) once they are copied: that request's copies ended here, before
        the posts that ``_copy``'s own end would include."""
        for c in reversed(self._step.get("copies", [])):
            if "end" not in c:
                c.setdefault("handed", {})[rid] = t
                break

    def _copy_handed_end(self, t0: float, t1: float, rid: str, _units) -> None:
        """The hand-on of ``rid`` returned: the next request's copies in that call start
        no earlier (its interval must not hold this one's posts)."""
        for c in reversed(self._step.get("copies", [])):
            if "end" not in c:
                c.setdefault("handed_end", {})[rid] = t1
                break

    def _saved(self, t0: float, t1: float) -> None:
        if self._step.get("final") or self._step.get("copies"):
            self.steps.append(dict(self._step, fwd_end=t0, saved=t1))
        self._step = {}

    # D: a request taken for pulling, and its KV in D's cache
    def _pull_start(self, t: float, recv) -> None:
        for r in recv.values():
            self._started[r.remote_request_id] = t

    def _pull_end(self, t: float, job) -> None:
        res = getattr(self._puller, "reserved", {}).get(job.rid)  # a push: its token joins P's events
        if res is not None:
            self._tokens[job.rid] = res.token

    def _pulled(self, t0: float, t1: float, job) -> None:
        rid = job.recv.remote_request_id
        token = self._tokens.pop(job.rid, None)
        self.pulls.append({"p_request": rid, "taken": self._started.pop(rid, None), "posted": job.posted[0],
                           "post_done": job.posted[1], "kv_ready": t0,
                           "token": None if token is None else token.hex(),
                           "landing": None if token is None else self._landing.pop(token, None),
                           "chunks": None if token is None else self._chunks_seen.pop(token, None)})

    def _land(self, t: float, token: bytes) -> None:
        self._landing[token] = t
        while len(self._landing) > TIMELINE_KEPT:  # tokens answered x and never pulled here
            self._landing.pop(next(iter(self._landing)))

    def _chunk_seen(self, t0: float, _t1: float, sender: str, token: bytes, lo: int, hi: int) -> None:
        landed = self._reservations.chunks_landed
        if landed == self._chunks_counted:  # D ignored it (late, unknown sender, job over)
            return
        self._chunks_counted = landed
        seen = self._chunks_seen.setdefault(token, [])
        if len(seen) < TIMELINE_KEPT:
            seen.append([lo, hi, t0, sender])
        while len(self._chunks_seen) > TIMELINE_KEPT:  # tokens of requests never pulled here
            self._chunks_seen.pop(next(iter(self._chunks_seen)))

    # P: reservations (push)
    def _push(self, token: bytes) -> Dict[str, Any]:
        key = token.hex()
        if key not in self.pushes:
            self.pushes[key] = {}
            while len(self.pushes) > TIMELINE_KEPT:
                self.pushes.popitem(last=False)
        return self.pushes[key]

    def _took(self, t: float, d, item) -> None:
        push = self._push(item[0])
        if "took" not in push:  # a second copy (the listener's resend, D asking again) is dropped by the worker
            push.update(took=t, named=item[1])

    def _posted(self, t0: float, t1: float, token: bytes, *_args, **_kwargs) -> None:
        self._push(token).update(post=t0, post_done=t1)

    def _chunk_posted(self, t0: float, t1: float, token: bytes, _part, lo: int, hi: int, *_args, **_kwargs) -> None:
        self._push(token).setdefault("chunks", []).append([lo, hi, t0, t1])

    def _house_turns(self) -> int:
        house = self._house
        return 0 if house is None else house.turns + house.quick_turns

    def take(self) -> Dict[str, Any]:
        turns = self._house_turns()
        out = {"steps": list(self.steps), "pulls": list(self.pulls), "pushes": dict(self.pushes),
               "unit_layers": getattr(self, "_unit_layers", None), "turns": turns - self._turns_seen}
        self._turns_seen = turns
        self.steps.clear()
        self.pulls.clear()
        self.pushes.clear()
        return out


class KvcopyHooks:
    """Methods vLLM adds to its worker (see the module docstring)."""

    def kvcopy_timeline(self) -> Dict[str, Any]:
        """The arena connector's event times since the last call (the first call starts
        recording and returns nothing): P's steps (``bind``, each ``save_kv_layer``, each
        layer-wise unit copy's start and end, ``fwd_end``: ``wait_for_save`` entered,
        ``saved``: it returned, ``final``: the requests whose prefill ended), D's pulls
        (by P's request id: ``taken`` by the puller, READ ``posted``, ``kv_ready``: the
        READ and scatter completed; a push: ``posted`` is when D sent its RESERVE,
        ``landing`` when P's ``f`` was in from every P rank, ``token`` the reservation's,
        ``chunks`` ``[lo, hi, t, sender]`` per chunk ``c`` D took: units ``[lo, hi)`` of
        that P rank landed),
        P's pushes by reservation token (``took``: P's worker took the reservation from
        its listener, ``post``/``post_done``: its WRITE posted, ``closed``: the WRITE ended
        and D was notified, ``chunks``: ``[lo, hi, post, post_done]`` per chunk WRITE of
        a layer-wise push), and ``turns``: the worker's housekeeping turns. For
        ``bench/serve_pd.py``."""
        timeline = getattr(self, "_kvcopy_timeline", None)
        if timeline is None:
            self._kvcopy_timeline = _Timeline(_connector())
            return {"steps": [], "pulls": [], "pushes": {}, "unit_layers": None, "turns": 0}
        return timeline.take()

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
                "backend": copier.copy_backend,
                **counts}
