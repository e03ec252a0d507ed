"""The process on each side of :mod:`kvcopy.bench.two_hosts`: commands over a pipe.

    python -m kvcopy.bench.two_hosts_server FD    # FD: this end of the parent's socketpair

Each message is a tuple ``(command, *arguments)``; each reply ``("ok", value)`` or
``("error", "Type: message")`` (the server keeps serving). Commands:

``engine(layers, groups, num_blocks, block_size, heads, head_dim, seed)``
    a toy KV cache: ``layers`` bf16 NHD tensors ``[num_blocks, block_size, heads,
    head_dim]`` (one storage each), layer ``l`` in group ``l % groups``, random bytes
    from ``seed``.
``manager(name, kwargs)`` -> handshake bytes; ``add_peer(m, metadata)`` -> peer name;
``remove_peer(m, peer)``; ``close_manager(m)``; ``stats(m)``; ``notifications(m)``
    :class:`~kvcopy.nixl.TransferManager` calls on manager ``m``.
``save(m, block_ids)`` (host mode), ``stage(m, block_ids, num_tokens, request_id,
readers)`` -> the arena record's bytes
    P's side of a request.
``post(key, m, peer, remote, num_tokens, local_ids, notify, timeout_s, hold=False)`` -> the time posted
    D's ``plan_pull`` (``remote``: P's block ids, or P's record bytes in arena mode,
    decoded and checked by ``StagedRequest.from_bytes``) and ``pull``. The pull is then
    polled between commands, every millisecond, and completed as soon as it ends, as
    a decode engine would (``hold``: not completed until ``complete(key)``).
``wait(keys, guard_s)`` -> ``{key: record}``
    polls until those pulls ended; a record has ``state``, ``error``, ``t_post``,
    ``t_end`` (``time.monotonic()``, one clock for every process of the machine),
    ``ok``, ``failed_block_ids``, ``written_pages``, ``written_in`` (a held pull: the
    first four and ``held``; ``complete(key)`` then returns the whole record).
``caches()`` -> ``{layer: uint8 array}``: the KV's bytes.
``call(function, *args)`` -> ``function(server, *args)`` (a module-level function the
parent names; the benchmark's per-side set-up and timing).

Times are ``time.monotonic()``: CLOCK_MONOTONIC, shared by the processes of one machine
whatever their network namespace, so the parent compares them with its own.
"""
from __future__ import annotations

import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Dict

import numpy as np
import torch

if TYPE_CHECKING:
    from ..nixl import TransferManager

_POLL_S = 0.001  # how often pulls in flight are polled while no command arrives


class Server:
    """State of one side: its KV, its managers, the pulls it watches."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.caches: Dict[str, torch.Tensor] = {}
        self.layer_groups: list = []
        self.block_size = 0
        self.managers: Dict[str, "TransferManager"] = {}
        self.watched: Dict[object, dict] = {}
        self.ended: Dict[object, dict] = {}
        self.scratch: Dict[str, object] = {}  # what call()ed functions keep between calls

    # ------------------------------------------------------------ the loop
    def serve(self) -> None:
        while True:
            if self.watched:
                self._poll_watched()
                if not self.conn.poll(_POLL_S):
                    continue
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if msg[0] == "exit":
                self.conn.send(("ok", None))
                return
            handler = getattr(self, "cmd_" + str(msg[0]), None)
            if handler is None:
                self.conn.send(("error", f"unknown command {msg[0]!r}"))
                continue
            try:
                reply = ("ok", handler(*msg[1:]))
            except Exception as exc:  # report, keep serving
                reply = ("error", f"{type(exc).__name__}: {exc}")
            self.conn.send(reply)

    def _poll_watched(self) -> None:
        for key, rec in list(self.watched.items()):
            state = rec["_m"].poll(rec["_h"])
            if state == "PROC":
                continue
            rec.update(t_end=time.monotonic(), state=state, error=rec["_h"].error)
            self.ended[key] = self.watched.pop(key)
            if not rec["_hold"]:
                self._complete(rec)

    @staticmethod
    def _complete(rec: dict) -> dict:
        m, h = rec.pop("_m"), rec.pop("_h")
        rec.pop("_hold")
        done = m.complete(h)
        rec.update(ok=done.ok, failed_block_ids=done.failed_block_ids, written_pages=done.written_pages,
                   written_in=done.written_in)
        return rec

    # ------------------------------------------------------------ the KV
    def cmd_engine(self, layers: int, groups: int, num_blocks: int, block_size: int, heads: int,
                   head_dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        nbytes = num_blocks * block_size * heads * head_dim * 2
        self.caches = {
            f"layer.{i}": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            .view(torch.bfloat16).view(num_blocks, block_size, heads, head_dim)
            for i in range(layers)}
        self.layer_groups = [[f"layer.{i}" for i in range(layers) if i % groups == g] for g in range(groups)]
        self.block_size = block_size

    def cmd_caches(self) -> Dict[str, np.ndarray]:
        return {n: t.view(torch.uint8).numpy().copy() for n, t in self.caches.items()}

    # ------------------------------------------------------------ managers
    def cmd_manager(self, name: str, kwargs: dict) -> bytes:
        from ..nixl import TransferManager

        if name in self.managers:
            raise ValueError(f"manager {name!r} exists")
        m = TransferManager(name, self.caches, self.layer_groups, self.block_size, **kwargs)
        self.managers[name] = m
        return m.metadata()

    def cmd_add_peer(self, m: str, metadata: bytes) -> str:
        return self.managers[m].add_peer(metadata)

    def cmd_remove_peer(self, m: str, peer: str) -> None:
        self.managers[m].remove_peer(peer)

    def cmd_close_manager(self, m: str) -> None:
        self.managers.pop(m).close()

    def cmd_stats(self, m: str) -> dict:
        return self.managers[m].stats()

    def cmd_notifications(self, m: str) -> dict:
        return self.managers[m].notifications()

    # ------------------------------------------------------------ requests
    def cmd_save(self, m: str, block_ids) -> None:
        self.managers[m].save(block_ids)

    def cmd_stage(self, m: str, block_ids, num_tokens: int, request_id: str, readers: int = 1) -> bytes:
        rec = self.managers[m].save(block_ids, num_tokens=num_tokens, request_id=request_id, readers=readers)
        return rec.to_bytes()

    def cmd_post(self, key, m: str, peer: str, remote, num_tokens: int, local_ids, notify: bytes = b"",
                 timeout_s=None, hold: bool = False) -> float:
        from ..nixl import StagedRequest

        if key in self.watched or key in self.ended:
            raise ValueError(f"pull {key!r} exists")
        mgr = self.managers[m]
        request_id = None
        if isinstance(remote, (bytes, bytearray)):
            remote = StagedRequest.from_bytes(bytes(remote))
            request_id = remote.request_id  # the bench's own record, as its P staged it
        plan = mgr.plan_pull(peer, remote, num_tokens, local_ids, request_id=request_id)
        t_post = time.monotonic()
        h = mgr.pull(plan, notify=notify, timeout_s=timeout_s)
        self.watched[key] = {"_m": mgr, "_h": h, "_hold": hold, "t_post": t_post, "state": "PROC"}
        self._poll_watched()
        return t_post

    def cmd_wait(self, keys, guard_s: float = 120.0) -> Dict[object, dict]:
        end = time.monotonic() + guard_s
        while any(k in self.watched for k in keys):
            if time.monotonic() > end:
                raise TimeoutError(f"pulls {[k for k in keys if k in self.watched]} still in flight "
                                   f"after {guard_s} s")
            self._poll_watched()
            time.sleep(_POLL_S)
        out = {}
        for k in keys:
            rec = self.ended[k]
            if "_h" in rec:  # held: stays for complete(key)
                out[k] = {f: v for f, v in rec.items() if not f.startswith("_")} | {"held": True}
            else:
                out[k] = self.ended.pop(k)
        return out

    def cmd_complete(self, key) -> dict:
        """Complete a pull posted with ``hold=True`` that has ended (a decode engine that
        completes at its next step, not at once)."""
        rec = self.ended.get(key)
        if rec is None or "_h" not in rec:
            raise ValueError(f"pull {key!r} has not ended, or was not held")
        return self._complete(self.ended.pop(key))

    def cmd_call(self, function, *args):
        return function(self, *args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)  # two processes per test on a shared machine: no intra-op pools
    server = Server(Connection(int(argv[0])))
    try:
        server.serve()
    finally:
        for m in list(server.managers.values()):
            try:
                m.close()
            except Exception:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
