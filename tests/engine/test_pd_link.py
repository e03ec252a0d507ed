"""P and D as real vLLM engines on two "hosts": two network namespaces joined by a veth
pair capped at 1 Gbit/s each way (:class:`kvcopy.bench.two_hosts.TwoHosts`), each
engine's NIXL agent on UCX's TCP transport over its own veth only, each side channel on
its veth address (:func:`kvcopy.testing.engine.pd.link_side_env`). There is no other
way between the two namespaces, so the KV can only cross the capped link.

The arena connector pulling (P stages after its forward, D READs, a sequential batch),
then pushing with a layer-wise P behind a concurrent dispatch (P and D given each prompt
at once under one id; D knows only P's engine id and side channel, at P's veth
address): D's greedy tokens equal a single engine's, every prompt token loaded from P
(none computed), every request's transfer checksum-checked on D, and the bytes that left
P's veth during the batch at least the prompts' KV bytes. One pair at a time, each
started for its test (about 1 minute each on 2 cores). The test process drives the
engines over pipes (:class:`kvcopy.testing.engine.process.Engine`), so it needs no
address in either namespace.

Needs root, ``ip`` and ``tc`` (skips with the reason otherwise, as tests/bench's
two-host tests do).
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcopy.bench import two_hosts
from kvcopy.testing.engine.models import kv_bytes_per_token, read_spec
from kvcopy.testing.engine.pd import (
    PROMPT_SOURCES, Pair, counter_delta, engine_config, kv_transfer_config, link_side_env, load_failures,
    random_prompts, run_pd,
)
from kvcopy.testing.engine.process import Engine
from kvcopy.testing.engine.serve import PrefillEngine

RATE = "1gbit"
MAX_LEN = 1024
NEW_TOKENS = 8
BLOCK = 32
P_ENGINE = "link-push-layerwise-P"  # known to the concurrent dispatch beforehand


@pytest.fixture(scope="module")
def net():
    why = two_hosts.unavailable()
    if why:
        pytest.skip(f"two hosts: {why}")
    with two_hosts.TwoHosts(rate=RATE) as n:
        yield n
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert n.ns["p"] not in left and n.ns["d"] not in left, left


def _start(net, engine_dir, name, p_kv, d_kv, path) -> Pair:
    """P in P's namespace, D in D's, each with its link environment; kills both if either fails."""
    engines = [Engine(f"{name}-{side.upper()}", engine_config(path, BLOCK, MAX_LEN, kv=kv),
                      os.path.join(engine_dir, f"{name}-{side.upper()}.log"), link_side_env(net, side),
                      prefix=net.exec_prefix(side))
               for side, kv in (("p", p_kv), ("d", d_kv))]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.kill()
        raise
    return Pair(*engines)


def _sent(net):
    return {side: net.sent_bytes(side) for side in ("p", "d")}


def _check_loaded(pair, prompts, outs, want, before_m, before_s):
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in want]
    assert [o["num_cached_tokens"] for o in outs] == [len(p) for p in prompts], load_failures(pair.d)
    compute, hit, external = (counter_delta(before_m, pair.d.metrics(), k) for k in PROMPT_SOURCES)
    assert (external, hit, compute) == (sum(map(len, prompts)), 0, 0)
    stats = pair.d.rpc("kvcopy_arena_stats")[0]
    assert stats["checksum_checked"] - before_s["checksum_checked"] == len(prompts), stats
    assert stats["checksum_failed"] == before_s["checksum_failed"], stats
    return stats


def _check_link(net, pair, before, prompts, path):
    """P's veth carried at least the prompts' KV (READ or WRITten: P's egress either way)."""
    after = _sent(net)
    kv = sum(map(len, prompts)) * kv_bytes_per_token(read_spec(path))
    p_sent, d_sent = after["p"] - before["p"], after["d"] - before["d"]
    assert p_sent >= kv, (p_sent, d_sent, kv, load_failures(pair.d), load_failures(pair.p))
    return p_sent, d_sent


def test_a_pull_over_the_link_is_token_identical_and_loaded(net, engine_dir, model, single):
    path = model("llama")
    prompts = random_prompts([129, 400, 900], seed=21)
    want = single("llama").generate(prompts, NEW_TOKENS)
    pair = _start(net, engine_dir, "link-pull", kv_transfer_config("arena"), kv_transfer_config("arena"), path)
    try:
        before_m, before_s, before_b = pair.d.metrics(), pair.d.rpc("kvcopy_arena_stats")[0], _sent(net)
        batch = run_pd(pair, prompts, NEW_TOKENS)
        _check_link(net, pair, before_b, prompts, path)
        _check_loaded(pair, prompts, batch.outputs, want, before_m, before_s)
    finally:
        pair.close()


def test_a_layerwise_push_over_the_link_is_token_identical_and_loaded(net, engine_dir, model, single):
    path = model("llama")
    prompts = random_prompts([65, 300, 900], seed=22)
    want = single("llama").generate(prompts, NEW_TOKENS)
    p_kv = dict(kv_transfer_config("arena", layerwise=True), engine_id=P_ENGINE)
    pair = _start(net, engine_dir, "link-push", p_kv, kv_transfer_config("arena", transfer_mode="push"), path)
    try:
        side = int(pair.p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert pair.p.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == net.address("p")
        d_params = PrefillEngine(P_ENGINE, net.address("p"), side).decode_params("x")
        ids = [3 * 10**6 + i for i in range(len(prompts))]
        before_m, before_s, before_b = pair.d.metrics(), pair.d.rpc("kvcopy_arena_stats")[0], _sent(net)
        with ThreadPoolExecutor(1) as pool:
            p_leg = pool.submit(pair.p.generate, prompts, 1, [{"do_remote_decode": True}] * len(prompts),
                                request_ids=ids)
            outs = pair.d.generate(prompts, NEW_TOKENS, [d_params] * len(prompts), request_ids=ids)
            p_leg.result()
        _check_link(net, pair, before_b, prompts, path)
        stats = _check_loaded(pair, prompts, outs, want, before_m, before_s)
        # WRITten by P (D reserved at P's veth address, P reached D's side channel at D's), none READ
        assert stats["push_landed"] - before_s["push_landed"] == len(prompts), stats
        assert stats["push_held_spans"] == 0 and stats["push_reserved"] == 0, stats
        lw = pair.p.rpc("kvcopy_layerwise_stats")[0]
        assert lw["at_layer"] > 0 and lw["swept"] == 0, lw
    finally:
        pair.close()
