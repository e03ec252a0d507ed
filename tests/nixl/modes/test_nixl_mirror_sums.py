"""Host mode's page sums (kvcopy/nixl/modes/mirror_sums.py) over real NIXL (UCX, DRAM, one
process): P's save leaves each page's sum in its registered page-sums region, D's READ
fetches the slots of the pages it reads with them, D's complete compares the sums of its
own copy. A fault between P's mirror and D's KV (a bit of P's mirror page after save, a
page rewritten or two pages swapped there, a bit of D's mirror page after the READ, a
page the READ left out) fails exactly that request; the others in flight are exact and
checked; no byte outside the failed request's pages changes. The handshake's
page-sums region is checked like every other field."""
import json
import re
import struct

import numpy as np
import pytest
import torch

from kvcopy.nixl.wire.handshake import decode, encode
from kvcopy.nixl.wire.handshake import MAGIC, frame
from kvcopy.nixl.engine.info import SumsRegion
from kvcopy.testing.nixl import geometries
from kvcopy.testing.nixl.engines import ManagerPairs, allocate_blocks, build_case, expected_pull, one_torch_thread, wait
from kvcopy.testing.nixl.oracle import clone_caches, fill_random, first_difference, same_bytes
from test_nixl_span_sums import hnd_spec, only_pages

NP = 64
N = 90


@pytest.fixture
def pd():
    with one_torch_thread(), ManagerPairs() as pairs:
        yield lambda case, **kw: pairs.make(case, NP, buffer="host", **kw)


def page_bytes(m, layer, page):
    """The bytes of ``page`` of ``layer`` in manager ``m``'s host mirror (chunk by chunk)."""
    t = m.regions.host_views[layer]
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    region = next(r for r in m.info.regions if layer in r.layers)
    base = region.address - raw.data_ptr()
    return raw, [base + page * region.page_stride + c * region.chunk_stride for c in range(region.num_chunks)], \
        region.chunk_bytes


FAULTS = ["p_flip", "p_rewrite", "p_swap", "d_flip", "dropped"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_fails_exactly_its_request(pd, fault, monkeypatch):
    p, d, peer, pe, de = pd("hybrid")
    rng = np.random.default_rng(5)
    used_p, used_d = set(), set()
    p_ids = {r: allocate_blocks(rng, pe, [3, 6], used_p, NP) for r in "ABC"}
    d_ids = {r: allocate_blocks(rng, de, [3, 6], used_d, NP) for r in "ABC"}
    for r in "ABC":
        p.save(p_ids[r])
    before = clone_caches(de.device_caches)
    plans = {r: d.plan_pull(peer, p_ids[r], N, d_ids[r]) for r in "ABC"}
    first = p_ids["B"][1][2] * 1  # group 1 (16-token blocks: one page per block)
    raw, (at,), n = page_bytes(p, "l1", first)
    if fault == "p_flip":
        raw[at + int(rng.integers(n))] ^= 1 << int(rng.integers(8))
    elif fault == "p_rewrite":  # P's page rewritten after save (say, by the next prefill), not saved again
        raw[at:at + n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
    elif fault == "p_swap":
        _, (at2,), _ = page_bytes(p, "l1", p_ids["B"][1][3])
        one, two = raw[at:at + n].clone(), raw[at2:at2 + n].clone()
        assert not torch.equal(one, two)
        raw[at:at + n], raw[at2:at2 + n] = two, one
    handles = {}
    for r in "ABC":
        if r == "B" and fault == "dropped":  # the READ leaves out the plan's first page row
            post = d._agent.post_read

            def dropped(local_dlist, local_idx, remote_dlist, remote_idx, notify, post=post):
                return post(local_dlist, local_idx[1:], remote_dlist, remote_idx[1:], notify)
            monkeypatch.setattr(d._agent, "post_read", dropped)
            handles[r] = d.pull(plans[r], notify=r.encode())
            monkeypatch.setattr(d._agent, "post_read", post)
        else:
            handles[r] = d.pull(plans[r], notify=r.encode())
    for r in "ABC":
        assert wait(d, handles[r]) == "DONE", handles[r].error
    if fault == "d_flip":
        raw_d, (at_d,), n_d = page_bytes(d, "l1", d_ids["B"][1][2])
        raw_d[at_d + int(rng.integers(n_d))] ^= 8
    done = {r: d.complete(handles[r]) for r in "ABC"}
    for r in "AC":
        assert done[r].ok and done[r].checked, done[r]
    failed = done["B"]
    assert not failed.ok and failed.checked and "checksum mismatch" in failed.error, failed
    assert {int(x) for x in re.findall(r"local page (\d+)", failed.error)} <= set(plans["B"].read_pages[0]) | set(
        plans["B"].read_pages[1])
    assert failed.failed_block_ids == plans["B"].local_block_ids and failed.written_in == "device caches"
    want = before
    for r in "AC":
        want = expected_pull(want, de, d_ids[r], pe.device_caches, pe, p_ids[r], N)
    allowed = only_pages(want, de.device_caches, de, failed.written_pages)
    assert same_bytes(allowed, de.device_caches), first_difference(allowed, de.device_caches)
    stats = d.stats()
    assert (stats["checksum_checked"], stats["checksum_failed"], stats["checksum_unchecked"]) == (2, 1, 0)


@pytest.mark.parametrize("case", ["one_group", "hybrid", "seeds3"])
def test_clean_pulls_are_checked(pd, case):
    p, d, peer, pe, de = pd(case)
    rng = np.random.default_rng(2)
    counts, n = {"one_group": ([3], 40), "hybrid": ([3, 6], N), "seeds3": ([2], 160)}[case]
    used_p, used_d = set(), set()
    for cached in (0, 16 if case != "seeds3" else 0):
        p_ids = allocate_blocks(rng, pe, counts, used_p, NP)
        d_ids = allocate_blocks(rng, de, [c + 1 for c in counts], used_d, NP)
        p.save(p_ids)
        before = clone_caches(de.device_caches)
        h = d.pull(d.plan_pull(peer, p_ids, n, d_ids, cached))
        assert wait(d, h) == "DONE"
        done = d.complete(h)
        assert done.ok and done.checked, done
        want = expected_pull(before, de, d_ids, pe.device_caches, pe, p_ids, n, cached)
        assert same_bytes(de.device_caches, want), first_difference(de.device_caches, want)
    assert d.stats()["checksum_checked"] == 2


def test_a_page_p_never_saved_fails(pd):
    """Its slot holds no sum of its bytes: the pull fails rather than passing unchecked bytes."""
    p, d, peer, pe, de = pd("one_group")
    h = d.pull(d.plan_pull(peer, [[4, 5]], 32, [[20, 21]]))
    assert wait(d, h) == "DONE"
    assert not d.complete(h).ok


@pytest.mark.parametrize("off", ["p", "d"])
def test_the_switch_off_on_either_side_leaves_requests_unchecked(off):
    pe, de = build_case("one_group", NP), build_case("one_group", NP)
    fill_random(pe.device_caches, 1)
    fill_random(de.device_caches, 2)
    with one_torch_thread():
        p = pe.manager(f"Phoff{off}", checksum=off != "p")
        d = de.manager(f"Dhoff{off}", checksum=off != "d")
        try:
            assert (p.info.sums is None) == (off == "p") and (d.info.sums is None) == (off == "d")
            peer = d.add_peer(p.metadata())
            p.save([[1, 2, 3]])
            before = clone_caches(de.device_caches)
            h = d.pull(d.plan_pull(peer, [[1, 2, 3]], 40, [[20, 21, 22]]))
            assert wait(d, h) == "DONE"
            done = d.complete(h)
            why = "P sent no page sums" if off == "p" else "checksum off on D"
            assert done.ok and not done.checked and why in done.unchecked, done
            want = expected_pull(before, de, [[20, 21, 22]], pe.device_caches, pe, [[1, 2, 3]], 40)
            assert same_bytes(de.device_caches, want)
            assert d.stats()["checksum_unchecked"] == 1
        finally:
            p.close()
            d.close()


@pytest.mark.parametrize("p_tp,d_tp,p_tpp,d_tpp,why", [
    (1, 1, 32, 16, "pages are not D's"),
    (2, 1, 16, 16, "several peers"),
    (1, 2, 16, 16, "pages are not D's"),
])
def test_pages_that_differ_between_p_and_d_are_unchecked(p_tp, d_tp, p_tpp, d_tpp, why):
    from kvcopy.nixl import TransferManager

    spec = hnd_spec(p_tp, d_tp, p_tpp, d_tpp)
    logical = geometries.logical_kv(spec)
    made = []
    with one_torch_thread():
        try:
            pms = []
            for r in range(p_tp):
                pm = TransferManager(f"Phs{p_tp}{d_tp}{p_tpp}.{r}", geometries.build_caches(spec, "p", r, logical),
                                     **geometries.manager_kwargs(spec, "p", r))
                made.append(pm)
                pms.append(pm)
                pm.save(spec.p.block_ids)
            d_caches = geometries.build_caches(spec, "d", 0)
            dm = TransferManager(f"Dhs{p_tp}{d_tp}{p_tpp}", d_caches, **geometries.manager_kwargs(spec, "d", 0))
            made.append(dm)
            ranks = list(range(p_tp)) if p_tp > d_tp else [0]
            peers = [dm.add_peer(pms[r].metadata()) for r in ranks]
            before = clone_caches(d_caches)
            h = dm.pull(dm.plan_pull(peers, spec.p.block_ids, 71, spec.d.block_ids))
            assert wait(dm, h) == "DONE"
            done = dm.complete(h)
            assert done.ok and not done.checked and why in done.unchecked, done
            want, _ = geometries.expected(geometries.Spec(**{**spec.__dict__, "p_ranks": ranks}), before, logical)
            assert same_bytes(d_caches, want), first_difference(d_caches, want)
        finally:
            for m in made:
                m.close()


def _reframed(data, edit):
    length = struct.unpack_from("<Q", data, len(MAGIC) + 8)[0]
    header = json.loads(data[len(MAGIC) + 24:len(MAGIC) + 24 + length])
    agent = data[len(MAGIC) + 24 + length:len(data) - 32]
    edit(header)
    return frame(json.dumps(header).encode(), agent)


def test_the_handshake_checks_the_page_sums_region(pd):
    p, d, peer, pe, de = pd("one_group")
    info = decode(p.metadata())
    assert isinstance(info.sums, SumsRegion) and info.sums == p.info.sums
    assert info.sums.nbytes == 8 * NP  # one slot per page of the group
    bad = {
        "bytes": lambda h: h["sums"].update(bytes=h["sums"]["bytes"] + 8),
        "address": lambda h: h["sums"].update(address=2**64 - 8),
        "layout": lambda h: h["sums"].update(layout="Z" * 32),
        "extra": lambda h: h["sums"].update(zz=1),
        "arena mode": lambda h: h.update(buffer="arena", arena=[4096, 1 << 20]),
        "not an object": lambda h: h.update(sums=[1, 2]),
    }
    for name, edit in bad.items():
        with pytest.raises(ValueError):
            decode(_reframed(p.metadata(), edit))
            pytest.fail(f"{name}: accepted")
    assert decode(_reframed(p.metadata(), lambda h: h.update(sums=None))).sums is None
    assert decode(encode(info)) == info
