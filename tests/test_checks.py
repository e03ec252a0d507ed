"""kvcopy.checks: every loose input is refused with TypeError/ValueError showing the value,
through the copier and the NIXL manager (the planner's token counts), nothing written."""
import numpy as np
import pytest
import torch

import kvcopy
from kvcopy.checks import block_ids, integer, per_group_counts, seconds

BAD_IDS = {  # value -> (exception, text the message must show)
    "python bool": ([1, True], TypeError, "True"),
    "python bools only": ([True, False], TypeError, "True"),
    "float": ([1, 2.0], TypeError, "2.0"),
    "nan": ([float("nan")], TypeError, "nan"),
    "string": (["3"], TypeError, "'3'"),
    "None": ([None], TypeError, "None"),
    "nested": ([[1], [2]], ValueError, "[[1], [2]]"),
    "ragged": ([[1], 2], ValueError, "[[1], 2]"),
    "uint64 2**64-1": (np.array([2**64 - 1], dtype=np.uint64), ValueError, "18446744073709551615"),
    "python 2**64-1": ([2**64 - 1], ValueError, "18446744073709551615"),
    "numpy bool": (np.array([True]), TypeError, "bool"),
    "torch bool": (torch.tensor([True]), TypeError, "bool"),
    "float array": (np.array([1.0]), TypeError, "float64"),
    "2-D array": (np.zeros((2, 2), dtype=np.int64), ValueError, "(2, 2)"),
    "a set": ({1, 2}, TypeError, "{1, 2}"),
    "a dict": ({1: 2}, TypeError, "{1: 2}"),
    "a string": ("12", TypeError, "'12'"),
    "bytes": (b"\x01", TypeError, "b'\\x01'"),
    "an int": (5, TypeError, "5"),
    "a generator": ((i for i in [1]), TypeError, "generator"),
}


@pytest.mark.parametrize("name", list(BAD_IDS))
def test_block_ids_refuses(name):
    value, exc, shown = BAD_IDS[name]
    with pytest.raises(exc) as info:
        block_ids(value, "ids")
    assert shown in str(info.value) and "ids" in str(info.value)


def test_block_ids_accepts_ints_of_every_kind():
    for ids in ([1, 2], (3,), [np.int64(4)], np.array([5], dtype=np.uint32), torch.tensor([6]), []):
        out = block_ids(ids, "ids")
        assert out.dtype == np.int64 and out.ndim == 1


@pytest.mark.parametrize("value,exc", [(40.5, TypeError), ("40", TypeError), (True, TypeError), (None, TypeError),
                                       (np.float64(40), TypeError), (torch.tensor(40), TypeError), (-1, ValueError),
                                       (2**70, ValueError), (float("inf"), TypeError)])
def test_integer_refuses(value, exc):
    with pytest.raises(exc, match="num_tokens"):
        integer(value, "num_tokens", minimum=0)


def test_counts_and_seconds():
    assert per_group_counts(16, 2, "c") == [16, 16] and per_group_counts([0, 16], 2, "c") == [0, 16]
    for bad in ("16", [16.0], [True], {0: 16}, [[16]]):
        with pytest.raises((TypeError, ValueError), match="c"):
            per_group_counts(bad, 1 if not isinstance(bad, str) else 2, "c")
    assert seconds(None, "t") is None and seconds(2, "t") == 2.0


# ---------------------------------------------------------------- through the copier
@pytest.fixture
def copier():
    dev = torch.randn(8, 16, 8).to(torch.float16)
    host = torch.zeros(8, 16, 8, dtype=torch.float16)
    with kvcopy.BlockCopier({"a": dev}, {"a": host}, [["a"]]) as c:
        yield c, dev, host


@pytest.mark.parametrize("name", list(BAD_IDS))
def test_copier_refuses_loose_ids_and_writes_nothing(copier, name):
    """Old code: Python bools were copied as blocks 1/0, 2**64-1 wrapped, others raised
    IndexError/OverflowError or worse."""
    c, dev, host = copier
    value, exc, shown = BAD_IDS[name]
    before = host.clone()
    for call in (lambda: c.to_host([value]), lambda: c.to_host([[0]], [value]), lambda: c.plan("d2h", [value])):
        with pytest.raises(exc) as info:
            call()
        assert shown in str(info.value)
    assert torch.equal(host.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("groups", [None, 5, "ab"])
def test_copier_refuses_id_lists_that_are_not_lists(copier, groups):
    c, _, _ = copier
    with pytest.raises(TypeError):
        c.to_host(groups)


# ---------------------------------------------------------------- through the NIXL manager
nixl_testing = pytest.importorskip("kvcopy.testing.nixl.engines")


@pytest.fixture
def pd():
    with nixl_testing.one_torch_thread(), nixl_testing.ManagerPairs() as pairs:
        yield pairs.make("one_group", 48)


LOOSE_PLAN_ARGS = {  # kwargs overriding (remote ids, num_tokens, local ids, cached) -> exception
    "num_tokens 40.5": (dict(n=40.5), TypeError),
    "num_tokens '40'": (dict(n="40"), TypeError),
    "num_tokens True": (dict(n=True), TypeError),
    "num_tokens inf": (dict(n=float("inf")), TypeError),
    "num_tokens 2**70": (dict(n=2**70), ValueError),
    "num_cached '16'": (dict(c="16"), TypeError),
    "num_cached True": (dict(c=True), TypeError),
    "num_cached {0: 16}": (dict(c={0: 16}), TypeError),
    "num_cached [16.0]": (dict(c=[16.0]), TypeError),
    "local bool id": (dict(local=[[2, True, 4]]), TypeError),
    "local uint64 max": (dict(local=[np.array([2, 3, 2**64 - 1], dtype=np.uint64)]), ValueError),
    "remote nested": (dict(remote=[[[1, 2, 3]]]), ValueError),
    "remote None": (dict(remote=None), ValueError),
}


@pytest.mark.parametrize("name", list(LOOSE_PLAN_ARGS))
def test_plan_pull_refuses_loose_arguments(pd, name):
    p, d, peer, pe, de = pd
    kw, exc = LOOSE_PLAN_ARGS[name]
    args = dict(remote=[[1, 2, 3]], n=40, local=[[2, 3, 4]], c=0)
    args.update(kw)
    with pytest.raises(exc):
        d.plan_pull(peer, args["remote"], args["n"], args["local"], args["c"])


@pytest.mark.parametrize("ids", [[[True, 2]], [[[1, 2]]], [np.array([2**64 - 1], dtype=np.uint64)], [[1.0]]])
def test_save_refuses_loose_ids_and_writes_nothing(pd, ids):
    """Old code: save flattened a nested list, took True as block 1 and 2**64-1 as -1."""
    p, d, peer, pe, de = pd
    before = nixl_testing.clone_caches(p.regions.host_views)
    with pytest.raises((TypeError, ValueError)):
        p.save(ids)
    assert nixl_testing.same_bytes(before, p.regions.host_views)


def test_manager_name_and_backends_are_checked():
    eng = nixl_testing.build_case("one_group", 8)
    with pytest.raises(TypeError, match="name"):
        eng.manager(5)
    with pytest.raises(ValueError, match="unavailable"):
        eng.manager("Xbackends", backends=("NO_SUCH_BACKEND",))
