"""Heterogeneous P/D with real NIXL (UCX, DRAM), P and D managers in one process:
different group plans, page and block sizes, TP sizes (several P ranks per D rank),
NHD vs HND, MLA, replicated heads. D's caches must equal the fuzzer's independent
expectation (token and head semantics) and the byte oracle's replay of the plan."""
import itertools

import pytest

from kvcopy.nixl import remote_ranks
from kvcopy.testing.nixl import geometries
from kvcopy.testing.nixl.engines import one_torch_thread, pull_spec
from kvcopy.testing.nixl.oracle import first_difference, same_bytes

_names = itertools.count()
L = [f"model.layers.{i}.attn" for i in range(4)]


def make_spec(p, d, n, cached=0, kind="gqa", heads=4, dtype="bfloat16", attn=("full", "swa", "full", "swa")):
    layers = [(name, kind, a) for name, a in zip(L, attn)]
    return geometries.Spec(seed=11, dtype=dtype, total_kv_heads=heads, head_size=8, latent=16, layers=layers,
                           num_tokens=n, num_cached=cached, p=p, d=d, d_rank=0, p_ranks=[])


def run_all_d_ranks(spec, buffer="host"):
    """Every D rank pulls from the P ranks it needs; returns the plans."""
    from kvcopy.nixl import TransferManager

    logical = geometries.logical_kv(spec)
    tag = next(_names)
    made, plans = [], []
    try:
        p_caches, p_names = {}, {}
        for r in range(spec.p.tp_size):
            p_caches[r] = geometries.build_caches(spec, "p", r, logical)
            p_names[r] = f"hetP{tag}.{r}"
            m = TransferManager(p_names[r], p_caches[r], buffer=buffer, **geometries.manager_kwargs(spec, "p", r))
            made.append(m)
            m.save(spec.p.block_ids)
        p_managers = made[:]
        for dr in range(spec.d.tp_size):
            kind = spec.layers[0][1]
            ranks = remote_ranks(dr, spec.d.tp_size, spec.p.tp_size, spec.total_kv_heads if kind == "gqa" else None)
            s = geometries.Spec(**{**spec.__dict__, "d_rank": dr, "p_ranks": ranks})
            d_caches = geometries.build_caches(s, "d", dr)
            d = TransferManager(f"hetD{tag}.{dr}", d_caches, buffer=buffer, **geometries.manager_kwargs(s, "d", dr))
            made.append(d)
            peers = [d.add_peer(p_managers[r].metadata()) for r in ranks]
            plan, done, want, replayed = pull_spec(d, peers, s, d_caches,
                                                   {p_names[r]: p_caches[r] for r in ranks})
            assert done.ok, done.error
            assert not same_bytes(want, geometries.build_caches(s, "d", dr))  # the case moves bytes
            assert same_bytes(replayed, want), first_difference(replayed, want)
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
            assert d.stats()["live_transfer_handles"] == 0
            plans.append(plan)
    finally:
        for m in reversed(made):
            m.close()
    return plans


@pytest.fixture(autouse=True)
def _threads():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("buffer", ["host", "device"])
def test_p_tp4_to_d_tp2_different_plans_and_smaller_d_pages(buffer):
    """Each D rank reads its 2 heads from 2 P ranks; D's 8-token pages are token slices
    of P's 16-token pages; P groups layers 1+1+2, D 2+2."""
    n = 75
    p = geometries.side(4, "kvf_nhd", [[L[0]], [L[2]], [L[1], L[3]]], [32, 32, 16], [16, 16, 16], n, seed=1)
    d = geometries.side(2, "kvf_nhd", [[L[1], L[3]], [L[0], L[2]]], [16, 8], [8, 8], n, seed=2)
    plans = run_all_d_ranks(make_spec(p, d, n), buffer)
    assert all(len(plan.all_peers) == 2 for plan in plans)
    assert any(pair.segments for pair in plans[0].pairs)  # head ranges / token slices


def test_bigger_d_pages_zero_rows_past_the_prompt_and_nhd_to_hnd():
    """P TP1 with 4-token pages -> D TP2 with 16-token pages in HND: a D page is 4 P
    pages, per-head runs; rows of D's last page past the prompt are zeroed; prefix hit."""
    n = 37
    p = geometries.side(1, "nhd", [[L[0], L[1], L[2], L[3]]], [8], [4], n, seed=3)
    d = geometries.side(2, "hnd", [[L[0], L[2]], [L[1], L[3]]], [16, 32], [16, 16], n, seed=4)
    plans = run_all_d_ranks(make_spec(p, d, n, cached=16, attn=("full",) * 4))
    assert any(pair.zero_segments for pair in plans[0].pairs)


def test_mla_is_read_once_from_one_rank():
    n = 50
    p = geometries.side(2, "nhd", [[L[0], L[1]], [L[2], L[3]]], [16, 16], [16, 16], n, seed=5)
    d = geometries.side(4, "nhd", [[L[0], L[1], L[2], L[3]]], [32], [8], n, seed=6)
    plans = run_all_d_ranks(make_spec(p, d, n, kind="mla", attn=("full",) * 4))
    assert [plan.all_peers for plan in plans] == [(p_,) for p_ in [plans[0].peer, plans[1].peer] * 2]
    assert len({plan.peer for plan in plans}) == 2  # D ranks spread over P's ranks


def test_replicated_heads_p_tp4_two_heads_to_d_tp1():
    """2 KV heads over P TP4 (each head on 2 ranks): D TP1 reads each head once."""
    n = 33
    p = geometries.side(4, "hnd", [L], [16], [16], n, seed=7)
    d = geometries.side(1, "hnd", [L], [32], [32], n, seed=8)
    plans = run_all_d_ranks(make_spec(p, d, n, heads=2, attn=("full",) * 4, dtype="float16"))
    assert len(plans[0].all_peers) == 2
    moved = sum(pair.num_bytes for pair in plans[0].pairs)
    # layers x tokens read (page 0 whole, page 1's first 16-token piece) x heads x size x 2 bytes:
    # every head once, though two P ranks hold it
    assert moved == 4 * (32 + 16) * 2 * 8 * 2
