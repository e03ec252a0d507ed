"""Toy engines and an independent expectation for NIXL transfer tests and examples.

Not used by the manager. It builds small KV caches with the shapes that broke vLLM's
NIXL path (hybrid models whose KV cache groups overlay one tensor, where copying every
layer at every group's blocks overwrote received KV with unfilled host pages; and P and
D with different tokens per block, where "the last N pages" selected the wrong ones),
fills and clones them preserving aliasing, computes
what D's caches must hold after a pull with a plain per-page loop written from the
token-position rule (not from :mod:`kvcopy.nixl.planning.plan`), and runs a prefill engine in
a child process driven over a pipe.

Cases (``build_case``):

* ``one_group``: three NHD layers ``[pages, 16, 2, 8]`` fp16, one group.
* ``hybrid`` (groups overlaid on one tensor): a full-attention group ``l0 l2 l4`` (32-token blocks) and a
  sliding-window group ``l1 l3 l5`` (16-token blocks), 16-token pages. ``l0``/``l1``
  are one tensor; ``l2``/``l3`` and ``l4``/``l5`` are KV-first ``[2, pages, 16, 2, 8]``
  bf16 views at two offsets of one uint8 pool; ``l6`` is a KV-sharing layer (the
  tensor of ``l2``, in no group) and ``l7`` a layer in no group with its own tensor.
* ``seeds3`` (pages selected by token position): two MLA layers ``[pages, 64, 32]`` bf16,
  64-token pages; P uses 128-token blocks (2 pages each), D 64-token blocks, so a P
  block's last page may be unused capacity that must not shift D's selection.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from ...core.layout import as_words, describe
from ...nixl.planning.plan import NO_BLOCK
from ..reference import reference_copy
from .oracle import (
    clone_caches, fill_random, replay,
)


@contextlib.contextmanager
def one_torch_thread():
    """Toy tensors are kilobytes: torch's intra-op threads only add barrier waits, which
    on a loaded 2-core machine (NIXL progress threads included) cost milliseconds per op."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class ToyEngine:
    """One side's KV caches and the arguments a TransferManager needs for them."""

    device_caches: Dict[str, torch.Tensor]
    layer_groups: List[List[str]]
    tokens_per_block: List[int]
    tokens_per_page: int
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def pages_per_block(self, g: int) -> int:
        return self.tokens_per_block[g] // self.tokens_per_page

    def manager(self, name: str, **overrides):
        from ...nixl.manager import TransferManager

        kw = dict(self.kwargs)
        kw.update(overrides)
        return TransferManager(name, self.device_caches, self.layer_groups, self.tokens_per_block,
                               self.tokens_per_page, **kw)


def build_case(case: str, num_pages: int, tokens_per_block: Optional[Sequence[int]] = None) -> ToyEngine:
    """A fresh engine of one of the cases above (contents uninitialized: fill them)."""
    if case == "one_group":
        caches = {f"a{i}": torch.empty(num_pages, 16, 2, 8, dtype=torch.float16) for i in range(3)}
        eng = ToyEngine(caches, [["a0", "a1", "a2"]], [16], 16)
    elif case == "hybrid":
        shared = torch.empty(num_pages, 16, 2, 8, dtype=torch.bfloat16)
        kv_first_bytes = 2 * num_pages * 16 * 2 * 8 * 2
        pool = torch.empty(2 * kv_first_bytes + 256, dtype=torch.uint8)
        view_a = pool[128 : 128 + kv_first_bytes].view(torch.bfloat16).view(2, num_pages, 16, 2, 8)
        view_b = pool[128 + kv_first_bytes : 128 + 2 * kv_first_bytes].view(torch.bfloat16).view(
            2, num_pages, 16, 2, 8)
        caches = {"l0": shared, "l1": shared, "l2": view_a, "l3": view_a, "l4": view_b, "l5": view_b,
                  "l6": view_a, "l7": torch.empty(num_pages, 16, 2, 8, dtype=torch.bfloat16)}
        eng = ToyEngine(caches, [["l0", "l2", "l4"], ["l1", "l3", "l5"]], [32, 16], 16)
    elif case == "seeds3":
        caches = {f"m{i}": torch.empty(num_pages, 64, 32, dtype=torch.bfloat16) for i in range(2)}
        eng = ToyEngine(caches, [["m0", "m1"]], [128], 64)
    else:
        raise ValueError(f"unknown case {case!r}")
    if tokens_per_block is not None:
        eng.tokens_per_block = list(tokens_per_block)
    return eng


class ManagerPairs:
    """P and D managers over fresh toy engines (P random, D poisoned), D already
    holding P as a peer; ``close`` closes every manager made. Names are unique per
    process, as NIXL agent names must be."""

    _serial = 0

    def __init__(self):
        self.made = []

    def make(self, case: str, num_pages: int, p_tpb=None, d_tpb=None, buffer: str = "host", seeds=(1, 2),
             **manager_kwargs):
        """-> (P manager, D manager, P's peer name on D, P engine, D engine)."""
        pe, de = build_case(case, num_pages, p_tpb), build_case(case, num_pages, d_tpb)
        fill_random(pe.device_caches, seeds[0])
        fill_random(de.device_caches, seeds[1])
        ManagerPairs._serial += 1
        p = pe.manager(f"P{ManagerPairs._serial}", buffer=buffer, **manager_kwargs)
        self.made.append(p)
        d = de.manager(f"D{ManagerPairs._serial}", buffer=buffer, **manager_kwargs)
        self.made.append(d)
        return p, d, d.add_peer(p.metadata()), pe, de

    def close(self) -> None:
        # Each P before its D. D's add_peer connects to P, and UCX's TCP transport then has
        # P connect back to D's listener in the background; a D closed first can leave that
        # connect refused and retried after the test, its "UCX ERROR ... Connection
        # refused" lines landing between pytest's dots.
        for m in self.made:
            m.close()
        self.made = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expected_pull(d_caches, d_engine: ToyEngine, d_block_ids, p_caches, p_engine: ToyEngine,
                  p_block_ids, num_tokens: int, num_cached_tokens: int = 0) -> Dict[str, torch.Tensor]:
    """D's caches after a correct pull and completion, page by page from the rule."""
    out = clone_caches(d_caches)
    p_group = {n: g for g, layers in enumerate(p_engine.layer_groups) for n in layers}
    tpp = d_engine.tokens_per_page
    for g, layers in enumerate(d_engine.layer_groups):
        d_r = d_engine.pages_per_block(g)
        for name in layers:
            pg = p_group[name]
            p_r = p_engine.pages_per_block(pg)
            bd = describe(out[name]).block_dim
            for k in range(len(d_block_ids[g]) * d_r):
                d_block = d_block_ids[g][k // d_r]
                if d_block == NO_BLOCK:
                    continue
                d_page = d_block * d_r + k % d_r
                start = k * tpp
                if start + tpp <= num_cached_tokens:
                    continue  # cached on D
                if start < num_tokens:
                    p_block = p_block_ids[pg][k // p_r]
                    reference_copy(p_caches[name], out[name], [p_block * p_r + k % p_r], [d_page], bd)
                elif start >= max(num_tokens, num_cached_tokens):
                    as_words(out[name]).index_fill_(bd, torch.tensor([d_page]), 0)
    return out


def allocate_blocks(rng: np.random.Generator, engine: ToyEngine, counts: Sequence[int], used: set,
                    num_pages: int) -> List[List[int]]:
    """Random logical blocks per group whose pages are disjoint from ``used`` (updated)."""
    out = []
    for g, count in enumerate(counts):
        r = engine.pages_per_block(g)
        taken = np.zeros(num_pages // r * r, dtype=bool)
        taken[[p for p in used if p < len(taken)]] = True
        free = np.flatnonzero(~taken.reshape(-1, r).any(axis=1))
        if len(free) < count:
            raise ValueError("toy engine out of pages")
        chosen = [int(b) for b in rng.choice(free, size=count, replace=False)]
        for b in chosen:
            used.update(b * r + j for j in range(r))
        out.append(chosen)
    return out


# ---------------------------------------------------------------- prefill child process
def _to_wire(caches: Dict[str, torch.Tensor]) -> Dict[str, tuple]:
    return {n: (as_words(t).contiguous().numpy(), str(t.dtype)) for n, t in caches.items()}


def from_wire(wire: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    """Caches sent by :func:`serve_prefill` (contiguous copies; aliasing not kept)."""
    return {n: torch.from_numpy(a).view(getattr(torch, d.replace("torch.", ""))) for n, (a, d) in wire.items()}


def serve_prefill(conn) -> None:
    """A prefill engine driven over a pipe: ("start", case, num_pages, tpb, seed, name),
    ("start_spec", fuzz spec, P ranks, names): one manager per P rank of a
    :class:`kvcopy.testing.nixl.geometries.Spec`, ("save", block_ids) on every manager,
    ("notifications", count), ("close",), ("exit",), ("push_arena", D's handshake, its
    generation, a reservation item, block_ids, num_tokens, request_id): stage and post a
    push WRITE, never polled (so never notified). Both starts take an optional last
    element: manager keyword arguments (``buffer="arena"``, ``arena_bytes``); then
    ("save_arena", block_ids, num_tokens, request_id) stages the request on every
    manager and answers their records' bytes, ("stats",) every manager's ``stats()``."""
    managers: list = []
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        cmd = msg[0]
        try:
            if cmd == "start":
                _, case, num_pages, tpb, seed, name, *kw = msg
                engine = build_case(case, num_pages, tpb)
                caches = engine.device_caches
                fill_random(caches, seed)
                managers = [engine.manager(name, **(kw[0] if kw else {}))]
                conn.send(("ok", managers[0].metadata(), _to_wire(caches)))
            elif cmd == "start_spec":
                from . import geometries
                from ...nixl.manager import TransferManager

                _, spec, ranks, names, *kw = msg
                logical = geometries.logical_kv(spec)
                for rank, name in zip(ranks, names):
                    caches = geometries.build_caches(spec, "p", rank, logical)
                    managers.append(TransferManager(name, caches, **geometries.manager_kwargs(spec, "p", rank),
                                                    **(kw[0] if kw else {})))
                conn.send(("ok", [m.metadata() for m in managers]))
            elif cmd == "save":
                for m in managers:
                    m.save(msg[1])
                conn.send(("ok",))
            elif cmd == "save_arena":
                _, block_ids, num_tokens, request_id = msg
                conn.send(("ok", [m.save(block_ids, num_tokens=num_tokens, request_id=request_id).to_bytes()
                                  for m in managers]))
            elif cmd in _QUERIES:
                conn.send(("ok", _QUERIES[cmd](managers, *msg[1:])))
            elif cmd == "notifications":
                if len(managers) == 1:
                    conn.send(("ok", collect_notifications(managers[0], msg[1])))
                else:
                    conn.send(("ok", [collect_notifications(m, msg[1]) for m in managers]))
            elif cmd == "close":
                for m in managers:
                    m.close()
                conn.send(("ok",))
            elif cmd == "exit":
                conn.send(("ok",))
                return
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
        except Exception as exc:  # report, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _push_unpolled(m, d_metadata, generation, item, block_ids, num_tokens, request_id) -> int:
    """Stage a request and post its push WRITE into D; D is never told (P's notifications
    are dropped: a WRITE that ends at once is otherwise reported from ``post``), as if P
    died right after posting."""
    m._mail.send = lambda *args: None
    target = m.add_target(d_metadata)
    token = m.push_writes.accept(target, generation, item)
    m.push_writes.post(token, m.save(block_ids, num_tokens=num_tokens, request_id=request_id))
    return os.getpid()


_QUERIES: Dict[str, Callable[..., Any]] = {"push_arena": lambda managers, *args: _push_unpolled(managers[0], *args),
                                           "stats": lambda managers: [m.stats() for m in managers]}


class PrefillProcess:
    """A :func:`serve_prefill` child (spawned) and the parent's end of its pipe."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve_prefill, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def call(self, *msg, timeout: float = 120.0):
        self.conn.send(msg)
        if not self.conn.poll(timeout):  # hang guard only
            raise TimeoutError(f"prefill process did not answer {msg[0]!r}")
        reply = self.conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"prefill process: {reply[1]}")
        return reply[1:]

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=30)
            except Exception:
                pass
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


def wait(manager, handle, timeout: float = 60.0) -> str:
    """Poll until DONE or ERR; ``timeout`` is a hang guard, not a measurement."""
    deadline = time.monotonic() + timeout
    while (state := manager.poll(handle)) == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{handle!r} still in flight after {timeout} s")
        time.sleep(0)
    return state


def collect_notifications(manager, count: int, timeout: float = 60.0) -> List[tuple]:
    """(peer, message) pairs until ``count`` arrived; ``timeout`` is a hang guard: fewer
    come back if it passes."""
    got: List[tuple] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        for peer, notes in manager.notifications().items():
            got.extend((peer, n) for n in notes)
        time.sleep(0.001)
    return got


def engine_info(engine: ToyEngine, name: str, buffer: str = "host"):
    """The handshake record of an engine without creating a NIXL agent (plan tests)."""
    from ...nixl.engine.info import EngineInfo
    from ...nixl.engine.regions import build_regions

    tpp = [engine.tokens_per_page] * len(engine.layer_groups)
    regions = build_regions(engine.device_caches, engine.layer_groups, tpp, buffer)
    return EngineInfo(name=name, buffer=buffer, mem_type=regions.mem_type, tp_rank=0, tp_size=1,
                      tokens_per_block=tuple(engine.tokens_per_block), tokens_per_page=tuple(tpp),
                      regions=tuple(regions.regions), agent_metadata=b"")


@dataclass
class PullOutcome:
    """One request pulled and completed, with the two independent expectations."""

    plan: object
    completion: object
    before: Dict[str, torch.Tensor]  # D's caches before the pull
    expected: Dict[str, torch.Tensor]  # from the token-position rule (expected_pull)
    replayed: Dict[str, torch.Tensor]  # the plan applied by the byte oracle


def pull_and_complete(
    d_manager, peer: str, d_engine: ToyEngine, d_block_ids, p_caches, p_engine: ToyEngine, p_block_ids,
    num_tokens: int, num_cached_tokens: int = 0, notify: bytes = b"", request_id=None,
) -> PullOutcome:
    """plan_pull -> pull -> poll -> complete on D, and both expectations of the result."""

    before = clone_caches(d_engine.device_caches)
    plan = d_manager.plan_pull(peer, p_block_ids, num_tokens, d_block_ids, num_cached_tokens, request_id=request_id)
    handle = d_manager.pull(plan, notify=notify)
    wait(d_manager, handle)
    completion = d_manager.complete(handle)
    expected = expected_pull(before, d_engine, d_block_ids, p_caches, p_engine, p_block_ids, num_tokens,
                             num_cached_tokens)
    replayed = clone_caches(before)
    replay(plan, replayed, p_caches)
    return PullOutcome(plan, completion, before, expected, replayed)


def pull_spec(d_manager, peers: Sequence[str], spec, d_caches: Dict[str, torch.Tensor],
              p_caches: Optional[Dict[str, Dict[str, torch.Tensor]]] = None, notify: bytes = b""):
    """One heterogeneous pull of a :class:`kvcopy.testing.nixl.geometries.Spec` with real NIXL: plan
    (several peers), pull, poll, complete on D. Returns (plan, completion, expected,
    replayed): the fuzzer's independent expectation of D's caches and, given P's
    caches by peer name, the byte oracle's replay of the plan."""
    from . import geometries

    before = clone_caches(d_caches)
    plan = d_manager.plan_pull(list(peers), spec.p.block_ids, spec.num_tokens, spec.d.block_ids,
                               spec.num_cached)
    handle = d_manager.pull(plan, notify=notify)
    wait(d_manager, handle)
    completion = d_manager.complete(handle)
    want, why = geometries.expected(spec, before, geometries.logical_kv(spec))
    assert want is not None, why
    replayed = None
    if p_caches is not None:
        replayed = clone_caches(before)
        replay(plan, replayed, p_caches)
    return plan, completion, want, replayed
