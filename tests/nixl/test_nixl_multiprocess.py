"""P and D in two processes: P is a spawned child driven over a pipe (metadata, block
ids and its KV bytes travel over the pipe; KV moves only through NIXL)."""
import itertools

import numpy as np

from kvcopy.nixl import NO_BLOCK
from kvcopy.testing.nixl.engines import build_case, expected_pull, from_wire, pull_and_complete, wait
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes

NP = 64
_names = itertools.count()


def start(prefill, case, p_tpb=None, d_tpb=None):
    """P started in the child; D built here, poisoned, holding P as a peer."""
    n = next(_names)
    metadata, wire = prefill.call("start", case, NP, p_tpb, 100 + n, f"Pmp{n}")
    p_engine = build_case(case, NP, p_tpb)  # P's geometry, for the expectation
    d_engine = build_case(case, NP, d_tpb)
    fill_random(d_engine.device_caches, 200 + n)
    d = d_engine.manager(f"Dmp{n}")
    return d, d.add_peer(metadata), from_wire(wire), p_engine, d_engine


def test_hybrid_with_prefix_hit_across_processes_and_p_is_notified(prefill):
    d, peer, p_caches, pe, de = start(prefill, "hybrid")
    try:
        reqs = [  # (P ids, D ids, tokens, D's cached tokens)
            ([[1, 2, 3], [NO_BLOCK, NO_BLOCK, 10, 11, 12, 13]],
             [[20, 21, 22], [NO_BLOCK, NO_BLOCK, 4, 5, 6, 7]], 90, 32),
            ([[8, 9], [30, 31, 32]], [[14, 15], [50, 51, 52]], 40, 0),
        ]
        prefill.call("save", [reqs[0][0][g] + reqs[1][0][g] for g in range(2)])
        first = pull_and_complete(d, peer, de, reqs[0][1], p_caches, pe, reqs[0][0], 90, 32, notify=b"req-0")
        assert first.completion.ok
        assert same_bytes(de.device_caches, first.expected), first_difference(de.device_caches, first.expected)
        assert same_bytes(first.expected, first.replayed)
        second = pull_and_complete(d, peer, de, reqs[1][1], p_caches, pe, reqs[1][0], 40, notify=b"req-1")
        assert second.completion.ok and not same_bytes(second.before, second.expected)
        assert same_bytes(de.device_caches, second.expected), first_difference(de.device_caches, second.expected)
        (got,) = prefill.call("notifications", 2)
        assert sorted(got) == [(d.name, b"req-0"), (d.name, b"req-1")]
    finally:
        d.close()


def test_seeds3_geometry_across_processes(prefill):
    d, peer, p_caches, pe, de = start(prefill, "seeds3", p_tpb=[128], d_tpb=[64])
    try:
        prefill.call("save", [[5, 9]])
        out = pull_and_complete(d, peer, de, [[20, 21, 22]], p_caches, pe, [[5, 9]], 160, notify=b"s3")
        assert out.plan.pairs[0].remote_pages == (10, 11, 18)
        assert out.completion.ok and not same_bytes(out.before, out.expected)
        assert same_bytes(de.device_caches, out.expected), first_difference(de.device_caches, out.expected)
    finally:
        d.close()


def test_prefill_process_exits_mid_flight(prefill):
    """Pulls posted before P's process exits end DONE (exact) or ERR (untouched);
    pulls posted after it exited fail; no handle is left behind."""
    d, peer, p_caches, pe, de = start(prefill, "one_group")
    try:
        rng = np.random.default_rng(9)
        p_ids = [[[int(x)] for x in row] for row in rng.permutation(NP)[:12].reshape(6, 2)]
        d_ids = [[[int(x)] for x in row] for row in rng.permutation(NP)[:12].reshape(6, 2)]
        reqs = [([p[0] + p[1]], [q[0] + q[1]], 32) for p, q in zip(p_ids, d_ids)]
        prefill.call("save", [sum((r[0][0] for r in reqs), [])])
        before = clone_caches(de.device_caches)
        handles = [d.pull(d.plan_pull(peer, p, n, q)) for p, q, n in reqs[:4]]
        prefill.stop()
        handles += [d.pull(d.plan_pull(peer, p, n, q)) for p, q, n in reqs[4:]]
        expected, states = before, []
        for h, (p, q, n) in zip(handles, reqs):
            states.append(wait(d, h))
            done = d.complete(h)
            if done.ok:
                expected = expected_pull(expected, de, q, p_caches, pe, p, n)
            else:
                assert done.failed_block_ids == (tuple(q[0]),)
        assert states[4:] == ["ERR", "ERR"]
        assert same_bytes(de.device_caches, expected), first_difference(de.device_caches, expected)
        assert d.stats()["live_transfer_handles"] == 0 and d.stats()["in_flight"] == 0
    finally:
        d.close()


def test_p_tp2_to_d_tp4_different_group_plans_and_page_sizes_across_processes(prefill):
    """P (TP2, two managers in the child) groups layers 2+2 with 16-token pages of
    32-token blocks; D (TP4, four managers here) groups them 1+3 with 8-token pages in
    HND; D has a prefix hit. Each D rank reads its KV head from the P rank holding it."""
    from kvcopy.nixl import TransferManager, remote_ranks
    from kvcopy.testing.nixl import geometries
    from kvcopy.testing.nixl.engines import pull_spec

    layers = [f"model.layers.{i}.attn" for i in range(4)]
    n = 71
    p = geometries.side(2, "kvf_nhd", [layers[:2], layers[2:]], [32, 32], [16, 16], n, seed=21)
    d = geometries.side(4, "kvf_hnd", [[layers[3]], layers[:3]], [8, 16], [8, 8], n, seed=22)
    spec = geometries.Spec(seed=23, dtype="bfloat16", total_kv_heads=4, head_size=8, latent=16,
                           layers=[(name, "gqa", "full") for name in layers], num_tokens=n, num_cached=16,
                           p=p, d=d, d_rank=0, p_ranks=[])
    tag = next(_names)
    p_names = [f"Pmp{tag}.{r}" for r in range(2)]
    (metadata,) = prefill.call("start_spec", spec, [0, 1], p_names)
    prefill.call("save", p.block_ids)
    managers = []
    try:
        for dr in range(4):
            ranks = remote_ranks(dr, 4, 2, 4)
            assert ranks == [dr // 2]
            s = geometries.Spec(**{**spec.__dict__, "d_rank": dr, "p_ranks": ranks})
            d_caches = geometries.build_caches(s, "d", dr)
            dm = TransferManager(f"Dmp{tag}.{dr}", d_caches, **geometries.manager_kwargs(s, "d", dr))
            managers.append(dm)
            peers = [dm.add_peer(metadata[r]) for r in ranks]
            plan, done, want, _ = pull_spec(dm, peers, s, d_caches, notify=f"d{dr}".encode())
            assert done.ok, done.error
            assert any(pair.segments for pair in plan.pairs)  # head ranges and token slices
            assert not same_bytes(want, geometries.build_caches(s, "d", dr))
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
        (got,) = prefill.call("notifications", 2)
        assert [sorted(m for _, m in g) for g in got] == [[b"d0", b"d1"], [b"d2", b"d3"]]
    finally:
        for dm in managers:
            dm.close()
