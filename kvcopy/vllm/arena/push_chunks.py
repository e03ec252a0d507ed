"""P's chunked push: a layer-wise request's units WRITten while its last step's forward runs.

Imported through :mod:`kvcopy.vllm`, which checks the vLLM version first.

When a layer-wise P (:mod:`kvcopy.vllm.arena.layerwise`) runs the last step of a request
whose reservation it has accepted (D reserved before P's prefill ended: concurrent
dispatch), each unit is final once its copy of that step ended. :class:`ChunkPoster`:

* :meth:`~ChunkPoster.begin` (``bind_connector_metadata``, under the worker's lock): the
  requests whose prefill ends this step, with their partial stages;
* :meth:`~ChunkPoster.copied` (the copy thread, after a ``save_kv_layer``'s copies; it
  takes the worker's lock for the post, which the engine thread never holds across the
  forward): marks the units copied and WRITEs, per reservation, each run of copied
  units not sent yet (contiguous in span order) holding at least :attr:`min_bytes`
  (the connector's ``push_chunk_bytes``; ``TransferManager.push_writes.post_units``; D is
  told ``c`` when it ended), never the *tail*: the unit(s) the forward's last attention layer completes;
* :meth:`~ChunkPoster.accepted`: a reservation accepted while its request's last step
  runs sends the units copied so far at once;
* the final WRITE (the units left: the tail, the state units the sweep copies, and the
  record slot) is :class:`~kvcopy.vllm.arena.push_send.PushSender`'s, as for a
  whole-request push, posted from the copy thread right after the last layer's copy
  when that copy left nothing for the sweep (the record made there:
  :meth:`~kvcopy.vllm.arena.layerwise.LayerwiseStage.finish_early`), else at
  ``wait_for_save``; ``f`` follows once every WRITE of the reservation ended. The tail
  rides in it rather than in a chunk of its own: after the prefill end there is then one
  WRITE (and one notice to D) instead of two. Measured against the tail in a chunk of
  its own (``tail_in_final`` False; ``bench/push_chunks_serve.py``, the 2-core machine
  shared, three runs of 5 requests per placement of D, ``--layer-ms 8``): 0.91-1.21x
  (medians), within the noise there: D then scatters the tail at ``f`` instead of on
  its ``c`` while P posts the record, and the record's WRITE right after the tail's
  ``c`` ends a flush round trip to D after its post.

A reservation accepted after the request's last step began its copies gets the units
copied so far in one chunk and the rest in the final WRITE; one accepted after staging
ended is one WRITE (for equal geometry one descriptor), as before. P failing after some
chunks were sent (a copy failed: the request is staged again whole) answers ``x``: D
recomputes.

Why ``push_chunk_bytes`` is 1 MiB by default: one WRITE between two arenas over UCX on
loopback has a fixed cost of 13-22 µs (a 4 KiB WRITE), 13% of a 1 MiB WRITE (166 µs) and over 25% below
256 KiB (``bench/push_chunks.py``, the 2-core machine shared; ``docs/vllm.md``, "Layer-wise
push in chunks"); and on loopback the WRITE copies inside the post, on the copy thread,
delaying the next layer's copy by as much. A chunk before the last overlaps the forward, so its size only
costs that overhead; the tail after prefill end is the last layer's copy and the WRITE
of what is left.
"""
from __future__ import annotations

import time
from typing import Dict, List, Tuple

import numpy as np
from vllm.logger import init_logger

from ...nixl.manager import TransferManager
from ...nixl.modes.partial_stage import PartialStage
from ...nixl.modes.push_units import runs, unit_bounds
from ...nixl.planning.pack_order import Unit, natural_key
from ..config import PUSH_CHUNK_BYTES

logger = init_logger("vllm.kvcopy")


class ChunkPoster:
    """One P rank's chunked pushes (module docstring). Every method runs under the
    worker's lock."""

    min_bytes = PUSH_CHUNK_BYTES  # least bytes per chunk WRITE: the connector sets push_chunk_bytes
    tail_in_final = True  # False: the tail goes in a chunk of its own (the benchmark's comparison)

    def __init__(self, manager: TransferManager):
        self.m = manager
        # rid -> (stage, unit bounds, units copied, units no chunk carries: the tail)
        self.parts: Dict[str, Tuple[PartialStage, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.tokens: Dict[bytes, str] = {}  # reservations chunked -> request
        self.posted = 0  # chunk WRITEs posted
        self.events: List[Tuple[float, float, str, int, int, int]] = []  # (before, after, rid, lo, hi, bytes)

    def begin(self, rid: str, part: PartialStage, tokens: List[bytes]) -> None:
        """``rid``'s last step is planned; ``tokens``: its reservations accepted, not posted."""
        units = self.m.arena.units if self.m.arena is not None else []
        bounds = unit_bounds(units, part.counts)
        chunkable = ~tail_mask(units) if self.tail_in_final else np.ones(len(units), bool)
        self.parts[rid] = (part, bounds, np.zeros(len(bounds) - 1, bool), chunkable)
        for t in tokens:
            self.tokens[t] = rid

    def accepted(self, token: bytes, rid: str) -> None:
        """A reservation accepted now: chunked if its request's last step runs."""
        if rid in self.parts:
            self.tokens[token] = rid
            self._post(rid)

    def copied(self, rid: str, units: List[int]) -> None:
        """The copy thread ended ``units``' copies of ``rid``'s last step."""
        entry = self.parts.get(rid)
        if entry is None:
            return
        entry[2][units] = True
        self._post(rid)

    def _post(self, rid: str) -> None:
        part, bounds, copied, chunkable = self.parts[rid]
        for token in [t for t, r in self.tokens.items() if r == rid]:
            for lo, hi in runs(copied & chunkable & ~self._sent(token, len(copied))):
                if bounds[hi] - bounds[lo] < self.min_bytes:
                    continue
                t0 = time.monotonic()
                try:
                    nbytes, _ = self.m.push_writes.post_units(token, part, lo, hi, staged_as=rid)
                except ValueError as exc:  # answered (x) or failed: the final post says so
                    logger.warning("kvcopy arena: pushing units [%d, %d) of %s failed: %s", lo, hi, rid, exc)
                    del self.tokens[token]
                    break
                self.posted += 1
                self.events.append((t0, time.monotonic(), rid, lo, hi, nbytes))

    def _sent(self, token: bytes, n: int) -> np.ndarray:
        sent = self.m.push_writes.sent_units(token)
        return sent if sent is not None else np.zeros(n, bool)

    def staged(self, rid: str) -> None:
        """``rid``'s record is made (the copy thread's
        :meth:`~kvcopy.vllm.arena.layerwise.LayerwiseStage.finish_early`): its partial
        stage is finished, so no chunk more; a reservation accepted from now on is one
        final WRITE, as after staging."""
        self.parts.pop(rid, None)
        self.tokens = {t: r for t, r in self.tokens.items() if r != rid}

    def end_step(self) -> None:
        """The step's copies ended and its records are made: what no chunk sent goes in
        each reservation's final WRITE."""
        self.parts, self.tokens = {}, {}


def tail_mask(units: List[Unit]) -> np.ndarray:
    """The units whose last layer is the forward's last attention layer (natural order of
    vLLM's layer names; state units never get a ``save_kv_layer``)."""
    last = [max(u.layers, key=natural_key) if not u.state else None for u in units]
    names = [n for n in last if n is not None]
    if not names:
        return np.zeros(len(units), bool)
    end = max(names, key=natural_key)
    return np.asarray([n == end for n in last], bool)

