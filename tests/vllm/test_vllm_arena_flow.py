"""Flow control of the arena connector with P and D in two processes: vLLM 0.33's real
schedulers, the connector's workers with real NIXL over UCX on loopback, P in a spawned
child driven as vLLM's engine core drives an engine (stepped only while its scheduler
has requests; otherwise idle, blocked on its pipe: tests/vllm/vllm_arena_engines.py,
``serve_commands``), D in this process.

* D's fetches never hold one another up behind P's back-pressure: a request P staged
  is read while four others P cannot stage yet wait, and none is lost.
* Every request D will not read is given up, and P frees its span (or never stages it)
  at once, idle or not, long before its TTL (60 s here).
* An idle P still frees what D is done with, and what outlived its TTL.

The hang guards below (10 s) are not measurements: without the behaviour tested the
span stays until P's TTL, or P's next step, which never comes for an idle P.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("kvcopy.vllm", reason="vLLM 0.33 not installed (run in the vLLM env)", exc_type=ImportError)

import torch  # noqa: E402
from test_vllm_mirror import CASES, vllm_env  # noqa: E402  (the model families, the fixture)
from test_vllm_arena import _failed_load, engines  # noqa: E402  (a load that must fail)
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_arena_engines import (  # noqa: E402
    assert_same, decode, expected_d, fill, prefill, prefill_child, prompts,
)

assert vllm_env and engines  # fixtures, used by name

CASE = "one_group"  # 4 layers of 2 KiB pages (16 tokens): a 200-token prompt is a 104 KiB span
BIG = 200
P_OPTS = {"num_blocks": 128, "arena_bytes": 128 << 10,  # P's arena holds one 200-token span at a time
          "stage_timeout_s": 15.0, "arena_ttl_s": 60.0}
GUARD_S = 10.0  # hang guards only (see the module docstring)


class Child:
    """The P process and its pipe (commands: tests/vllm/vllm_arena_engines.py, ``serve_commands``)."""

    def __init__(self, proc, pipe):
        self.proc, self.pipe = proc, pipe

    def call(self, cmd, args=None, limit_s=120.0):
        self.pipe.send((cmd, args))
        assert self.pipe.poll(limit_s), f"P did not answer {cmd!r}"
        return self.pipe.recv()

    def state(self) -> dict:
        return self.call("stats")

    def wait(self, what, until, limit_s=GUARD_S) -> dict:
        end = time.monotonic() + limit_s
        while not until(st := self.state()):
            assert time.monotonic() < end, f"P did not get there ({what}): {st}"
            time.sleep(0.02)
        return st


@pytest.fixture(scope="module")
def p_child(vllm_env, tmp_path_factory):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_child, args=(child, vllm_env.model, str(tmp_path_factory.mktemp("p")), CASE,
                                                   "PF", 41, P_OPTS), daemon=True)
    proc.start()
    try:
        assert parent.poll(300) and parent.recv() == "ready", "the P process did not start"
        yield Child(proc, parent)
    finally:
        if proc.is_alive():
            parent.send(("stop", None))
            proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(30)


def _clean(st) -> bool:
    return not st["staged"] and not st["pending"] and not st["requests"]


def _shadow(p_child, engines, rids):
    """An engine of P's own config in this process holding P's buffer and block tables,
    for the expectation (expected_d reads both)."""
    raw, tables = p_child.call("snapshot", rids)
    shadow = engines(CASES[CASE], "kv_producer", num_blocks=P_OPTS["num_blocks"])
    shadow.raw.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    shadow.tables.update(tables)
    return shadow


def test_a_reordered_arrival_completes_with_no_request_lost(p_child, engines):
    """P's arena holds one request: P stages X, and Y1..Y4 wait for its space. D gets
    Y1..Y4 first, then X. D must read X while the four wait (P then stages Y1, D reads
    it, and so on). Before, D's four fetch threads each held a Y while P answered
    ``pending``, X's fetch queued behind them, and P's stage timeout failed all four."""
    rids = ["ro-x", "ro-y1", "ro-y2", "ro-y3", "ro-y4"]
    tokens = prompts(5, [BIG] * 5, seed=42)
    params = dict(zip(rids, p_child.call("prefill", (rids, tokens))))
    st = p_child.state()
    assert st["staged"] == ["ro-x"] and st["pending"] == rids[1:], st
    d = engines(CASES[CASE], "kv_consumer", num_blocks=P_OPTS["num_blocks"])
    d.raw.fill_(0x5A)
    before = d.raw_bytes()
    order = [1, 2, 3, 4, 0]  # the Ys first
    assert decode(d, [], [rids[i] for i in order], [tokens[i] for i in order], [params[rids[i]] for i in order]) \
        == set()
    shadow = _shadow(p_child, engines, rids)
    assert_same(d, expected_d(shadow, d, [(r, r, BIG) for r in rids], before))
    p_child.wait("every span freed", _clean)


def _give_up_case(cause, p_child, engines):
    """D's engine for one cause of refusal, and its kvcopy options."""
    if cause == "larger than D's arena":
        return engines(CASES[CASE], "kv_consumer", num_blocks=P_OPTS["num_blocks"], arena_bytes=40 << 10)
    assert cause == "P's handshake refused (other layers)"
    return engines(CASES["hybrid_kv_sharing"], "kv_consumer", num_blocks=P_OPTS["num_blocks"])


@pytest.mark.parametrize("cause", ["larger than D's arena", "P's handshake refused (other layers)"])
def test_a_request_d_refuses_is_given_up_and_an_idle_p_frees_its_span(p_child, engines, cause):
    """D refuses the request (its arena is too small for it; P's handshake does not pair
    with D's layers, so D cannot reach P over NIXL and gives up over P's side channel):
    the load takes vLLM's error path, and P, idle, frees the span. Before, P kept it for
    its TTL, and meanwhile staged nothing else into that space."""
    rid = f"gu-{cause[:5]}"
    (tok,) = prompts(1, [BIG], seed=43)
    (params,) = p_child.call("prefill", ([rid], [tok]))
    assert p_child.state()["staged"] == [rid]
    d = _give_up_case(cause, p_child, engines)
    fill_d(d)
    _failed_load(d, rid, tok, params)
    st = p_child.wait("the span freed", _clean)
    assert st["gave_up"] >= 1


def fill_d(d):
    d.raw.fill_(0x5A)


def test_a_request_given_up_while_p_waits_for_space_is_never_staged(p_child, engines):
    """P stages H and G waits for its space; D's fetch of G times out (P keeps answering
    ``pending``) and D gives G up: P drops G without staging it (its blocks go back to
    P's pool), and H is still read exactly. Before, P staged G once H was freed and kept
    it for its TTL."""
    (tok_h, tok_g) = prompts(2, [BIG, BIG], seed=44)
    params_h, params_g = p_child.call("prefill", (["wait-h", "wait-g"], [tok_h, tok_g]))
    st = p_child.state()
    assert st["staged"] == ["wait-h"] and st["pending"] == ["wait-g"], st
    d = engines(CASES[CASE], "kv_consumer", num_blocks=P_OPTS["num_blocks"], fetch_timeout_s=1.0)
    fill_d(d)
    _failed_load(d, "wait-g", tok_g, params_g)
    st = p_child.wait("G dropped", lambda s: not s["pending"] and "wait-g" not in s["requests"])
    assert st["staged"] == ["wait-h"] and st["gave_up"] >= 1
    before = d.raw_bytes()
    assert decode(d, [], ["wait-h"], [tok_h], [params_h]) == set()
    shadow = _shadow(p_child, engines, ["wait-h"])
    assert_same(d, expected_d(shadow, d, [("wait-h", "wait-h", BIG)], before))
    p_child.wait("every span freed", _clean)


def test_an_idle_p_frees_a_span_d_has_read(p_child, engines):
    """P is idle once its prefill is staged; D reads the request; P frees the span on
    D's notification without a step. Before, the notification waited for P's next step."""
    (tok,) = prompts(1, [BIG], seed=45)
    (params,) = p_child.call("prefill", (["idle-r"], [tok]))
    d = engines(CASES[CASE], "kv_consumer", num_blocks=P_OPTS["num_blocks"])
    fill_d(d)
    assert decode(d, [], ["idle-r"], [tok], [params]) == set()
    p_child.wait("the span freed", _clean)


def test_a_request_d_aborts_before_scheduling_frees_ps_span_with_both_idle(p_child, engines):
    """D's request is aborted before it was scheduled; D steps as vLLM's engine core
    would (while its scheduler has requests, which now includes requests to hand the
    workers) and then idles; P is idle throughout. P's span goes at once. Before, D did
    not step again after the abort, so P kept the span for its TTL."""
    (tok,) = prompts(1, [BIG], seed=46)
    (params,) = p_child.call("prefill", (["abort-r"], [tok]))
    d = engines(CASES[CASE], "kv_consumer", num_blocks=P_OPTS["num_blocks"])
    d.add("abort-r", tok, params, max_tokens=2)
    d.sched.finish_requests("abort-r", RequestStatus.FINISHED_ABORTED)
    steps = 0
    while d.sched.has_requests():
        d.step()
        steps += 1
        assert steps < 100
    p_child.wait("the span freed", _clean)


def test_an_idle_p_frees_expired_spans(engines):
    """A P that is not stepped frees a span at its TTL (the housekeeping thread; the
    shortest TTL the connector takes, 2 s). Before, expiry ran only inside a step."""
    p = engines(CASES[CASE], "kv_producer", arena_ttl_s=2.0)
    d = engines(CASES[CASE], "kv_consumer")
    fill(p, d, 47)
    prefill(p, ["old"], prompts(1, [40], seed=47))
    assert p.staged() == ["old"]
    with p.worker.arena_worker.lock:
        expiry = p.manager.arena._staged[b"old"].deadline  # when its TTL ends (monotonic)
    while p.staged():  # P is not stepped from here on
        assert time.monotonic() < expiry + GUARD_S, "the span outlived its TTL on an idle P"
        time.sleep(0.02)
    assert time.monotonic() >= expiry  # freed by its TTL, not by anything else
