"""kvcopy.core.planner: a call's ids checked and packed, in C and in numpy alike.

The native pass (csrc/call_plan.cpp) and its numpy twin (the path without the native
library) must give the same packed call and block prefix, or refuse the same call
with the same message; the message names the group, the layer and the id the pass
stopped at.
"""
import re

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy.core import planner
from kvcopy.copy_backends import kernel_inputs
from kvcopy.core.planner import merge_runs

needs_native = pytest.mark.skipif(planner.plan_call_function() is None, reason="CPU library not built")


def test_merge_runs():
    a = np.array([3, 4, 5, 9, 10, 2], dtype=np.int64)
    b = np.array([0, 1, 2, 7, 9, 3], dtype=np.int64)
    assert merge_runs(a, b).tolist() == [[3, 0, 3], [9, 7, 1], [10, 9, 1], [2, 3, 1]]
    assert merge_runs(a[:0], b[:0]).shape == (0, 3)


def _copiers(monkeypatch, dev, host, groups):
    """The same copier twice: the native planner, and the numpy one (no library)."""
    native = kvcopy.BlockCopier(dev, host, groups, copy_backend="torch")
    with monkeypatch.context() as m:
        m.setattr(planner, "plan_call_function", lambda: None)
        numpy = kvcopy.BlockCopier(dev, host, groups, copy_backend="torch")
    assert native._h2d.planner.engine == "native" and numpy._h2d.planner.engine == "numpy"
    return native, numpy


def _outcome(copier, direction, src, dst):
    try:
        call = copier.plan(direction, *((src, dst) if direction == "d2h" else (dst, src)))
    except ValueError as exc:
        return str(exc)
    return (kernel_inputs.call_array(call).tolist(), call.total_bytes, [x.tolist() for x in call.dst_ids])


@needs_native
def test_native_pass_and_numpy_pass_agree(monkeypatch):
    """Random calls, valid and not, over groups with their own limits and two groups
    sharing destination bytes: the same call array, or the same refusal."""
    rng = np.random.default_rng(7)
    shared = torch.zeros(2, 20, 2, 2, 4, dtype=torch.uint8)
    dev = {"a": shared, "b": shared, "c": torch.zeros_like(shared), "d": torch.zeros(2, 12, 2, 2, 4, dtype=torch.uint8)}
    host = {k: torch.zeros(2, 16, 2, 2, 4, dtype=torch.uint8) for k in dev}
    native, numpy = _copiers(monkeypatch, dev, host, [["a", "c"], ["b"], ["d"]])
    for direction in ("d2h", "h2d"):
        refused = accepted = 0
        for _ in range(400):
            lens = rng.integers(0, 5, size=3)
            if rng.random() < 0.5:  # valid: ids disjoint across groups, in range, runs likely
                cut = np.cumsum(lens)[:-1]
                src = [sorted(x.tolist()) for x in np.split(rng.permutation(12)[: lens.sum()], cut)]
                dst = [sorted(x.tolist()) for x in np.split(rng.permutation(12)[: lens.sum()], cut)]
            else:  # anything: out of range, duplicates within and across groups
                src = [rng.integers(-1, 21, size=n).tolist() for n in lens]
                dst = [rng.integers(0, 21, size=n).tolist() for n in lens]
            got = _outcome(native, direction, src, dst)
            assert got == _outcome(numpy, direction, src, dst), (direction, src, dst)
            refused += isinstance(got, str)
            accepted += not isinstance(got, str)
        assert refused > 50 and accepted > 50


@needs_native
def test_the_block_prefix_follows_the_packed_call(monkeypatch):
    """The cuda kernel's block prefix (prefix[r] = blocks in the runs before r) right
    after the packed call, from both passes."""
    t = {f"l{i}": torch.zeros(64, 2, 8, dtype=torch.uint8) for i in range(4)}
    h = {k: torch.zeros(80, 2, 8, dtype=torch.uint8) for k in t}
    copiers = _copiers(monkeypatch, t, h, [["l0", "l1"], ["l2"], ["l3"]])
    rng = np.random.default_rng(7)
    for trial in range(60):
        dev, host = [], []
        for _ in range(3):
            n = int(rng.integers(0, 12))
            start = int(rng.integers(0, 64 - n)) if trial % 2 else 0
            d = (np.arange(start, start + n) if trial % 3 == 0 else rng.permutation(64)[:n]).tolist()
            dev.append(d)
            host.append((rng.permutation(80)[:n] if trial % 4 == 1 else np.array(d, dtype=np.int64)).tolist())
        for c in copiers:
            call = c.plan("h2d", dev, host)
            assert call.prefix_words == call.num_runs + 1
            counts = call.runs()[:, 2]
            assert kernel_inputs.call_array(call)[len(call.packed):].tolist() == [0] + np.cumsum(counts).tolist()
            want = [[s, d] for hs, ds in zip(host, dev) for s, d in zip(hs, ds)]
            got = [[r[0] + k, r[1] + k] for r in call.runs().tolist() for k in range(r[2])]
            assert got == want


def _copier(backend="torch"):
    shared = torch.zeros(8, 4, 2, dtype=torch.uint8)
    dev = {"x": shared, "y": shared, "z": torch.zeros(6, 4, 2, dtype=torch.uint8)}
    host = {k: torch.zeros(10, 4, 2, dtype=torch.uint8) for k in dev}
    return kvcopy.BlockCopier(dev, host, [["x"], ["y"], ["z"]], copy_backend=backend)


@pytest.mark.parametrize("engine", ["native", "numpy"])
@pytest.mark.parametrize("ids,message", [
    ([[0], [1], [6]], r"group 2, layer 'z': device block id 6 out of range \[0, 6\)"),
    ([[0], [-3], [1]], r"group 1, layer 'y': host block id -3 out of range \[0, 10\)"),  # the source first
    ([[2, 2], [1], [1]], r"group 0, layer 'x': device block id 2 is written twice in one call"),
    ([[2], [3, 2], [2]], r"groups \[0, 1\] share device storage and both write block id 2"),
])
def test_the_refusal_names_group_layer_and_id(monkeypatch, engine, ids, message):
    """Group z's own limit (6 blocks), groups x and y sharing device bytes (one
    destination class), z sharing nothing (block 2 is free for it)."""
    if engine == "numpy":
        monkeypatch.setattr(planner, "plan_call_function", lambda: None)
    elif planner.plan_call_function() is None:
        pytest.skip("CPU library not built")
    copier = _copier()
    with pytest.raises(ValueError, match=message):
        copier.plan("h2d", ids)
    copier.plan("h2d", [[0, 1], [2, 3], [0, 1]])  # the same groups, valid


def test_host_side_limit_and_lengths():
    copier = _copier()
    with pytest.raises(ValueError, match=r"group 0, layer 'x': host block id 10 out of range \[0, 10\)"):
        copier.plan("d2h", [[0], [1], [2]], [[10], [1], [2]])
    with pytest.raises(ValueError, match="group 1: 1 device block ids but 2 host block ids"):
        copier.plan("d2h", [[0], [1], [2]], [[0], [1, 2], [3]])
    with pytest.raises(ValueError, match=r"one id list per KV cache group \(3\)"):
        copier.plan("d2h", [[0], [1]])


class _LyingLength:
    """An outer sequence whose len() promises one item more than it holds."""

    def __init__(self, lists):
        self._lists = lists

    def __len__(self):
        return len(self._lists) + 1

    def __getitem__(self, i):
        return self._lists[i]


@pytest.mark.parametrize("outer,exc", [
    # no defined order: which group gets which ids would be up to the container
    (lambda lists: set(map(tuple, lists)), TypeError),
    (lambda lists: frozenset(map(tuple, lists)), TypeError),
    (lambda lists: dict(enumerate(lists)).values(), TypeError),
    (lambda lists: dict(enumerate(lists)), TypeError),
    (lambda lists: _LyingLength(lists[:2]), ValueError),  # IndexError before
], ids=["set", "frozenset", "dict.values()", "dict", "len() lies"])
def test_the_outer_container_of_per_group_ids_has_an_order_and_its_length(outer, exc):
    """Every direction, the fast path for plain lists included: refused before any
    byte moves (destination poisoned, compared whole)."""
    copier = _copier()
    lists = [[0, 1], [2, 3], [4, 5]]
    for direction in ("d2h", "h2d"):
        with pytest.raises(exc, match="block ids"):
            copier.plan(direction, outer(lists))
    dev = {"x": torch.arange(4 * 4 * 2, dtype=torch.uint8).reshape(4, 4, 2)}
    hb = {"x": torch.full((10, 4, 2), 0x5A, dtype=torch.uint8)}
    one = kvcopy.BlockCopier(dev, hb, [["x"]])
    before = hb["x"].clone()
    with pytest.raises(TypeError):
        one.to_host({(1, 2)})
    with pytest.raises(ValueError):
        one.to_host(_LyingLength([]))
    assert torch.equal(hb["x"], before)
    one.to_host([(1, 2)])  # the same ids in a list: copied
    assert torch.equal(hb["x"][1:3], dev["x"][1:3]) and torch.equal(hb["x"][3:], before[3:])


@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_split_equals_planning_each_part_alone(monkeypatch, engine):
    """A checked call cut by group into parts: each part's call array, ids, lengths and
    bytes equal the plan of those groups' ids alone (the others emptied), and running
    the parts one by one writes what the whole call writes (destination poisoned)."""
    if engine == "numpy":
        monkeypatch.setattr(planner, "plan_call_function", lambda: None)
    elif planner.plan_call_function() is None:
        pytest.skip("CPU library not built")
    rng = np.random.default_rng(11)
    shared = torch.zeros(40, 2, 8, dtype=torch.uint8)
    dev = {"a": shared, "b": shared, **{f"l{i}": torch.randint(0, 256, (40, 2, 8), dtype=torch.uint8)
                                        for i in range(5)}}
    shared.copy_(torch.randint(0, 256, shared.shape, dtype=torch.uint8))
    host = {k: torch.zeros(48, 2, 8, dtype=torch.uint8) for k in dev}
    groups = [["a"], ["b"], ["l0", "l1"], ["l2"], ["l3"], ["l4"]]
    copier = kvcopy.BlockCopier(dev, host, groups, copy_backend="torch")
    for trial in range(40):
        lens = rng.integers(0, 9, size=len(groups))
        taken = rng.permutation(40)[: lens[:2].sum()]  # groups a and b share device bytes
        dev_ids = [sorted(taken[: lens[0]].tolist()), sorted(taken[lens[0]:].tolist())]
        dev_ids += [np.sort(rng.permutation(40)[:n]).tolist() if trial % 2 else rng.permutation(40)[:n].tolist()
                for n in lens[2:]]
        host_ids = [(np.sort(rng.permutation(48)[:n]) if trial % 3 else np.arange(n) + 3).tolist() for n in lens]
        whole = copier.plan("h2d", dev_ids, host_ids)
        parts = int(rng.integers(1, 5))
        part_of = rng.integers(-1, parts, size=len(groups))
        cut = copier.split("h2d", whole, part_of, parts)
        assert len(cut) == parts
        for p, call in enumerate(cut):
            alone = copier.plan("h2d", [d if part_of[g] == p else [] for g, d in enumerate(dev_ids)],
                                [h if part_of[g] == p else [] for g, h in enumerate(host_ids)])
            assert kernel_inputs.call_array(call).tolist() == kernel_inputs.call_array(alone).tolist()
            assert (call.src_flat.tolist(), call.dst_flat.tolist(), call.group_lens, call.total_bytes,
                    call.num_runs, call.num_items) == (alone.src_flat.tolist(), alone.dst_flat.tolist(),
                                                        alone.group_lens, alone.total_bytes, alone.num_runs,
                                                        alone.num_items)
        if trial % 4 == 0:  # the parts, run one by one, write exactly what the whole call writes
            for t in host.values():
                t.fill_(0xA5)
            want = {k: v.clone() for k, v in host.items()}
            for g, names in enumerate(groups):
                if part_of[g] >= 0:
                    for n in names:
                        want[n][host_ids[g]] = dev[n][dev_ids[g]]
            d2h = copier.plan("d2h", dev_ids, host_ids)
            for call in copier.split("d2h", d2h, part_of, parts):
                copier.run("d2h", call)
            assert all(torch.equal(host[k], want[k]) for k in host), trial


def test_split_refuses_what_it_cannot_cut():
    copier, other = _copier(), _copier()
    call = copier.plan("h2d", [[0, 1], [2], [3]])
    with pytest.raises(ValueError, match="split: not a 'h2d' call planned by this BlockCopier"):
        copier.split("h2d", other.plan("h2d", [[0], [1], [2]]), [0, 0, 0], 1)
    with pytest.raises(ValueError, match="not a plan made by this planner"):
        copier._h2d.planner.split(other.plan("h2d", [[0], [1], [2]]), [0, 0, 0], 1)
    with pytest.raises(ValueError, match="split: not a 'd2h' call planned by this BlockCopier"):
        copier.split("d2h", call, [0, 0, 0], 1)
    with pytest.raises(ValueError, match="must be 3 integers"):
        copier.split("h2d", call, [0, 0], 1)
    with pytest.raises(ValueError, match="must be 3 integers"):
        copier.split("h2d", call, [0.0, 0.0, 1.0], 2)
    with pytest.raises(ValueError, match=r"numbered -1 \(none\) to 1"):
        copier.split("h2d", call, [0, 2, 1], 2)
    with pytest.raises(ValueError, match=r"numbered -1 \(none\) to 1"):
        copier.split("h2d", call, [0, -2, 1], 2)


@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_plan_flat_equals_plan_of_the_same_lists(monkeypatch, engine):
    """Ids as flat int64 arrays and per-group counts: the same call array and ids as
    plan() of the lists, and the same refusal naming group, layer and id."""
    if engine == "numpy":
        monkeypatch.setattr(planner, "plan_call_function", lambda: None)
    elif planner.plan_call_function() is None:
        pytest.skip("CPU library not built")
    copier = _copier()
    rng = np.random.default_rng(5)
    refused = accepted = 0
    for trial in range(60):
        lens = rng.integers(0, 4, size=3)
        dev = [rng.permutation(6)[:n].tolist() for n in lens]  # x and y share bytes: may repeat (refused)
        host = [rng.integers(0, 11 if trial % 5 == 0 else 10, size=n).tolist() for n in lens]
        flat = [np.array(sum(ids, []), dtype=np.int64) for ids in (dev, host)]
        for direction in ("d2h", "h2d"):
            try:
                want = copier.plan(direction, dev, host)
            except ValueError as exc:
                with pytest.raises(ValueError, match=re.escape(str(exc))):
                    copier.plan_flat(direction, *flat, lens)
                refused += 1
                continue
            accepted += 1
            got = copier.plan_flat(direction, *flat, lens)
            assert kernel_inputs.call_array(got).tolist() == kernel_inputs.call_array(want).tolist()
            assert (got.src_flat.tolist(), got.dst_flat.tolist(), got.group_lens, got.total_bytes) == \
                (want.src_flat.tolist(), want.dst_flat.tolist(), want.group_lens, want.total_bytes)
    assert refused > 10 and accepted > 10, (refused, accepted)
    ids = np.array([0, 1, 2], dtype=np.int64)
    for bad, exc, match in [((ids.astype(np.int32), ids, [1, 1, 1]), TypeError, "1-D int64 numpy array"),
                            (([0, 1, 2], ids, [1, 1, 1]), TypeError, "1-D int64 numpy array"),
                            ((ids, ids.reshape(3, 1), [1, 1, 1]), TypeError, "1-D int64 numpy array"),
                            ((ids, ids, [1, 2]), ValueError, "lens must be 3 counts"),
                            ((ids, ids, [2, -1, 2]), ValueError, "lens must be 3 counts"),
                            ((ids, ids, [1.0, 1.0, 1.0]), ValueError, "lens must be 3 counts"),
                            ((ids, ids, [1, 1, 2]), ValueError, "lens sum to 4, but 3"),
                            # counts that wrap to 3 in an int64 or uint64 sum: refused before any pass runs
                            ((ids, ids, np.array([2**63 - 1, 2**63 - 1, 5])), ValueError, "lens sum to 18446"),
                            ((ids, ids, np.array([2**63, 2**63, 3], dtype=np.uint64)), ValueError,
                             "lens sum to 18446"),
                            ((ids, ids[:2], [1, 1, 1]), ValueError, "but 3 device and 2 host")]:
        with pytest.raises(exc, match=match):
            copier.plan_flat("d2h", *bad)
