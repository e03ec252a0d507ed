"""Backend ``triton``: the fused Triton kernel, bit-exact against the reference.

CPU: the shared case matrix runs through Triton's interpreter. The ``interpret``
fixture sets ``TRITON_INTERPRET=1`` (and a small grid cap) for the test only; that is
robust to import order because the backend reads the variable when a copier is built
and ``triton_copy.kernels(interpret=True)`` loads an interpreted copy of the kernel
module on demand, whatever triton and the module were imported as earlier in the
session. The kernel is also compiled to PTX and cubin for sm_80 and sm_90 without a
GPU, and one call is checked to launch the kernel exactly once.

GPU (``@pytest.mark.gpu``): pinned and pageable host buffers in both directions, with
and without ``max_ctas``, large chunks, launch and copy counts from the profiler.
"""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from kvcopy import BlockCopier  # noqa: E402
from kvcopy.copy_backends import get_backend  # noqa: E402
from kvcopy.copy_backends import triton_backend as tb  # noqa: E402
from kvcopy.kernels import triton_copy as tc  # noqa: E402
from kvcopy.native import ENTRY_FIELDS  # noqa: E402
from kvcopy.testing import CopyCase, check_copy, prepare_check, standard_cases  # noqa: E402

QUICK = standard_cases(quick=True)
DIRECTIONS = ("d2h", "h2d")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def _copier(case: CopyCase, device="cpu", **kwargs) -> BlockCopier:
    dev, host = case.build(device, "host")
    return BlockCopier(dev, host, case.layer_groups(), copy_backend="triton",
                       block_dim=case.block_dim(), kv_layout=case.kv_layout(), **kwargs)


# ------------------------------------------------------------------ interpreter
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_interpreter_bit_exact(interpret, case, direction):
    check_copy("triton", case, direction)


GRID_CASES = [
    CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48),
    CopyCase(aliasing=True, kv_sharing=2, num_groups=2, layout="kv_first"),
    CopyCase(head_size=7, dtype="uint8", layout="nhd", ids="runs"),
    CopyCase(ids="all", num_groups=2, layout="hnd_view_of_nhd"),
    CopyCase(layout="bhlnc", num_heads=3, ids="runs"),  # converting: 128-byte runs, one dim
    CopyCase(layout="flashinfer_hnd", num_heads=2, head_size=64, ids="runs"),  # 128-byte runs, 3 dims
]


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("case", GRID_CASES, ids=[c.id for c in GRID_CASES])
def test_interpreter_any_grid_and_row_size(interpret, monkeypatch, case, programs):
    """Exactly ``programs`` programs (more than the call has tiles, so some workers get
    no rows) and rows of 16-64 bytes, so every chunk and merged run is cut into several
    rows spread over workers of different programs."""
    monkeypatch.setattr(tc, "grid_size", lambda total, cfg, cap: programs)
    monkeypatch.setattr(tc, "MAX_ROW_BYTES", 16 if case.dtype == "uint8" else 64)
    monkeypatch.setattr(tc, "MIN_ROW_BYTES", 16)
    for direction in DIRECTIONS:
        copier = check_copy("triton", case, direction)
        cfg = copier.tables(direction).backend_state[tb.STATE_KEY].cfg
        assert cfg.row_bytes <= 64
        assert copier.tables(direction).max_run_bytes() > cfg.row_bytes  # chunks really split


def test_interpreter_large_chunks(interpret):
    """64 KiB chunks: 32 rows of 2 KiB per chunk, spread over the workers."""
    case = CopyCase(layout="kv_first", block_size=64, num_heads=8, head_size=64, num_blocks=16,
                    ids="runs", dtype="bf16")
    for direction in DIRECTIONS:
        copier = check_copy("triton", case, direction)
        cfg = copier.tables(direction).backend_state[tb.STATE_KEY].cfg
        assert (cfg.row_bytes, cfg.rows, cfg.word) == (2048, 16, 16)


class _CountingKernel:
    """Stands in for the jitted kernel: counts launches, then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(grid)
            return self.kernel[grid](*args, **kwargs)
        return run


@pytest.mark.parametrize("groups,layers", [(1, 1), (1, 6), (3, 4), (7, 2), (10, 2)])
def test_one_launch_per_call(interpret, monkeypatch, groups, layers):
    mod = tc.kernels(interpret=True)
    counter = _CountingKernel(mod.fused_copy_kernel)
    monkeypatch.setattr(mod, "fused_copy_kernel", counter)
    case = CopyCase(layout="kv_first", num_groups=groups, layers_per_group=layers, num_blocks=64, ids="scattered")
    for direction in DIRECTIONS:
        before = len(counter.launches)
        copier = check_copy("triton", case, direction)
        assert len(counter.launches) - before == 1, f"{direction}: {counter.launches[before:]}"
        dev_ids, host_ids = case.block_ids()
        call = copier.plan(direction, dev_ids, host_ids)
        assert call.num_items >= groups * layers  # every layer of every group, one launch
    # an empty call launches nothing
    copier = _copier(CopyCase(num_groups=groups, layers_per_group=layers, ids="empty"))
    before = len(counter.launches)
    copier.to_host([[] for _ in range(groups)])
    copier.to_device([[] for _ in range(groups)])
    assert len(counter.launches) == before


def test_copier_max_ctas_caps_the_grid(interpret, monkeypatch):
    mod = tc.kernels(interpret=True)
    counter = _CountingKernel(mod.fused_copy_kernel)
    monkeypatch.setattr(mod, "fused_copy_kernel", counter)
    case = CopyCase(layout="nhd", num_groups=2, ids="all", num_blocks=64, block_size=16, num_heads=4)
    dev_ids, host_ids = case.block_ids()
    for cap, expected in ((2, 2), (1, 1), (None, tb.INTERPRETER_MAX_CTAS)):
        copier = _copier(case, max_ctas=cap)
        assert copier.tables("d2h").backend_state[tb.STATE_KEY].max_ctas == expected
        copier.to_host(dev_ids, host_ids)
        assert counter.launches[-1] == (expected,)  # the call has more tiles than that
    for bad, error in ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_ctas"):
            _copier(case, max_ctas=bad)


CALL_CAP_CASES = [
    CopyCase(layout="nhd", num_groups=2, ids="all", num_blocks=64, block_size=16, num_heads=4, dtype="uint8"),
    CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48, dtype="fp32"),
]


@pytest.mark.parametrize("case", CALL_CAP_CASES, ids=[c.id for c in CALL_CAP_CASES])
@pytest.mark.parametrize("cap", [1, 2, 3])
def test_interpreter_a_calls_max_ctas_caps_its_grid_and_copies_exactly(interpret, monkeypatch, case, cap):
    """BlockCopier.to_host/to_device(..., max_ctas=cap): the launch gets ``cap`` programs
    (the copier's own cap is the interpreter's 4, the calls have more tiles), and the
    destination, poisoned first, equals the reference byte for byte; the next call
    without a cap gets the copier's grid again."""
    mod = tc.kernels(interpret=True)
    counter = _CountingKernel(mod.fused_copy_kernel)
    monkeypatch.setattr(mod, "fused_copy_kernel", counter)
    monkeypatch.setattr(tc, "MAX_ROW_BYTES", 16)  # small rows: many tiles per call, so the cap binds
    for direction in DIRECTIONS:
        check = prepare_check("triton", case, direction)
        cfg = check.copier.tables(direction).backend_state[tb.STATE_KEY].cfg
        assert tc.grid_size(check.copier.plan(direction, check.dev_ids, check.host_ids).total_bytes, cfg,
                            tb.INTERPRETER_MAX_CTAS) == tb.INTERPRETER_MAX_CTAS
        check.run(direction, max_ctas=cap)
        assert counter.launches[-1] == (cap,)
        check.assert_matches()
        check.run(direction)
        assert counter.launches[-1] == (tb.INTERPRETER_MAX_CTAS,)


def test_interpreter_a_calls_max_ctas_caps_the_checksum_kernel(interpret, monkeypatch):
    """The same cap on a checksummed call (BlockCopier.run with checksums): its grid is
    the cap, its sums those of the uncapped call, and the copier's own smaller cap holds."""
    mod = tc.kernels(interpret=True)
    counter = _CountingKernel(mod.fused_copy_sums_kernel)
    monkeypatch.setattr(mod, "fused_copy_sums_kernel", counter)
    monkeypatch.setattr(tc, "MAX_ROW_BYTES", 16)
    case = CALL_CAP_CASES[0]
    for copier_cap, call, want in ((None, 2, 2), (None, 3, 3), (1, 3, 1)):
        copier = _copier(case, max_ctas=copier_cap)
        dev_ids, host_ids = case.block_ids()
        plan = copier.plan("d2h", dev_ids, host_ids)
        capped, full = (torch.full((plan.num_blocks,), -1, dtype=torch.int64) for _ in range(2))
        copier.run("d2h", plan, capped, max_ctas=call)
        assert counter.launches[-1] == (want,)
        copier.run("d2h", plan, full)
        assert torch.equal(capped, full)


def test_a_calls_max_ctas_is_checked_before_any_byte_moves(interpret):
    check = prepare_check("triton", CALL_CAP_CASES[0], "d2h")
    before = {n: t.clone() for n, t in check.got[1].items()}
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)):
        with pytest.raises(error, match="max_ctas must be a positive integer"):
            check.run("d2h", max_ctas=bad)
    assert all(torch.equal(before[n], t) for n, t in check.got[1].items())


def test_backend_state_and_release(interpret):
    case = CopyCase(layout="kv_first")
    copier = _copier(case)
    st = copier.tables("h2d").backend_state[tb.STATE_KEY]
    assert st.device.type == "cpu" and st.max_ctas == tb.INTERPRETER_MAX_CTAS and st.pinning is None
    assert tc.is_interpreted(st.mod)
    assert torch.equal(st.entries.view(-1, ENTRY_FIELDS).cpu(), torch.from_numpy(copier.tables("h2d").entries))
    copier.close()
    assert tb.STATE_KEY not in copier.tables("h2d").backend_state


# ------------------------------------------------------------------ host side
def test_launch_config_shapes():
    for word in (1, 2, 4, 8, 16):
        for chunk in (1, 7, 64, 100, 2048, 3000, 4096, 32768, 1 << 21):
            cfg = tc.launch_config(word, chunk, ENTRY_FIELDS)
            assert cfg.row_bytes & (cfg.row_bytes - 1) == 0 and cfg.row_bytes % word == 0
            assert cfg.word % cfg.elem_bytes == 0 and cfg.elem_bytes == min(word, 4)
            assert 1 <= cfg.rows <= tc.MAX_ROWS
            assert cfg.rows * cfg.row_bytes // cfg.elem_bytes <= tc.TILE_ELEMS
    assert tc.launch_config(16, 2048, ENTRY_FIELDS).tile_bytes == 32768  # 16 rows of 2 KiB
    # one kernel from 2 KiB up
    assert tc.launch_config(16, 1 << 21, ENTRY_FIELDS) == tc.launch_config(16, 2048, ENTRY_FIELDS)
    cfg = tc.launch_config(16, 2048, ENTRY_FIELDS)
    assert tc.grid_size(1, cfg, 132) == 1
    assert tc.grid_size(10 * cfg.tile_bytes, cfg, 132) == 10
    assert tc.grid_size(1 << 30, cfg, 16) == 16


def _copier_tables():
    from kvcopy.core.tables import build_tables
    from kvcopy.core.layout import describe

    t = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    layout = describe(t, 0, "NHD")
    return build_tables([[0]], [(t, layout)], [(t.clone(), layout)], ["l0"])


def test_availability_reasons(monkeypatch):
    backend = tb.TritonBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = backend.unavailable_reason()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "TRITON_INTERPRET=1" in reason
    # CPU tensors on both sides need the interpreter
    tables = _copier_tables()
    if torch.cuda.is_available():
        assert "TRITON_INTERPRET" in backend.unsupported_reason(tables)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.unavailable_reason() is None
    assert backend.unsupported_reason(tables) is None
    assert get_backend("triton").name == "triton"


# ------------------------------------------------------------------ compiler
def _compile(cfg: tc.LaunchConfig, capability: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = tc.kernels(interpret=False).fused_copy_kernel
    signature = {"entries": "*i64", "group_offsets": "*i64", "group_entries": "*i64",
                 "call": "*i64", "num_groups": "i32"}
    constexprs = cfg.constexprs()
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": cfg.num_warps, **tc.COMPILE_OPTIONS})


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("word,chunk", [(16, 2048), (8, 4096), (1, 57), (16, 512)],
                         ids=["w16", "w8", "w1", "w16-run512"])
def test_compiles_to_ptx_and_cubin_offline(capability, word, chunk):
    cfg = tc.launch_config(word, chunk, ENTRY_FIELDS)
    compiled = _compile(cfg, capability)
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    assert ".entry fused_copy_kernel" in ptx
    assert len(compiled.asm["cubin"]) > 0
    loads = re.findall(r"ld\.global[^\s]*", ptx)
    stores = re.findall(r"st\.global[^\s]*", ptx)
    if word >= 8:
        # the alignment hints reach codegen: the tile moves as 16- (8-) byte vectors
        vec = ".v4.b32" if word == 16 else ".v2.b32"
        assert any(l.endswith(vec) for l in loads), sorted(set(loads))
        assert any(s.endswith(vec) for s in stores), sorted(set(stores))
    else:
        assert any(l.endswith(".b8") or l.endswith(".u8") for l in loads), sorted(set(loads))


def test_kernel_uses_only_own_helpers():
    """Kernel code may call builtins and this module's jit functions only: standard
    library jit helpers would break the variant of the other kind."""
    src = inspect.getsource(tc)
    body = src[src.index("def _resolve"):src.index("class LaunchConfig")]
    for name in ("tl.sum", "tl.cumsum", "tl.zeros_like", "tl.zeros(", "tl.max(", "tl.min(", "tl.cdiv"):
        assert name not in body, name


# ------------------------------------------------------------------ GPU
@dataclasses.dataclass(frozen=True)
class PinnedCase(CopyCase):
    """The same case with every host buffer in pinned memory (strides kept)."""

    def _tensor(self, nb, device, fill, gen):
        t = super()._tensor(nb, device, fill, gen)
        if t.device.type != "cpu":
            return t
        p = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
        p.copy_(t)
        return p


def _pinned(case: CopyCase) -> PinnedCase:
    return PinnedCase(**dataclasses.asdict(case))


def _check_gpu(monkeypatch, case, direction, max_ctas=None):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    copier = check_copy("triton", case, direction, device="cuda", max_ctas=max_ctas)
    st = copier.tables(direction).backend_state[tb.STATE_KEY]
    if max_ctas is not None:
        assert st.max_ctas == max_ctas
    return copier, st


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_gpu_pinned_host(monkeypatch, case, direction):
    copier, st = _check_gpu(monkeypatch, _pinned(case), direction)
    assert st.pinning.registered == 0  # already pinned: nothing registered
    copier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [1, 16])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", GRID_CASES, ids=[c.id for c in GRID_CASES])
def test_gpu_pinned_host_max_ctas(monkeypatch, case, direction, max_ctas):
    copier, st = _check_gpu(monkeypatch, _pinned(case), direction, max_ctas)
    copier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", QUICK[::3], ids=[c.id for c in QUICK[::3]])
def test_gpu_pageable_host_pinned_in_place(monkeypatch, case, direction):
    copier, st = _check_gpu(monkeypatch, case, direction, 16)
    host = [t for t in copier.tables(direction).src_tensors + copier.tables(direction).dst_tensors
            if t.device.type == "cpu"]
    # the first direction prepared (d2h) registers them, the second finds them pinned
    states = [copier.tables(d).backend_state[tb.STATE_KEY] for d in DIRECTIONS]
    assert sum(s.pinning.registered for s in states) > 0 and all(t.is_pinned() for t in host)
    copier.close()
    assert not any(t.is_pinned() for t in host)


GPU_LARGE = [
    # 2 KiB chunks, many scattered blocks; 32 KiB chunks; 2 MiB chunks (split into 64 rows)
    CopyCase(layout="kv_first", block_size=16, num_heads=1, head_size=64, num_blocks=512, ids="scattered",
             num_groups=3, layers_per_group=4),
    CopyCase(layout="nhd", block_size=16, num_heads=8, head_size=128, num_blocks=96, ids="runs",
             num_groups=6, layers_per_group=3),
    CopyCase(layout="kv_first", block_size=256, num_heads=32, head_size=128, num_blocks=12, ids="runs",
             num_groups=1, layers_per_group=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [None, 16])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", GPU_LARGE, ids=["2KiB", "32KiB", "2MiB"])
def test_gpu_large_chunks(monkeypatch, case, direction, max_ctas):
    copier, _ = _check_gpu(monkeypatch, _pinned(case), direction, max_ctas)
    copier.close()


@pytest.mark.gpu
def test_gpu_one_kernel_one_upload_per_call(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = _pinned(CopyCase(layout="kv_first", num_groups=7, layers_per_group=3, num_blocks=96, ids="scattered"))
    copier = _copier(case, "cuda")
    dev_ids, host_ids = case.block_ids()
    copier.to_device(dev_ids, host_ids)  # compile outside the profile
    copier.to_host(dev_ids, host_ids)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        copier.to_device(dev_ids, host_ids)
        copier.to_host(dev_ids, host_ids)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if "fused_copy_kernel" in n]
    memcpy = [n for n in names if "Memcpy" in n]
    stores = [n for n in names if "store_words" in n]
    assert len(kernels) == 2, names
    # Each call array goes up once: by a store launch when it fits (<= 480 words and
    # libkvcopy_cuda is loaded), else by one HtoD copy from pinned staging.
    upload = copier.tables("h2d").backend_state["triton"].small_upload
    small = sum(1 for d in ("h2d", "d2h")
                if upload is not None and len(copier.plan(d, dev_ids, host_ids).packed) <= upload.max_words)
    assert len(stores) == small and len(memcpy) == 2 - small and all("HtoD" in n for n in memcpy), names
    copier.close()


@pytest.mark.gpu
def test_gpu_runs_on_current_stream(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = _pinned(CopyCase(layout="kv_first", num_groups=2, num_blocks=48, ids="runs"))
    dev, host = case.build("cuda", "device")
    expected = {k: v.clone() for k, v in dev.items()}
    from kvcopy.testing.reference import reference_copy_groups

    groups = case.layer_groups()
    dev_ids, host_ids = case.block_ids()
    reference_copy_groups(host, expected, groups, host_ids, dev_ids, {n: case.block_dim() for g in groups for n in g})
    copier = BlockCopier(dev, host, groups, copy_backend="triton", block_dim=case.block_dim(),
                         kv_layout=case.kv_layout())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copier.to_device(dev_ids, host_ids)
    stream.synchronize()
    for name in dev:
        assert torch.equal(dev[name].view(torch.uint8), expected[name].view(torch.uint8)), name
    copier.close()


@pytest.mark.gpu
def test_graph_capture_is_refused_with_a_clear_error():
    from kvcopy.testing import prepare_check

    c = prepare_check("triton", CopyCase(num_groups=2, layout="kv_first"), "h2d", "cuda")
    c.run("h2d")  # compile and warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured"):
        with torch.cuda.graph(g):
            c.run("h2d")
    c.copier.close()
