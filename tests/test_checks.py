"""kvcopy.checks: every loose input is refused with TypeError/ValueError showing the value,
through the copier and the NIXL manager (the planner's token counts), nothing written."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy import checks
from kvcopy.checks import block_ids, integer, per_group_counts, seconds

ROOT = Path(__file__).resolve().parents[1]

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
nixl_oracle = pytest.importorskip("kvcopy.testing.nixl.oracle")


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
    "remote None": (dict(remote=None), TypeError),
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
    before = nixl_oracle.clone_caches(p.regions.host_views)
    with pytest.raises((TypeError, ValueError)):
        p.save(ids)
    assert nixl_oracle.same_bytes(before, p.regions.host_views)


def test_manager_name_and_transports_are_checked():
    eng = nixl_testing.build_case("one_group", 8)
    with pytest.raises(TypeError, match="name"):
        eng.manager(5)
    with pytest.raises(ValueError, match="unavailable"):
        eng.manager("Xtransports", transports=("NO_SUCH_BACKEND",))
    for bad in ("UCX", (), ("UCX", ""), (b"UCX",)):
        with pytest.raises(TypeError, match="transports"):
            eng.manager("Xtransports", transports=bad)


# ---------------------------------------------------------------- id lists of every kind, one validator
from kvcopy.checks import block_id_lists  # noqa: E402

NOT_LISTS = {  # an outer "one list per group" or one group's ids that is not a list
    "a set of lists": ({(1, 2)}, TypeError),
    "dict.values()": ({0: [1, 2]}.values(), TypeError),
    "masked array": (np.ma.array([[1, 2]], mask=[[0, 1]]), TypeError),
    "a generator": ((x for x in [[1]]), TypeError),
    "None": (None, TypeError),
    "two groups for one": ([[1], [2]], ValueError),
}


@pytest.mark.parametrize("name", list(NOT_LISTS))
def test_block_id_lists_refuses_what_is_not_one_list_per_group(name):
    value, exc = NOT_LISTS[name]
    with pytest.raises(exc, match="ids"):
        block_id_lists(value, 1, "ids")


def test_block_id_lists_checks_ranges_once():
    assert [a.tolist() for a in block_id_lists([[0, -1, 5], (2,)], 2, "ids", lowest=-1, limits=[6, 3])] == \
        [[0, -1, 5], [2]]
    with pytest.raises(ValueError, match=r"ids, group 0: block id 6 out of range \[0, 6\)"):
        block_id_lists([[6]], 1, "ids", limits=[6])
    with pytest.raises(ValueError, match="ids, group 1: negative block id -2"):
        block_id_lists([[1], [-2]], 2, "ids", lowest=-1)
    with pytest.raises(TypeError, match="masked array"):
        block_id_lists([np.ma.array([1, 2], mask=[0, 1])], 1, "ids")


# ---------------------------------------------------------------- arena mode: the same checks
@pytest.fixture
def arena_pd():
    with nixl_testing.one_torch_thread(), nixl_testing.ManagerPairs() as pairs:
        yield pairs.make("one_group", 48, buffer="arena", arena_bytes=1 << 20)


LOOSE_SAVE_ARGS = {  # save() kwargs overriding (ids, num_tokens, request_id, readers) -> exception
    "num_tokens 50.5": (dict(num_tokens=50.5), TypeError),
    "num_tokens '50'": (dict(num_tokens="50"), TypeError),
    "num_tokens np.float64": (dict(num_tokens=np.float64(50)), TypeError),
    "num_tokens True": (dict(num_tokens=True), TypeError),
    "num_tokens inf": (dict(num_tokens=float("inf")), TypeError),
    "num_tokens 1e400": (dict(num_tokens=1e400), TypeError),
    "num_tokens -1": (dict(num_tokens=-1), ValueError),
    "num_tokens 2**70": (dict(num_tokens=2**70), ValueError),
    "readers 1.5": (dict(readers=1.5), TypeError),
    "readers 0": (dict(readers=0), ValueError),
    "readers True": (dict(readers=True), TypeError),
    "request_id ''": (dict(request_id=""), ValueError),
    "request_id b''": (dict(request_id=b""), ValueError),
    "request_id 5": (dict(request_id=5), TypeError),
    "request_id not latin-1": (dict(request_id="\u4e2d"), ValueError),
    "request_id too long": (dict(request_id="r" * 5000), ValueError),
    "ids bool": (dict(ids=[[True, 2]]), TypeError),
    "ids nested": (dict(ids=[[[1, 2]]]), ValueError),
    "ids 2-D": (dict(ids=[np.zeros((1, 2), np.int64)]), ValueError),
    "ids set": (dict(ids=[{1, 2}]), TypeError),
    "ids dict.values()": (dict(ids=[{0: 1, 1: 2}.values()]), TypeError),
    "ids masked": (dict(ids=[np.ma.array([1, 2], mask=[0, 1])]), TypeError),
    "ids uint64 max": (dict(ids=[np.array([1, 2**64 - 1], np.uint64)]), ValueError),
    "ids float": (dict(ids=[[1.0, 2]]), TypeError),
    "ids out of range": (dict(ids=[[1, 48]]), ValueError),
}


@pytest.mark.parametrize("name", list(LOOSE_SAVE_ARGS))
def test_arena_save_refuses_loose_arguments_and_stages_nothing(arena_pd, name):
    """Old code: int(num_tokens) truncated 50.5, True staged block 1, 2**64-1 became a
    hole, readers=1.5 and request_id='' were taken, 2-D ids were flattened, sets,
    dict views and masked arrays read in hash order or with the mask ignored."""
    p, d, peer, pe, de = arena_pd
    kw, exc = LOOSE_SAVE_ARGS[name]
    args = dict(ids=[[1, 2, 3, 4]], num_tokens=50, request_id="r", readers=1)
    args.update(kw)
    before = p.arena.buffer.clone()
    with pytest.raises(exc):
        p.save(args.pop("ids"), **args)
    assert p.stats()["spans"] == 0 and p.stats()["failed_allocations"] == 0
    assert torch.equal(p.arena.buffer, before)


@pytest.mark.parametrize("num_tokens", [10**8, 10**12])
def test_arena_save_of_more_tokens_than_the_arena_holds_raises_arena_full_at_once(arena_pd, num_tokens):
    """Old code built per-token arrays first: 10**8 tokens spent seconds before its
    ArenaFull, 10**12 raised MemoryError. Nothing proportional to the token count is
    built before the span is sized (peak traced memory bounds it, not a timer)."""
    import tracemalloc

    from kvcopy.nixl import ArenaFull

    p, d, peer, pe, de = arena_pd
    tracemalloc.start()
    try:
        with pytest.raises(ArenaFull, match="more than the whole arena") as info:
            p.save([[1, 2, 3]], num_tokens=num_tokens, request_id="huge")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.ever_fits is False and peak < 1 << 20
    assert p.stats()["spans"] == 0 and p.stats()["failed_allocations"] == 1


LOOSE_ARENA_PLAN_ARGS = {  # plan_pull overrides of (num_tokens, local ids, cached) -> exception
    "num_tokens 40.5": (dict(n=40.5), TypeError),
    "num_tokens '40'": (dict(n="40"), TypeError),
    "num_tokens np.float64": (dict(n=np.float64(40)), TypeError),
    "num_tokens inf": (dict(n=float("inf")), TypeError),
    "local bool": (dict(local=[[2, True, 4]]), TypeError),
    "local nested": (dict(local=[[[2, 3, 4]]]), ValueError),
    "local 2-D": (dict(local=[np.array([[2, 3, 4]])]), ValueError),
    "local set": (dict(local=[{2, 3, 4}]), TypeError),
    "local masked": (dict(local=[np.ma.array([2, 3, 4], mask=[0, 0, 1])]), TypeError),
    "local uint64 max": (dict(local=[np.array([2, 3, 2**64 - 1], np.uint64)]), ValueError),
    "local too few blocks": (dict(local=[[2, 3]]), ValueError),
    "local out of range": (dict(local=[[2, 3, 48]]), ValueError),
    "cached '16'": (dict(c="16"), TypeError),
    "cached [16.0]": (dict(c=[16.0]), TypeError),
}


@pytest.mark.parametrize("name", list(LOOSE_ARENA_PLAN_ARGS))
def test_arena_plan_pull_refuses_loose_arguments_and_allocates_nothing(arena_pd, name):
    p, d, peer, pe, de = arena_pd
    record = p.save([[1, 2, 3]], num_tokens=40, request_id="x")
    kw, exc = LOOSE_ARENA_PLAN_ARGS[name]
    args = dict(n=40, local=[[2, 3, 4]], c=0)
    args.update(kw)
    with pytest.raises(exc):
        d.plan_pull(peer, record, args["n"], args["local"], args["c"], request_id="x")
    assert d.stats()["bytes_in_use"] == 0 and d.stats()["spans"] == 0


def test_a_pull_for_more_tokens_than_d_has_blocks_for_raises_naming_both(pd):
    """Old code planned 100 tokens over blocks holding 48, printed "100 tokens" and moved 48."""
    p, d, peer, pe, de = pd
    with pytest.raises(ValueError, match=r"3 block\(s\) of 16 tokens hold 48 tokens; the pull is for 100"):
        d.plan_pull(peer, [[1, 2, 3, 4, 5, 6, 7]], 100, [[2, 3, 4]])
    plan = d.plan_pull(peer, [[1, 2, 3, 4, 5, 6, 7]], 100, [[2, 3, 4, 5, 6, 7, 8]])
    assert "100 tokens" in str(plan) and sum(map(len, plan.read_pages)) == 7


@pytest.mark.parametrize("ids", [[{1, 2}], [{0: 1}.values()], [np.ma.array([1, 2], mask=[0, 1])], [[1, 48]]])
def test_host_save_refuses_sets_views_masked_arrays_and_ids_past_the_cache(pd, ids):
    p, d, peer, pe, de = pd
    before = nixl_oracle.clone_caches(p.regions.host_views)
    with pytest.raises((TypeError, ValueError)):
        p.save(ids)
    assert nixl_oracle.same_bytes(before, p.regions.host_views)


# ------------------------------------------------------------------ environment variables
@pytest.mark.parametrize("text, want", [("", 7), ("  ", 7), ("12", 12), (" 3 ", 3), ("0", 0)])
def test_env_int_reads_integers_and_defaults_when_unset(monkeypatch, text, want):
    monkeypatch.setenv("KVCOPY_TEST_INT", text)
    assert checks.env_int("KVCOPY_TEST_INT", 7) == want


@pytest.mark.parametrize("text, match", [("abc", "must be an integer, got 'abc'"), ("1.5", "must be an integer"),
                                         ("0x10", "must be an integer"), ("-1", "must be at least 0, got -1")])
def test_env_int_names_the_variable_on_a_bad_value(monkeypatch, text, match):
    monkeypatch.setenv("KVCOPY_TEST_INT", text)
    with pytest.raises(ValueError, match=f"KVCOPY_TEST_INT {match}"):
        checks.env_int("KVCOPY_TEST_INT", 7)


@pytest.mark.parametrize("text, default, want", [("", True, True), ("", False, False), ("1", False, True),
                                                 ("0", True, False)])
def test_env_flag_reads_0_and_1(monkeypatch, text, default, want):
    monkeypatch.setenv("KVCOPY_TEST_FLAG", text)
    assert checks.env_flag("KVCOPY_TEST_FLAG", default) is want


@pytest.mark.parametrize("text", ["yes", "true", "2", "on"])
def test_env_flag_names_the_variable_on_anything_else(monkeypatch, text):
    monkeypatch.setenv("KVCOPY_TEST_FLAG", text)
    with pytest.raises(ValueError, match=f"KVCOPY_TEST_FLAG must be 0 or 1, got '{text}'"):
        checks.env_flag("KVCOPY_TEST_FLAG", False)


@pytest.mark.parametrize("variable, text", [("KVCOPY_MIN_BYTES_PER_WARP", "abc"), ("KVCOPY_CTAS_PER_SM", "-1"),
                                            ("KVCOPY_CTAS_PER_SM", "0")])
def test_a_bad_grid_variable_fails_the_import_naming_it(variable, text):
    """The CUDA grid heuristic's variables are read at import: a bad value stops it there
    with the variable's name, not a bare int() error (or a zero divisor) later."""
    env = {**os.environ, variable: text}
    r = subprocess.run([sys.executable, "-c", "import kvcopy.copy_backends.kernel_inputs"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and f"ValueError: {variable} must be" in r.stderr, r.stderr[-800:]
