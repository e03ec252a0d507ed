"""BlockCopier: the copy contract on every CPU-capable backend, bit-exact."""
from operator import setitem

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy.copy_backends import get_backend
from kvcopy.copy_backends.kernel_inputs import call_array
from kvcopy.core.planner import CallPlanner
from kvcopy.testing.reference import reference_copy_groups
from kvcopy.testing import POISON_BYTE, CopyCase, bytes_equal, check_copy, prepare_check, standard_cases

CPU_BACKENDS = [b for b in ("torch", "cpu") if kvcopy.available_copy_backends()[b] is None]
CASES = standard_cases()


def test_cpu_backend_is_built():
    # CI builds the native library; a silent fallback to torch would hide a broken build.
    assert kvcopy.available_copy_backends()["cpu"] is None, kvcopy.available_copy_backends()["cpu"]


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matches_reference(backend, case, direction):
    check_copy(backend, case, direction)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_check_copy_detects_a_wrong_backend(backend, monkeypatch):
    """The check itself can fail: a backend writing one block off is caught."""
    impl = get_backend(backend)
    original = type(impl).copy

    def off_by_one(self, tables, call, max_ctas=None):
        # Plans are immutable: the same call planned again with its first destination
        # block one further (mod the blocks), by a planner over the same tables.
        blocks = tables.dst_tensors[0].shape[tables.dst_block_dims[0]]
        dst = [ids.tolist() for ids in call.dst_ids]
        dst[0][0] = (dst[0][0] + 1) % blocks
        limits = [(blocks, "-")] * call.num_groups
        planner = CallPlanner(tables, limits, limits, [], ("src", "dst"), ["-"] * call.num_groups, origin=None)
        original(self, tables, planner.plan([ids.tolist() for ids in call.src_ids], dst))

    monkeypatch.setattr(type(impl), "copy", off_by_one)
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_copy(backend, CopyCase(num_groups=2), "d2h")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_calls_max_ctas_is_taken_and_changes_nothing_on_the_host_backends(backend, monkeypatch):
    """BlockCopier.to_host/to_device/run(..., max_ctas=N) on ``cpu``/``torch`` (no grid):
    accepted, handed to the backend, the copy bit-exact over a poisoned destination; a
    bad cap raises before the backend is called."""
    impl = get_backend(backend)
    caps = []
    real = type(impl).copy
    monkeypatch.setattr(type(impl), "copy", lambda self, t, c, max_ctas=None: (caps.append(max_ctas),
                                                                               real(self, t, c, max_ctas))[1])
    for direction in ("d2h", "h2d"):
        for cap in (1, 3, None):
            check = prepare_check(backend, CopyCase(num_groups=3, ids="runs", num_blocks=48), direction)
            check.run(direction, max_ctas=cap)
            check.assert_matches()
            assert caps[-1] == cap
    copier = check.copier
    call = copier.plan("d2h", check.dev_ids, check.host_ids)
    n = len(caps)
    for bad, error in ((0, ValueError), (-3, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_ctas must be a positive integer"):
            copier.run("d2h", call, max_ctas=bad)
    copier.run("d2h", call, max_ctas=np.int64(2))  # numpy integers are integers
    assert caps[n:] == [2]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_backend_call_for_all_groups(backend, monkeypatch):
    case = CopyCase(num_groups=7, layers_per_group=3, num_blocks=48, aliasing=True, kv_sharing=2)
    dev, host = case.build()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend=backend)
    impl = get_backend(backend)
    calls = []
    real = type(impl).copy
    monkeypatch.setattr(type(impl), "copy", lambda self, t, c, max_ctas=None: (calls.append(c), real(self, t, c)))
    ids, _ = case.block_ids()
    call = copier.to_host(ids)
    assert len(calls) == 1
    # 7 groups x 3 layers; aliased layers of different groups stay separate entries.
    assert call.num_items == 3 * call.num_runs > 0
    copier.to_device([[] for _ in range(7)])  # empty call: no backend call
    assert len(calls) == 1


def test_runs_are_merged():
    case = CopyCase(num_groups=2, ids="runs", layout="kv_first")
    dev, host = case.build()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="torch")
    call = copier.plan("d2h", [[3, 4, 5, 9, 10], [20]], [[0, 1, 2, 7, 8], [11]])
    assert call.runs().tolist() == [[3, 0, 3], [9, 7, 2], [20, 11, 1]]
    assert call.num_items == 2 * 2 + 2 * 1
    # ids consecutive on one side only do not merge
    call = copier.plan("d2h", [[3, 4], [5]], [[0, 2], [1]])
    assert call.num_runs == 3


def test_same_bytes_under_two_names_in_one_group_are_copied_once():
    t = torch.randint(0, 255, (8, 4, 2, 8), dtype=torch.uint8)
    h = torch.zeros_like(t)
    copier = kvcopy.BlockCopier({"a": t, "b": t}, {"a": h, "b": h}, [["a", "b"]], copy_backend="cpu")
    assert copier.tables("d2h").num_entries == 1
    copier.to_host([[1, 5]])
    assert torch.equal(h[[1, 5]], t[[1, 5]]) and int(h[[0, 2, 3, 4, 6, 7]].sum()) == 0


def test_auto_picks_cpu_for_cpu_tensors():
    case = CopyCase()
    dev, host = case.build()
    assert kvcopy.BlockCopier(dev, host, case.layer_groups()).copy_backend == "cpu"


def test_backends_report_reasons():
    report = kvcopy.available_copy_backends()
    assert set(report) == set(kvcopy.COPY_BACKENDS)
    assert report["torch"] is None
    for reason in report.values():
        assert reason is None or isinstance(reason, str) and reason
    t = torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown copy backend"):
        kvcopy.BlockCopier({"a": t}, {"a": torch.zeros_like(t)}, [["a"]], copy_backend="nope")


def test_close_is_idempotent_and_blocks_later_calls():
    case = CopyCase()
    dev, host = case.build()
    with kvcopy.BlockCopier(dev, host, case.layer_groups()) as c:
        pass
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.to_host([[0], [1]])


def test_poison_byte_is_not_random_data():
    # check_copy's power rests on the destination being distinguishable.
    dev, host = CopyCase(dtype="uint8").build(poison="host")
    assert all(int((h != POISON_BYTE).sum()) == 0 for h in host.values())
    assert any(int((d != POISON_BYTE).sum()) > 0 for d in dev.values())


# ---------------------------------------------------------------------------------
# Bad input: each raises, naming what is wrong, and no destination byte changes.

def _copier(**kw):
    case = CopyCase(num_groups=2, aliasing=True, kv_sharing=1, **kw)
    dev, host = case.build(poison="host")
    return case, dev, host, kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="cpu")


def _snapshot(d):
    return {k: v.clone() for k, v in d.items()}


BAD_CALLS = [
    ("to_host", ([[0, 1]],), ValueError, "one id list per KV cache group"),
    ("to_host", ([[0, 1], [2]], [[0], [2]]), ValueError, "group 0: 2 device block ids but 1 host"),
    ("to_host", ([[0, 24], [2]],), ValueError,
     r"group 0, layer 'model.layers.0.attn': device block id 24 out of range \[0, 24\)"),
    ("to_host", ([[0, -1], [2]],), ValueError, "block id -1 out of range"),
    ("to_device", ([[0, 5, 5], [2]],), ValueError, "group 0, layer .*block id 5 is written twice"),
    ("to_device", ([[0, 5], [5]],), ValueError, r"groups \[0, 1\] share device storage and both write block id 5"),
    ("to_host", ([[0.5], [1]],), TypeError, "must be integers"),
    ("to_host", ([[[0]], [1]],), ValueError, "flat list"),
]


@pytest.mark.parametrize("method,args,exc,match", BAD_CALLS, ids=[b[3][:30] for b in BAD_CALLS])
def test_bad_call_raises_and_writes_nothing(method, args, exc, match):
    case, dev, host, copier = _copier()
    before_dev, before_host = _snapshot(dev), _snapshot(host)
    with pytest.raises(exc, match=match):
        getattr(copier, method)(*args)
    for k in dev:
        assert bytes_equal(dev[k], before_dev[k]) and bytes_equal(host[k], before_host[k])


def test_host_ids_range_checked_on_host_size():
    case = CopyCase(host_num_blocks=10, num_groups=1)
    dev, host = case.build()
    c = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="cpu")
    with pytest.raises(ValueError, match=r"host block id 10 out of range \[0, 10\)"):
        c.to_host([[20]], [[10]])
    c.to_host([[20]], [[9]])


def _groups_error(dev, host, groups, exc, match, **kw):
    with pytest.raises(exc, match=match):
        kvcopy.BlockCopier(dev, host, groups, **kw)


def test_build_errors():
    t = torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)
    h = torch.zeros_like(t)
    _groups_error({"a": t}, {"a": h}, [["a"], ["a"]], ValueError, "layer 'a' is in group 0 and group 1")
    _groups_error({"a": t}, {"a": h}, [["a", "b"]], ValueError, "group 0, layer 'b': no device tensor")
    _groups_error({"a": t}, {}, [["a"]], ValueError, "group 0, layer 'a': no host tensor")
    _groups_error({"a": t}, {"a": h}, ["a"], TypeError, "sequence of sequences")
    _groups_error({"a": t}, {"a": [1]}, [["a"]], TypeError, "not a tensor")
    _groups_error({"a": t}, {"a": torch.zeros(8, 4, 2, 4, dtype=torch.bfloat16)}, [["a"]],
                  ValueError, "pages differ")
    _groups_error({"a": t}, {"a": torch.zeros(8, 4, 2, 8, dtype=torch.float32)}, [["a"]],
                  ValueError, "element size 2 vs 4")
    # same elements per page, another logical shape: refused, naming both layouts
    _groups_error({"a": t}, {"a": torch.zeros(8, 2, 4, 8, dtype=torch.bfloat16)}, [["a"]], ValueError,
                  r"pages differ: logical page shape \(4, 2, 8\) \(64 elements\) vs \(2, 4, 8\).*"
                  r"blocks_first \(8, 4, 2, 8\) bfloat16.* vs blocks_first \(8, 2, 4, 8\)")
    # the same logical page in another order is a converting copy, not an error
    kvcopy.BlockCopier({"a": t}, {"a": torch.zeros(8, 2, 4, 8, dtype=torch.bfloat16).transpose(1, 2)},
                       [["a"]], copy_backend="torch").close()
    # device tensors that overlap without being the same region
    big = torch.zeros(9, 4, 2, 8, dtype=torch.bfloat16)
    _groups_error({"a": big[:8], "b": big[1:]}, {"a": h, "b": torch.zeros_like(h)}, [["a"], ["b"]],
                  ValueError, "overlap without being the same region")
    # one group writing the same device bytes from two host buffers
    _groups_error({"a": t, "b": t}, {"a": h, "b": torch.zeros_like(h)}, [["a", "b"]],
                  ValueError, "write the same device bytes from different sources")
    _groups_error({"a": t}, {"a": h}, [["a"]], ValueError, "not available|cannot copy", copy_backend="cuda")
    # the old keyword names the new one (NIXL's plugins are "backends" too)
    _groups_error({"a": t}, {"a": h}, [["a"]], TypeError, r"backend= is now copy_backend=", backend="cpu")
    _groups_error({"a": t}, {"a": h}, [["a"]], TypeError, r"unknown option\(s\) \['layers'\]",
                  layers=1)
    # one allocation seen in two element orders by two layers: not one region, refused
    raw = torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)
    _groups_error({"a": raw.permute(0, 2, 1, 3), "b": raw.view(8, 2, 4, 8)},
                  {"a": h.transpose(1, 2), "b": h.transpose(1, 2)},
                  [["a", "b"]], ValueError, "overlap without being the same region|write the same")


@pytest.mark.parametrize("groups", [[], [[]], [[], []]])
def test_no_layer_at_all_is_refused(groups):
    t = torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="names no layer"):
        kvcopy.BlockCopier({"a": t}, {"a": torch.zeros_like(t)}, groups)


@pytest.mark.parametrize("dev_dtype,host_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16),
                                                  (torch.float8_e4m3fn, torch.float8_e5m2)])
def test_a_host_buffer_of_another_float_type_is_refused(dev_dtype, host_dtype):
    """Bytes are copied unconverted: an fp16 buffer for a bf16 cache would hold garbage
    fp16 values, so it is refused (as vLLM's own op refuses it), naming layer and dtypes."""
    t = torch.zeros(8, 4, 2, 8, dtype=dev_dtype)
    h = torch.zeros(8, 4, 2, 8, dtype=host_dtype)
    with pytest.raises(TypeError, match=rf"group 1, layer 'b': device cache is {dev_dtype} but host buffer is "
                                        rf"{host_dtype}.*reinterpret_dtypes=True"):
        kvcopy.BlockCopier({"a": t.clone(), "b": t}, {"a": torch.zeros_like(t), "b": h}, [["a"], ["b"]])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_raw_bytes_or_an_explicit_opt_in_copy_the_bits(backend):
    """A uint8 host buffer for an fp8 cache holds its bits; reinterpret_dtypes=True lets
    two float types of one size exchange bits; either way the bytes match exactly."""
    gen = torch.Generator().manual_seed(5)
    fp8 = torch.randint(0, 256, (8, 4, 2, 8), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    raw = torch.full((8, 4, 2, 8), POISON_BYTE, dtype=torch.uint8)
    kvcopy.BlockCopier({"a": fp8}, {"a": raw}, [["a"]], copy_backend=backend).to_host([[2, 6]])
    assert torch.equal(raw[[2, 6]], fp8[[2, 6]].view(torch.uint8))
    assert bool((raw[[0, 1, 3, 4, 5, 7]] == POISON_BYTE).all())
    bf16 = torch.randn(8, 4, 2, 8, generator=gen).to(torch.bfloat16)
    fp16 = torch.full((8, 4, 2, 8), POISON_BYTE, dtype=torch.uint8).repeat_interleave(2, -1).view(torch.float16)
    kvcopy.BlockCopier({"a": bf16}, {"a": fp16}, [["a"]], copy_backend=backend, reinterpret_dtypes=True).to_host([[3]])
    assert torch.equal(fp16[3].view(torch.int16), bf16[3].view(torch.int16))
    assert bool((fp16[[0, 1, 2, 4, 5, 6, 7]].view(torch.uint8) == POISON_BYTE).all())


def test_int16_host_buffer_for_bf16_cache_is_accepted():
    t = torch.randn(8, 4, 2, 8).to(torch.bfloat16)
    h = torch.zeros(8, 4, 2, 8, dtype=torch.int16)
    kvcopy.BlockCopier({"a": t}, {"a": h}, [["a"]], copy_backend="cpu").to_host([[3]])
    assert torch.equal(h[3], t[3].view(torch.int16))


def test_ids_may_be_numpy_or_cpu_tensors():
    case, dev, host, copier = _copier()
    copier.to_host([np.array([0, 1]), torch.tensor([2, 3])])
    with pytest.raises(TypeError, match="host data"):
        copier.to_host([torch.tensor([0], device="meta"), [1]])


def test_groups_sharing_two_storages_transitively_must_use_disjoint_ids():
    """Groups 2 and 3 share Z, 1 and 3 share Y: group 3 is in both alias classes. A
    duplicate destination block through either storage raises on every path."""
    x, y, z = (torch.zeros(8, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    dev = {"x0": x, "y1": y, "x2": x, "z2": z, "y3": y, "z3": z}
    host = {k: torch.randn(8, 4, 2, 8).to(torch.bfloat16) for k in dev}
    groups = [["x0"], ["y1"], ["x2", "z2"], ["y3", "z3"]]
    for backend in CPU_BACKENDS:
        c = kvcopy.BlockCopier(dev, host, groups, copy_backend=backend)
        for bad in ([[0], [1], [5], [5]], [[0], [5], [2], [5]], [[4], [1], [4], [3]]):
            with pytest.raises(ValueError, match="both write block id"):
                c.to_device(bad)
        assert not any(t.view(torch.int16).any() for t in (x, y, z))
        c.to_device([[0], [1], [2], [3]])
        assert torch.equal(z[3].view(torch.int16), host["z3"][3].view(torch.int16))
        z.zero_(), y.zero_(), x.zero_()


@pytest.mark.gpu
def test_device_caches_on_two_devices_are_refused():
    t = torch.zeros(8, 4, 2, 8)
    with pytest.raises(ValueError, match="several devices"):
        kvcopy.BlockCopier({"a": t, "b": t.cuda()}, {"a": t.clone(), "b": t.clone()}, [["a"], ["b"]])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cross_layer_allocation_per_layer_views(backend):
    """One [NB, L, BS, H, D] allocation, layer l = [:, l]: views interleave block by
    block without sharing a byte; each layer is copied at its own group's blocks."""
    L = 3
    big = torch.randint(-2**15, 2**15, (16, L, 4, 2, 8), dtype=torch.int16).view(torch.bfloat16)
    dev = {f"l{l}": big[:, l] for l in range(L)}
    host = {k: torch.zeros(16, 4, 2, 8, dtype=torch.bfloat16) for k in dev}
    c = kvcopy.BlockCopier(dev, host, [["l0", "l2"], ["l1"]], copy_backend=backend)
    c.to_host([[1, 2], [7]])
    for name, ids in (("l0", [1, 2]), ("l2", [1, 2]), ("l1", [7])):
        assert bytes_equal(host[name][ids], dev[name][ids])
        rest = [b for b in range(16) if b not in ids]
        assert not host[name][rest].view(torch.int16).any()
    # the other way: host -> interleaved device views, other layers' bytes untouched
    before = big.clone()
    for t in host.values():
        t.fill_(3.0)
    c.to_device([[5], [5]])
    expect = before.clone()
    expect[5, :] = 3.0
    assert bytes_equal(big, expect)
    # a view whose pages straddle two blocks' rows (its block i meets layer 0's block
    # i + 1: a collision at different ids) is still refused
    straddling = big.as_strided((15, 8, 2, 8), (L * 64, 16, 8, 1), big.storage_offset() + 2 * 64)
    with pytest.raises(ValueError, match="overlap without being the same region"):
        kvcopy.BlockCopier({"a": big[:, 0], "b": straddling},
                           {"a": host["l0"], "b": torch.zeros(15, 8, 2, 8, dtype=torch.bfloat16)},
                           [["a"], ["b"]], copy_backend=backend)


def test_one_direction_copier_accepts_shared_device_bytes_for_d2h_only():
    BlockCopier = kvcopy.BlockCopier
    shared = torch.arange(16 * 64, dtype=torch.int16).view(16, 4, 2, 8)
    dev = {"x": shared, "y": shared}
    host = {"x": torch.zeros_like(shared), "y": torch.zeros_like(shared)}
    with pytest.raises(ValueError, match="same device bytes from different sources"):
        BlockCopier(dev, host, [["x", "y"]])
    copier = BlockCopier(dev, host, [["x", "y"]], directions=("d2h",))
    copier.to_host([[2, 7]], [[0, 1]])
    assert all(torch.equal(host[k][[0, 1]], shared[[2, 7]]) for k in host)
    assert not any(host[k][2:].any() for k in host)
    with pytest.raises(ValueError, match="built without the 'h2d' direction"):
        copier.to_device([[1]])
    with pytest.raises(ValueError, match="directions must be"):
        BlockCopier(dev, host, [["x"]], directions="d2h")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_planned_call_runs_later_bit_exact_and_only_on_its_copier(backend):
    """``plan`` checks and packs a call, ``run`` copies it as it is: the bytes equal the
    reference (host poisoned first); another copier's or direction's plan is refused."""
    case = CopyCase(num_groups=3, host_ids_differ=True)
    dev, host = case.build()
    want = {n: t.clone() for n, t in host.items()}
    ids, host_ids = case.block_ids()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend=backend)
    other = kvcopy.BlockCopier(dev, {n: t.clone() for n, t in host.items()}, case.layer_groups(), copy_backend=backend)
    same = lambda a, b: all(bytes_equal(a[n], b[n]) for n in a)  # noqa: E731
    call = copier.plan("d2h", ids, host_ids)
    assert same(host, want)  # planning moves nothing: still all poison
    copier.run("d2h", call)
    reference_copy_groups(dev, want, case.layer_groups(), ids, host_ids)
    assert not same(want, {n: torch.full_like(t, POISON_BYTE) for n, t in want.items()})  # bytes moved
    assert same(host, want)
    with pytest.raises(ValueError, match="not a 'h2d' call planned by this BlockCopier"):
        copier.run("h2d", call)
    with pytest.raises(ValueError, match="planned by this BlockCopier"):
        other.run("d2h", call)
    copier.close()
    with pytest.raises(ValueError, match="closed"):
        copier.run("d2h", call)
    other.close()


# ---------------------------------------------------------------- plans cannot be edited
_PLAN_EDITS = {
    **{f"set {name}": (lambda c, name=name: setattr(c, name, 0), AttributeError)
       for name in ("words", "packed", "total_bytes", "num_groups", "origin", "prefix_words", "group_lens",
                    "src_flat", "dst_flat", "num_blocks", "_fields", "anything")},
    "del _fields": (lambda c: delattr(c, "_fields"), AttributeError),
    "packed item": (lambda c: setitem(c.packed, 2 * (c.num_groups + 1) + 1, 10**9), ValueError),
    "packed writeable": (lambda c: setattr(c.packed.flags, "writeable", True), ValueError),
    "packed setflags": (lambda c: c.packed.setflags(write=True), ValueError),
    "run item": (lambda c: setitem(c.runs(), (0, 2), 10**6), ValueError),
    "src ids item": (lambda c: setitem(c.src_ids[0], 0, 10**6), ValueError),
    "dst ids item": (lambda c: setitem(c.dst_ids[0], 0, 10**6), ValueError),
    "src flat item": (lambda c: setitem(c.src_flat, 0, -1), ValueError),
    "words item": (lambda c: setitem(c.words, 0, 1), TypeError),
    "words memoryview": (lambda c: setitem(memoryview(c.words), 0, 1), TypeError),
    "call array item": (lambda c: setitem(call_array(c), -1, 10**9), ValueError),
}


@pytest.mark.parametrize("edit", list(_PLAN_EDITS))
def test_a_plan_cannot_be_edited_before_it_runs(edit):
    """plan() hands out a plan that run() executes without checking the ids again, so
    nothing in it may change: every edit raises, and the plan still copies exactly
    the reference's bytes (old code: the edit went through, and an edited packed array
    reached the copy: heap corruption or SIGSEGV)."""
    case = CopyCase(num_groups=3, host_ids_differ=True)
    dev, host = case.build()
    want = {n: t.clone() for n, t in host.items()}
    ids, host_ids = case.block_ids()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(),
                                copy_backend="cpu" if "cpu" in CPU_BACKENDS else "torch")
    call = copier.plan("d2h", ids, host_ids)
    action, error = _PLAN_EDITS[edit]
    with pytest.raises(error):
        action(call)
    copier.run("d2h", call)
    reference_copy_groups(dev, want, case.layer_groups(), ids, host_ids)
    assert all(bytes_equal(host[n], want[n]) for n in host)
    copier.close()


def test_run_takes_only_the_plans_of_its_own_planner():
    from kvcopy.core.tables import CallPlan

    case = CopyCase(num_groups=2)
    dev, host = case.build()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="torch")
    call = copier.plan("d2h", [[0], [1]])

    class Lookalike:
        num_items, origin = call.num_items, call.origin

    class Sub(CallPlan):
        __slots__ = ()

    sub = object.__new__(Sub)
    for fake in (Lookalike(), sub, None, "plan"):
        with pytest.raises(ValueError, match="planned by this BlockCopier"):
            copier.run("d2h", fake)


def test_one_copier_from_eight_threads_checks_every_call():
    """8 threads share one copier, valid calls mixed with calls that repeat a
    destination block or go out of range at their last id. Every bad call raises,
    every valid one copies (old code: the duplicate check's stamps were shared by the
    threads, and some calls with a duplicate destination were accepted)."""
    import threading

    blocks = 4096
    dev = torch.randint(0, 256, (blocks, 8), dtype=torch.uint8)
    host = torch.zeros(blocks, 8, dtype=torch.uint8)
    copier = kvcopy.BlockCopier({"a": dev}, {"a": host}, [["a"]],
                                copy_backend="cpu" if "cpu" in CPU_BACKENDS else "torch")
    rng = np.random.default_rng(0)
    perms = [rng.permutation(blocks).tolist() for _ in range(8)]
    wrong, errors = [], []

    def work(k: int) -> None:
        good = perms[k]
        duplicate, out_of_range = list(good), list(good)
        duplicate[-1] = duplicate[0]
        out_of_range[-1] = blocks
        try:
            for i in range(600):
                if i % 3 == 0:
                    (copier.to_host if i % 30 == 0 else lambda ids: copier.plan("d2h", ids))([good])
                    continue
                bad = duplicate if i % 3 == 1 else out_of_range
                try:
                    copier.plan("d2h", [bad])
                    wrong.append(f"thread {k}: call {i} accepted")
                except ValueError as exc:
                    if ("written twice" if bad is duplicate else "out of range") not in str(exc):
                        wrong.append(f"thread {k}: {exc}")
        except Exception as exc:  # a valid call refused
            errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not wrong, f"{len(wrong)} of {8 * 400} bad calls misjudged: {wrong[:3]}"
    assert torch.equal(host, dev)
    copier.close()


def test_tables_of_an_unknown_direction_is_a_value_error():
    case = CopyCase(num_groups=1)
    dev, host = case.build()
    copier = kvcopy.BlockCopier(dev, host, case.layer_groups(), copy_backend="torch")
    for bad in ("x", None, 1, "H2D"):
        with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h'"):
            copier.tables(bad)
        with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h'"):
            copier.plan(bad, [[0]])
        with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h'"):
            copier.run(bad, None)


@pytest.mark.parametrize("view,match", [
    (lambda: torch.randn(8, 4, 2, dtype=torch.complex64).conj(), "conj"),
    (lambda: torch._neg_view(torch.randn(8, 4, 2)), "negative-bit"),  # what x.conj().imag is, dense
    (lambda: torch.randn(8, 4, 2, dtype=torch.complex64).conj().imag, "negative-bit"),
])
@pytest.mark.parametrize("side", ["device", "host"])
def test_views_whose_bytes_are_not_their_values_are_refused(view, match, side):
    """A conj() view's bytes are the unconjugated values, a negative-bit view's the
    unnegated ones: copying them as bytes gives values that differ from the tensor's
    (old code: copied, silently wrong)."""
    viewed = view()
    assert viewed.is_conj() or viewed.is_neg()
    plain = torch.zeros(viewed.shape, dtype=viewed.dtype)
    dev, host = (viewed, plain) if side == "device" else (plain, viewed)
    with pytest.raises(TypeError, match=match):
        kvcopy.BlockCopier({"a": dev}, {"a": host}, [["a"]], copy_backend="torch")


def test_nested_tensors_are_a_type_error():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that their API is a prototype
        nested = torch.nested.nested_tensor([torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)])
    with pytest.raises(TypeError, match="nested"):
        kvcopy.BlockCopier({"a": nested}, {"a": torch.zeros(2, 4, 2, 8)}, [["a"]], copy_backend="torch")
    with pytest.raises(TypeError, match="nested"):
        kvcopy.BlockCopier({"a": torch.zeros(2, 4, 2, 8)}, {"a": nested}, [["a"]], copy_backend="torch")
