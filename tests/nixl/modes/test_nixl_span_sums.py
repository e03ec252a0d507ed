"""Arena mode's end-to-end page sums (kvcopy/nixl/modes/span_sums.py, sum_check.py) over real
NIXL (UCX, DRAM, one process): P's pack sums each staged page into the record, D's
scatter sums what it copies and compares. A fault anywhere between the two (a bit of
P's span after save, of D's span after the READ, two pages swapped, an earlier
request's page, a truncated READ) fails exactly that request, naming its pages; the
other requests in flight complete ok, bytes compared (D poisoned first), and no byte
outside the failed request's own pages changes. Requests whose staged pages differ
between P and D are counted unchecked, never checked."""
import re

import numpy as np
import pytest
import torch

from kvcopy.copy_backends import Backend
from kvcopy.copy_backends.cpu import CpuBackend
from kvcopy.core.checksum import address_of, seal
from kvcopy.nixl import ChecksumRequired, TransferManager
from kvcopy.nixl.options import ManagerOptions
from kvcopy.nixl.pull import Completion
from kvcopy.nixl.modes import span_sums
from kvcopy.nixl.wire.record import PageSums, StagedRequest
from kvcopy.nixl.sum_check import SumCheck, SumStats
from kvcopy.testing.nixl import geometries
from kvcopy.testing.nixl.engines import ToyEngine, allocate_blocks, build_case, expected_pull, one_torch_thread, wait
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes

NP = 64
KB = 1 << 20
N = 90  # tokens per request
_names = iter(range(10**6))


def hnd_engine(num_pages: int) -> ToyEngine:
    """Three HND layers ``[pages, 4 heads, 16 tokens, 8]`` bf16, one group of 32-token blocks."""
    caches = {f"h{i}": torch.empty(num_pages, 4, 16, 8, dtype=torch.bfloat16) for i in range(3)}
    return ToyEngine(caches, [["h0", "h1", "h2"]], [32], 16, {"kv_layout": "HND"})


def engine(kind: str) -> ToyEngine:
    return hnd_engine(NP) if kind == "hnd" else build_case(kind, NP)


@pytest.fixture
def pair():
    made = []

    def make(kind, p_kw=None, d_kw=None):
        pe, de = engine(kind), engine(kind)
        fill_random(pe.device_caches, 1)
        fill_random(de.device_caches, 2)
        tag = next(_names)
        order = "head" if kind == "hnd" else "token"
        p = pe.manager(f"Psum{tag}", buffer="arena", arena_bytes=KB, arena_order=order, **(p_kw or {}))
        made.append(p)
        d = de.manager(f"Dsum{tag}", buffer="arena", arena_bytes=KB, **(d_kw or {}))
        made.append(d)
        return p, d, d.add_peer(p.metadata()), pe, de

    with one_torch_thread():
        yield make
    for m in made:
        m.close()


def block_counts(kind):
    return [3, 6] if kind == "hybrid" else [3]  # N tokens in 32- (and 16-) token blocks


def read_rows(plan):
    (local, remote), = plan.reads.values()
    return local, remote


def only_pages(before, after, engine_, pages_per_group):
    """``before`` with ``after``'s bytes at each group's ``pages`` in that group's layers:
    what ``after`` must equal if nothing outside those pages changed."""
    out = clone_caches(before)
    for g, layers in enumerate(engine_.layer_groups):
        if not pages_per_group[g]:
            continue
        for name in layers:
            bd = 1 if out[name].dim() == 5 else 0  # KV-first [2, pages, ...] views page on axis 1
            idx = torch.tensor(pages_per_group[g])
            out[name].index_copy_(bd, idx, after[name].index_select(bd, idx))
    return out


def named_pages(error):
    return {int(p) for p in re.findall(r"local page (\d+)", error)}


FAULTS = ["p_flip", "p_swap", "replay", "d_flip", "truncate"]


def fold_after_the_copy(monkeypatch, how):
    """Make P and D fold after the copy: as with several copiers (no fold for the
    copy's call), or as with a backend that cannot fold in its call (it copies and
    sums, returning None)."""
    if how == "no fold":
        monkeypatch.setattr(span_sums, "scatter_fold", lambda plan, want: None)
        monkeypatch.setattr(span_sums.FoldPlan, "fold", None)
    else:
        monkeypatch.setattr(CpuBackend, "copy_with_checksums_folded", Backend.copy_with_checksums_folded)


@pytest.mark.parametrize("compared", ["in the copy's call", "no fold", "backend cannot fold"])
@pytest.mark.parametrize("kind", ["hybrid", "hnd"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_exactly_its_request(pair, kind, fault, compared, monkeypatch):
    """Requests A, B, C in flight together (E staged earlier, of the same shape); the
    fault hits B only. A and C land byte for byte and are checked; B fails naming pages
    of its own, having written nothing outside its own pages. D compares in the
    scatter's own host call (one copier on the ``cpu`` backend: no comparison after it),
    or after it (several copiers, other backends)."""
    if compared == "in the copy's call":
        monkeypatch.setattr(span_sums.FoldPlan, "differs", lambda *a: pytest.fail("compared after the copy"))
    else:
        fold_after_the_copy(monkeypatch, compared)
    p, d, peer, pe, de = pair(kind)
    rng = np.random.default_rng(7)
    used_p, used_d = set(), set()
    counts = block_counts(kind)
    p_ids = {r: allocate_blocks(rng, pe, counts, used_p, NP) for r in "EABC"}
    d_ids = {r: allocate_blocks(rng, de, [c + 1 for c in counts], used_d, NP) for r in "ABC"}
    records = {r: p.save(p_ids[r], num_tokens=N, request_id=r) for r in "EABC"}
    assert all(rec.sums is not None for rec in records.values())
    before = clone_caches(de.device_caches)
    plans = {r: d.plan_pull(peer, records[r], N, d_ids[r], request_id=r) for r in "ABC"}
    buf, b = p.arena.buffer, records["B"]
    block = p.arena.span_copiers(p.arena.order).index[0][0]  # bytes of one staged block (uniform models)
    remote = read_rows(plans["B"])[1]
    at = int(remote[0, 0]) - p.arena.base + int(rng.integers(int(remote[0, 1])))
    if fault == "p_flip":  # P's span changed after save
        buf[at] ^= 1 << int(rng.integers(8))
    elif fault == "p_swap":  # two of B's staged pages trade places
        one, two = buf[b.offset:b.offset + block].clone(), buf[b.offset + block:b.offset + 2 * block].clone()
        assert not torch.equal(one, two)
        buf[b.offset:b.offset + block], buf[b.offset + block:b.offset + 2 * block] = two, one
    elif fault == "replay":  # a page of the earlier request E where B's should be
        k = int(rng.integers(b.nbytes // block)) * block
        e = records["E"].offset
        assert not torch.equal(buf[e + k:e + k + block], buf[b.offset + k:b.offset + k + block])
        buf[b.offset + k:b.offset + k + block] = buf[e + k:e + k + block].clone()
    handles = {}
    for r in "ABC":
        if r == "B" and fault == "truncate":  # the READ brings 100 bytes less than it asks
            post = d._agent.post_read_descs

            def truncated(local, local_mem, name, remote_rows, remote_mem, notify, post=post):
                local, remote_rows = local.copy(), remote_rows.copy()
                local[-1, 1] -= 100
                remote_rows[-1, 1] -= 100
                return post(local, local_mem, name, remote_rows, remote_mem, notify)
            monkeypatch.setattr(d._agent, "post_read_descs", truncated)
            handles[r] = d.pull(plans[r], notify=r.encode())
            monkeypatch.setattr(d._agent, "post_read_descs", post)
        else:
            handles[r] = d.pull(plans[r], notify=r.encode())
    for r in "ABC":
        assert wait(d, handles[r]) == "DONE", handles[r].error
    if fault == "d_flip":  # D's span changed after the READ
        local = read_rows(plans["B"])[0]
        d.arena.buffer[int(local[0, 0]) - d.arena.base + int(rng.integers(int(local[0, 1])))] ^= 4
    done = {r: d.complete(handles[r]) for r in "ABC"}
    for r in "AC":
        assert done[r].ready and done[r].ok and done[r].checked, done[r]
    failed = done["B"]
    assert failed.ready and not failed.ok and failed.checked and "checksum mismatch" in failed.error, failed
    assert failed.failed_block_ids == plans["B"].local_block_ids
    assert failed.written_in == "device caches"
    assert failed.written_pages == tuple(tuple(r) + tuple(z) for r, z in zip(plans["B"].read_pages,
                                                                             plans["B"].zero_pages))
    assert named_pages(failed.error) <= {x for g in plans["B"].read_pages for x in g}
    want = before
    for r in "AC":
        want = expected_pull(want, de, d_ids[r], pe.device_caches, pe, p_ids[r], N)
    assert not same_bytes(want, before)
    want_b = expected_pull(want, de, d_ids["B"], pe.device_caches, pe, p_ids["B"], N)
    assert not same_bytes(want_b, de.device_caches)  # the fault reached B's pages (it can fail)
    allowed = only_pages(want, de.device_caches, de, failed.written_pages)
    assert same_bytes(allowed, de.device_caches), first_difference(allowed, de.device_caches)
    stats = d.stats()
    assert (stats["checksum_checked"], stats["checksum_failed"], stats["checksum_unchecked"]) == (2, 1, 0)
    assert stats["checksum_pending"] == 0 and stats["bytes_in_use"] == 0


@pytest.mark.parametrize("kind", ["hybrid", "hnd", "seeds3"])
def test_clean_pulls_are_checked_with_prefix_hits_and_holes(pair, kind):
    """No fault: every request is compared and matches (D reading part of a request: a
    prefix hit; sliding-window holes in the hybrid case)."""
    p, d, peer, pe, de = pair(kind)
    rng = np.random.default_rng(3)
    n = 160 if kind == "seeds3" else N
    counts = [2] if kind == "seeds3" else block_counts(kind)
    used_p, used_d = set(), set()
    for i, cached in enumerate((0, 32, 64)):
        p_ids = allocate_blocks(rng, pe, counts, used_p, NP)
        d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], used_d, NP)
        if kind == "hybrid":
            p_ids[1][:2] = d_ids[1][:2] = [-1, -1]
        cached = cached if kind != "seeds3" else 0
        before = clone_caches(de.device_caches)
        record = p.save(p_ids, num_tokens=n, request_id=f"r{i}")
        h = d.pull(d.plan_pull(peer, record, n, d_ids, cached, request_id=f"r{i}"), notify=f"r{i}".encode())
        assert wait(d, h) == "DONE"
        done = d.complete(h)
        assert done.ok and done.checked and done.unchecked is None, done
        want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n, cached)
        assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert d.stats()["checksum_checked"] == 3


def test_a_difference_found_in_the_copys_call_fails_even_if_no_page_is_named(pair, monkeypatch):
    """The scatter's own call found a difference; should naming the pages after it
    find none (a bug), the request fails all the same, never completes ok."""
    p, d, peer, pe, de = pair("hybrid")
    rng = np.random.default_rng(9)
    counts = block_counts("hybrid")
    record = p.save(allocate_blocks(rng, pe, counts, set(), NP), num_tokens=N, request_id="x")
    plan = d.plan_pull(peer, record, N, allocate_blocks(rng, de, [c + 1 for c in counts], set(), NP), request_id="x")
    h = d.pull(plan, notify=b"x")
    assert wait(d, h) == "DONE"
    local = read_rows(plan)[0]
    d.arena.buffer[int(local[0, 0]) - d.arena.base] ^= 1
    monkeypatch.setattr(span_sums.FoldPlan, "differs", lambda *a: pytest.fail("compared after the copy"))
    monkeypatch.setattr(span_sums.ScatterCheck, "differences", lambda self, arrays: None)
    done = d.complete(h)
    assert done.ready and not done.ok and done.checked and done.error == span_sums.UNNAMED, done
    assert d.stats()["checksum_failed"] == 1


@pytest.mark.parametrize("folded", ["in the copy's call", "no fold", "backend cannot fold"])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("kind", ["hybrid", "hnd"])
def test_p_folds_in_the_copys_call_as_after_it(pair, kind, holes, folded, monkeypatch):
    """P's save folds its pack's sums in the copy's own host call (one copier on
    ``cpu``: no fold after the copy) into the record's values the fold after the copy
    gives, holes (sliding-window pages P lacks) at 0; the fold after the copy (several
    copiers, other backends) gives the same record."""
    p, _, _, pe, _ = pair(kind)
    rng = np.random.default_rng(5)
    p_ids = allocate_blocks(rng, pe, block_counts(kind), set(), NP)
    if holes:
        p_ids[-1][:2] = [-1, -1]
    with monkeypatch.context() as m:
        if folded == "in the copy's call":
            m.setattr(span_sums.FoldPlan, "values", lambda *a: pytest.fail("folded after the copy"))
        else:
            fold_after_the_copy(m, folded)
        record = p.save(p_ids, num_tokens=N, request_id="x")
    (outs, host), = p.arena.sums._outs.values()  # the pack's sums, as the copy left them
    layout = p.arena.sums.layout(p.arena.span_copiers(p.arena.order), p.arena.order, p.info.tokens_per_page, "d2h")
    info = p.info
    counts = [-(-N // t) for t in info.tokens_per_page]
    positions = []
    for g, ids in enumerate(p_ids):
        pages = np.repeat(np.asarray(ids, np.int64), info.tokens_per_block[g] // info.tokens_per_page[g])[:counts[g]]
        positions.append(np.flatnonzero(pages != -1))
    assert holes == any(len(q) < c for q, c in zip(positions, counts))
    after = span_sums.page_sums(layout, host.arrays(), positions, counts)
    assert record.sums == after and any(v.any() for v in map(record.sums.values, range(len(counts))))
    for g, q in enumerate(positions):  # the holes' values are 0, the others not
        v = record.sums.values(g)
        assert not np.delete(v, q).any() and v[q].all()


@pytest.mark.parametrize("off", ["p", "d"])
def test_the_switch_off_on_either_side_leaves_requests_unchecked(pair, off):
    p, d, peer, pe, de = pair("hybrid", {"checksum": off != "p"}, {"checksum": off != "d"})
    record = p.save([[1, 2, 3], [10, 11, 12, 13, 14, 15]], num_tokens=N, request_id="x")
    assert (record.sums is None) == (off == "p")
    before = clone_caches(de.device_caches)
    d_ids = [[20, 21, 22], [50, 51, 52, 53, 54, 55]]
    h = d.pull(d.plan_pull(peer, record, N, d_ids, request_id="x"), notify=b"x")
    assert wait(d, h) == "DONE"
    done = d.complete(h)
    why = "P sent no page sums" if off == "p" else "checksum off on D"
    assert done.ok and not done.checked and why in done.unchecked
    want = expected_pull(before, de, d_ids, pe.device_caches, pe, [[1, 2, 3], [10, 11, 12, 13, 14, 15]], N)
    assert same_bytes(de.device_caches, want)
    stats = d.stats()
    assert (stats["checksum_checked"], stats["checksum_unchecked"]) == (0, 1)


def hnd_spec(p_tp, d_tp, p_tpp, d_tpp):
    layers = [f"model.layers.{i}.attn" for i in range(3)]
    p = geometries.side(p_tp, "kvf_hnd", [layers], [32], [p_tpp], 71, seed=41)
    dside = geometries.side(d_tp, "kvf_hnd", [layers], [max(16, d_tpp)], [d_tpp], 71, seed=42)
    return geometries.Spec(seed=43, dtype="bfloat16", total_kv_heads=4, head_size=8, latent=16,
                           layers=[(name, "gqa", "full") for name in layers], num_tokens=71, num_cached=0,
                           p=p, d=dside, d_rank=0, p_ranks=list(range(p_tp)))


@pytest.mark.parametrize("p_tp,d_tp,p_tpp,d_tpp,why", [
    (1, 1, 32, 16, "staged pages are not D's"),  # page sizes differ
    (2, 1, 16, 16, "several peers"),  # D reads its heads from two P ranks
    (1, 2, 16, 16, "staged pages are not D's"),  # D reads a head slice of P's pages
])
def test_pages_that_differ_between_p_and_d_are_unchecked_not_checked(p_tp, d_tp, p_tpp, d_tpp, why):
    spec = hnd_spec(p_tp, d_tp, p_tpp, d_tpp)
    logical = geometries.logical_kv(spec)
    tag = next(_names)
    made = []
    with one_torch_thread():
        try:
            pms, records = [], []
            for r in range(p_tp):
                pm = TransferManager(f"Pu{tag}.{r}", geometries.build_caches(spec, "p", r, logical),
                                     **geometries.manager_kwargs(spec, "p", r), buffer="arena", arena_bytes=KB,
                                     arena_order="head")
                made.append(pm)
                pms.append(pm)
                records.append(pm.save(spec.p.block_ids, num_tokens=71, request_id="u"))
            d_caches = geometries.build_caches(spec, "d", 0)
            dm = TransferManager(f"Du{tag}", d_caches, **geometries.manager_kwargs(spec, "d", 0), buffer="arena",
                                 arena_bytes=KB)
            made.append(dm)
            ranks = list(range(p_tp)) if p_tp > d_tp else [0]
            peers = [dm.add_peer(pms[r].metadata()) for r in ranks]
            before = clone_caches(d_caches)
            plan = dm.plan_pull(peers, {peers[i]: records[r] for i, r in enumerate(ranks)}, 71, spec.d.block_ids,
                                request_id="u")
            h = dm.pull(plan, notify=b"u")
            assert wait(dm, h) == "DONE"
            done = dm.complete(h)
            assert done.ok and not done.checked and why in done.unchecked, done
            want, _ = geometries.expected(geometries.Spec(**{**spec.__dict__, "p_ranks": ranks}), before, logical)
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
            stats = dm.stats()
            assert (stats["checksum_checked"], stats["checksum_failed"], stats["checksum_unchecked"]) == (0, 0, 1)
        finally:
            for m in made:
                m.close()


def test_d_compares_with_the_record_it_was_given_and_edits_after_plan_do_not_count(pair):
    """D's expected sums are the record's at plan_pull, copied into the plan's private
    work: a record whose sums were changed fails; changing the record object after
    plan_pull changes nothing."""
    p, d, peer, pe, de = pair("one_group")
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="a")
    vals = [record.sums.values(0)]
    vals[0][1] ^= np.uint64(1)
    lied = record.with_sums(PageSums.of(record.sums.layout, vals))
    h = d.pull(d.plan_pull(peer, StagedRequest.from_bytes(lied.to_bytes()), 40, [[20, 21, 22]], request_id="a"),
               notify=b"a")
    assert wait(d, h) == "DONE"
    done = d.complete(h)
    assert not done.ok and "page position 1 (local page 21)" in done.error, done
    record = p.save([[4, 5, 6]], num_tokens=40, request_id="b")
    plan = d.plan_pull(peer, record, 40, [[30, 31, 32]], request_id="b")
    object.__setattr__(record, "sums", lied.sums)  # edited after the plan was made
    h = d.pull(plan, notify=b"b")
    assert wait(d, h) == "DONE"
    assert d.complete(h).ok


def test_sums_that_do_not_fit_the_request_are_refused_at_plan_pull(pair):
    p, d, peer, pe, de = pair("one_group")
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="a")
    short = record.with_sums(PageSums(record.sums.layout, (record.sums.pages[0][:-16],)))
    with pytest.raises(ValueError, match="page sums per group"):
        d.plan_pull(peer, StagedRequest.from_bytes(short.to_bytes()), 40, [[20, 21, 22]], request_id="a")
    bogus = record.with_sums(PageSums(record.sums.layout, ("zz" * 24,)))
    with pytest.raises(ValueError, match="hex"):
        d.plan_pull(peer, bogus, 40, [[20, 21, 22]], request_id="a")
    assert d.stats()["bytes_in_use"] == 0


def test_sum_layouts_agree_exactly_when_staged_pages_do(pair):
    p, d, _, _, _ = pair("hybrid")
    p2, d2, _, _, _ = pair("one_group")
    fp = [m.save([[1, 2, 3]] if m is p2 else [[1, 2, 3], [10, 11, 12, 13, 14, 15]], num_tokens=N,
                 request_id="f").sums.layout for m in (p, d, p2)]
    assert fp[0] == fp[1] != fp[2]


def test_fold_sees_slabs_and_pages_trade_places(pair):
    """The folded value of a page changes when two slabs' sums, or two pages', trade places."""
    p, _, _, _, _ = pair("hybrid")
    cps = p.arena.span_copiers(p.arena.order)
    layout = p.arena.sums.layout(cps, p.arena.order, p.info.tokens_per_page, "d2h")
    rng = np.random.default_rng(0)
    positions = [np.arange(3), np.arange(6)]
    arrays = [rng.integers(0, 2**63, size=sum(len(positions[g]) for g in grp.tolist()), dtype=np.int64).view(np.uint64)
              for grp in layout.groups]
    base = layout.fold(arrays, positions)
    swapped = [a.copy() for a in arrays]
    swapped[0][[0, 3]] = swapped[0][[3, 0]]  # first slab's page 0 <-> second slab's page 0 (group 0)
    assert any((x != y).any() for x, y in zip(layout.fold(swapped, positions), base))
    paged = [a.copy() for a in arrays]
    paged[0][[0, 1]] = paged[0][[1, 0]]  # pages 0 and 1 of the first slab
    assert any((x != y).any() for x, y in zip(layout.fold(paged, positions), base))
    assert seal(np.array([5], np.uint64), 0, [1])[0] != seal(np.array([5], np.uint64), 0, [2])[0]


def _fold_by_definition(layout, arrays, positions, zeros):
    """The module docstring's value[g][k], one sum at a time: every copier's triples in
    its order, each with its group's positions, then that group's zeroed pages."""
    values = [[0] * len(p) for p in positions]
    for out, js, groups in zip(arrays, layout.numbers, layout.groups):
        o = 0
        for j, g in zip(js.tolist(), groups.tolist()):
            for i, k in enumerate(positions[g]):
                sealed = seal(np.array([out[o + i]], np.uint64), 0, [(j << 40) + int(k)])[0]
                values[g][i] = (values[g][i] + int(sealed)) % (1 << 64)
            o += len(positions[g]) + zeros[g]
        assert o == len(out)
    return [np.array(v, np.uint64) for v in values]


@pytest.mark.parametrize("positions,zeros", [
    ([[0, 1, 2], [0, 1, 2, 3, 4, 5]], [0, 0]),
    ([[2], [1, 4, 5]], [1, 2]),  # holes and prefix hits: positions with gaps, zeroed pages after them
    ([[], [3, 0]], [2, 0]),  # a group D reads nothing of; positions out of order
])
def test_fold_is_the_definition(pair, positions, zeros):
    """fold()'s one gather and segmented sum over all copiers give the module
    docstring's value per (group, position), the plan cached or not."""
    p, _, _, _, _ = pair("hybrid")
    cps = p.arena.span_copiers(p.arena.order)
    layout = p.arena.sums.layout(cps, p.arena.order, p.info.tokens_per_page, "d2h")
    rng = np.random.default_rng(len(positions[0]))
    pos = [np.array(x, np.int64) for x in positions]
    arrays = [rng.integers(0, 2**63, size=sum(len(pos[g]) + zeros[g] for g in grp.tolist()),
                           dtype=np.int64).view(np.uint64) for grp in layout.groups]
    want = _fold_by_definition(layout, arrays, pos, zeros)
    for _ in range(2):  # the second call takes the cached plan
        got = layout.fold(arrays, pos, zeros)
        assert [g.dtype for g in got] == [np.uint64] * len(want)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    plan = layout.fold_plan(pos, zeros)
    assert np.array_equal(plan.numpy_values(arrays), plan.values(arrays))  # the oracle and the host library
    with pytest.raises(ValueError, match="sums of"):
        layout.fold(arrays[:-1], pos, zeros)
    with pytest.raises(ValueError, match="sums of"):
        layout.fold([a[:-1] for a in arrays], pos, zeros)


def test_compare_names_exactly_the_pages_that_differ(pair, monkeypatch):
    """ScatterCheck.compare: None when every value matches (the one-comparison path and
    the per-group one alike), else the message naming each differing page and no other."""
    p, _, _, _, _ = pair("hybrid")
    cps = p.arena.span_copiers(p.arena.order)
    layout = p.arena.sums.layout(cps, p.arena.order, p.info.tokens_per_page, "d2h")
    pos, zeros = [np.array([2, 0], np.int64), np.array([1, 4, 5], np.int64)], [1, 0]
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 2**63, size=sum(len(pos[g]) + zeros[g] for g in grp.tolist()),
                           dtype=np.int64).view(np.uint64) for grp in layout.groups]
    expected = layout.fold(arrays, pos, zeros)
    plan = layout.fold_plan(pos, zeros)
    local = ((30, 31), (40, 41, 42))

    def check(exp, want):
        return span_sums.ScatterCheck(layout, tuple(pos), tuple(zeros), tuple(exp), local, plan, want,
                                      0 if want is None else address_of(want),
                                      span_sums.scatter_fold(plan, want))
    assert check(expected, span_sums.matching_values(plan, expected)).compare(arrays) is None
    assert check(expected, None).compare(arrays) is None  # the per-group path agrees
    off = [e.copy() for e in expected]
    off[1][2] ^= np.uint64(1)
    for want in (span_sums.matching_values(plan, off), None):
        msg = check(off, want).compare(arrays)
        assert msg is not None and "1 page(s)" in msg and "group 1 page position 5 (local page 42)" in msg
    # a comparison that found a difference fails the request even if naming finds no page
    failing = check(off, span_sums.matching_values(plan, off))
    with monkeypatch.context() as m:
        m.setattr(span_sums.ScatterCheck, "differences", lambda self, arrays: None)
        assert failing.compare(arrays) == failing.named(arrays) == span_sums.UNNAMED
    with pytest.raises(ValueError):
        plan.gather[0] = 0  # shared by requests: read-only


def test_nothing_matches_where_a_group_without_sums_expects_a_value():
    """A group with no triple on D folds to zeros: P's nonzero value there cannot match."""
    plan = span_sums.FoldPlan((2,), np.zeros(2, np.int64), np.zeros(2, np.uint64), np.array([0, 1], np.int64),
                              ((0, 2, True), (2, 3, False)), (0, 0, 0), None)
    zero = [np.array([7, 8], np.uint64), np.zeros(1, np.uint64)]
    assert list(span_sums.matching_values(plan, zero)) == [7, 8]
    assert span_sums.matching_values(plan, [zero[0], np.ones(1, np.uint64)]) is None


def test_the_host_library_folds_and_compares_as_numpy_does(pair, monkeypatch):
    """kvcopy_fold_page_sums (one C call) against FoldPlan.numpy_values: the same values,
    a difference in any one value found, and plan indices out of range refused; without
    the library the numpy fold stands in, with the same verdicts."""
    assert span_sums._fold_function() is not None, "the host library is built with the package"
    p, _, _, _, _ = pair("hybrid")
    cps = p.arena.span_copiers(p.arena.order)
    layout = p.arena.sums.layout(cps, p.arena.order, p.info.tokens_per_page, "d2h")
    pos, zeros = [np.array([0, 2, 1], np.int64), np.array([5, 0, 3, 4], np.int64)], [1, 2]
    plan = layout.fold_plan(pos, zeros)
    rng = np.random.default_rng(11)
    arrays = [rng.integers(0, 2**63, size=n, dtype=np.int64).view(np.uint64) for n in plan.sizes]
    want = plan.numpy_values(arrays)
    with monkeypatch.context() as m:  # values() from the library alone
        m.setattr(span_sums.FoldPlan, "numpy_values", lambda *a: pytest.fail("numpy stood in for the library"))
        got = plan.values(arrays)
    assert len(want) == len(plan.starts) > 1 and np.array_equal(got, want)
    want.setflags(write=False)
    at = address_of(want)
    for library in (True, False):
        if not library:
            monkeypatch.setattr(span_sums, "_FOLD", [None])
        assert not plan.differs(arrays, want, at)
        for k in range(len(want)):
            off = want.copy()
            off[k] ^= np.uint64(1 << int(rng.integers(64)))
            assert plan.differs(arrays, off, address_of(off))
        bent = [a.copy() for a in arrays]
        bent[-1][int(rng.integers(len(bent[-1])))] += np.uint64(1)
        # a sum not folded (a zeroed page's) may change without a difference; a folded one may not
        assert plan.differs(bent, want, at) == (not np.array_equal(plan.numpy_values(bent), want))
        with pytest.raises(ValueError, match="sums of"):
            plan.differs([a[:-1] for a in arrays], want, at)
    monkeypatch.setattr(span_sums, "_FOLD", [])
    gather = plan.gather.copy()
    gather[-1] = sum(plan.sizes)  # one past the sums
    bad = plan._replace(gather=gather, at=(address_of(gather),) + plan.at[1:])
    with pytest.raises(RuntimeError, match="out of range"):
        bad.values(arrays)


class _SlowReadback:
    """A readback whose sums arrive when ``arrive`` is set (what a CUDA event does)."""

    def __init__(self, arrays):
        self.arrive, self.waited, self._arrays = False, 0, arrays

    def ready(self):
        return self.arrive

    def arrays(self):
        if not self.arrive:
            self.waited += 1
            self.arrive = True
        return self._arrays


def test_a_pending_comparison_waits_only_when_its_verdict_is_read():
    stats = SumStats()
    rb = _SlowReadback([np.zeros(2, np.uint64)])
    check = SumCheck(rb, lambda arrays: "checksum mismatch: group 0 page position 1 (local page 9)", stats)

    class Work:
        local_block_ids, read_pages, zero_pages = ((4,),), ((8, 9),), ((10,),)
    done = Completion.of_done(1, check, None, Work)
    assert not done.ready and done.read_pending is False and rb.waited == 0
    assert stats.as_dict()["checksum_pending"] == 1 and rb.waited == 0  # stats() never waits
    assert not done.ok and rb.waited == 1 and done.ready
    assert done.failed_block_ids == ((4,),) and done.written_pages == ((8, 9, 10),)
    assert stats.as_dict() == {"checksum_checked": 0, "checksum_failed": 1, "checksum_unchecked": 0,
                               "checksum_pending": 0}
    rb2 = _SlowReadback([])
    ok = Completion.of_done(1, SumCheck(rb2, lambda arrays: None, stats), None, Work)
    rb2.arrive = True
    assert stats.as_dict()["checksum_checked"] == 1  # settled by stats() once ready
    assert ok.ok and ok.checked and rb2.waited == 0


def test_the_switch_is_a_bool():
    with pytest.raises(TypeError, match="checksum"):
        ManagerOptions(checksum="yes")
    assert ManagerOptions().checksum is True


# ---------------------------------------------------------------- require_checksum (D can require checks)
def _uncheckable(kind: str, record: StagedRequest) -> bytes:
    """The wire form D gets in each case where its pages cannot be compared (unkeyed
    managers: anyone on the path can re-frame a record with a fresh digest)."""
    if kind == "P runs without sums":
        return record.to_bytes()
    if kind == "sums stripped on the way":
        return StagedRequest.from_dict({k: v for k, v in record.to_dict().items() if k != "sums"}).to_bytes()
    assert kind == "sums layout fingerprint changed"
    return record.with_sums(PageSums("0" * 32, record.sums.pages)).to_bytes()


@pytest.mark.parametrize("kind", ["P runs without sums", "sums stripped on the way",
                                  "sums layout fingerprint changed"])
def test_require_checksum_refuses_a_pull_d_cannot_check(pair, kind):
    """With ``checksum=True`` alone such a pull completes ``ok=True, checked=False``
    whatever bytes it brings (here: a byte of P's span changed after the pack, so the
    load is wrong); with ``require_checksum=True`` plan_pull refuses it before anything
    is read or written, and the same D still pulls a checkable request exactly."""
    p_kw = {"checksum": False} if kind == "P runs without sums" else None
    p, d, peer, pe, de = pair("one_group", p_kw=p_kw)
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="r")
    p.arena.buffer[record.offset + 3] ^= 0x40  # corrupted after the pack
    wire = _uncheckable(kind, record)
    before = clone_caches(de.device_caches)
    h = d.pull(d.plan_pull(peer, wire, 40, [[10, 11, 12]], request_id="r"))  # checks possible, not required
    assert wait(d, h) == "DONE"
    done = d.complete(h)
    assert done.ok and not done.checked and done.unchecked  # the wrong bytes went through
    want = expected_pull(before, de, [[10, 11, 12]], pe.device_caches, pe, [[1, 2, 3]], 40)
    assert not same_bytes(de.device_caches, want)

    strict = de.manager(f"Dstrict{next(_names)}", buffer="arena", arena_bytes=KB, require_checksum=True)
    try:
        speer = strict.add_peer(p.metadata())
        poisoned = clone_caches(de.device_caches)
        with pytest.raises(ChecksumRequired, match="cannot be compared"):
            strict.plan_pull(speer, wire, 40, [[20, 21, 22]], request_id="r")
        assert same_bytes(de.device_caches, poisoned) and strict.stats()["bytes_in_use"] == 0
        if kind != "P runs without sums":  # the genuine record, pages intact: compared, exact
            p.arena.buffer[record.offset + 3] ^= 0x40
            before = clone_caches(de.device_caches)
            h = strict.pull(strict.plan_pull(speer, record, 40, [[20, 21, 22]], request_id="r"))
            assert wait(strict, h) == "DONE"
            done = strict.complete(h)
            assert done.ok and done.checked
            want = expected_pull(before, de, [[20, 21, 22]], pe.device_caches, pe, [[1, 2, 3]], 40)
            assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    finally:
        strict.close()


def test_require_checksum_in_host_mode_and_its_refusals():
    """Host mode compares its own way (docs/nixl.md): a P without sums is refused the
    same way; device mode carries none, so require_checksum is refused there at once."""
    with one_torch_thread():
        pe, de = build_case("one_group", NP), build_case("one_group", NP)
        fill_random(pe.device_caches, 3)
        fill_random(de.device_caches, 4)
        tag = next(_names)
        p = pe.manager(f"Phost{tag}", checksum=False)
        d = de.manager(f"Dhost{tag}", require_checksum=True)
        try:
            peer = d.add_peer(p.metadata())
            p.save([[1, 2, 3]])
            with pytest.raises(ChecksumRequired, match="P sent no page sums"):
                d.plan_pull(peer, [[1, 2, 3]], 40, [[10, 11, 12]])
            full_hit = d.plan_pull(peer, [[1, 2, 3]], 40, [[10, 11, 12]], num_cached_tokens=48)
            d.discard(full_hit)  # nothing read, nothing to compare: not refused
        finally:
            p.close()
            d.close()
        with pytest.raises(ValueError, match="device mode carries no page sums"):
            de.manager(f"Ddev{tag}", buffer="device", require_checksum=True)
