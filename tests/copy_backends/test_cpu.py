"""kvcopy.copy_backends.cpu and its library (csrc/cpu_copy.cpp): the item body on the host.

The backend: ``KVCOPY_CPU_THREADS``, CPU tensors only, and the OpenMP path of a call
above 1 MiB bit-exact (the shared case matrix runs every backend in test_copier.py).

The GPU kernel's addressing, run on the CPU: ``kvcopy_cpu_copy_ranges`` cuts a call into
N equal word ranges and walks each with the byte cursor of ``kernels/block_copy.cuh``
exactly as one warp of the fused CUDA kernel walks its range, over the same static
table and per-call array the CUDA backend builds (:mod:`kvcopy.copy_backends.kernel_inputs`).
Range counts from 1 to more ranges than words put range boundaries inside pages,
chunks and merged runs; every shared case, bit-exact.
"""
import ctypes
import platform

import pytest

from kvcopy import copy_backends as backends
from kvcopy.copy_backends import kernel_inputs
from kvcopy import native
from kvcopy.copy_backends import Backend
from kvcopy.native import ENTRY_FIELDS
from kvcopy.testing import CopyCase, check_copy, standard_cases

lib, why = native.load("kvcopy_cpu")
pytestmark = pytest.mark.skipif(lib is None, reason=f"CPU library not built: {why}")


class RangesBackend(Backend):
    """CPU backend walking the call the way the CUDA kernel's warps do."""

    name = "cpu-ranges"

    def __init__(self, num_ranges, word_bytes=None):
        self.num_ranges = num_ranges
        self.word_bytes = word_bytes

    def copy(self, tables, call, max_ctas=None):
        static = kernel_inputs.static_table(tables)
        e, g, ge = tables.num_entries, tables.num_groups, len(tables.group_entries)
        base = static.ctypes.data
        offsets = base + 8 * ENTRY_FIELDS * e
        group_entries = offsets + 8 * (g + 1)
        prefix = group_entries + 8 * ge
        arr = kernel_inputs.call_array(call)
        word = self.word_bytes or tables.word_bytes
        static_tables = native.Tables.make(entries=base, group_offsets=offsets, group_entries=group_entries,
                                           entry_bytes_prefix=prefix, num_groups=g)
        ranges = native.Ranges.make(num_ranges=self.num_ranges, word_bytes=word)
        rc = lib.kvcopy_cpu_copy_ranges(ctypes.addressof(static_tables), arr.ctypes.data, call.total_bytes,
                                        ctypes.addressof(ranges))
        assert rc == 0


@pytest.fixture
def ranges_backend(monkeypatch):
    def make(n, word=None):
        monkeypatch.setitem(backends._REGISTRY, "cpu-ranges", "x:y")
        monkeypatch.setitem(backends._instances, "cpu-ranges", RangesBackend(n, word))
        return "cpu-ranges"
    return make


@pytest.mark.parametrize("num_ranges", [1, 3, 64, 5000])
@pytest.mark.parametrize("case", standard_cases(quick=True), ids=lambda c: c.id)
def test_cursor_ranges_bit_exact(case, num_ranges, ranges_backend):
    name = ranges_backend(num_ranges)
    for direction in ("d2h", "h2d"):
        check_copy(name, case, direction).close()


@pytest.mark.parametrize("word", [1, 2, 4])
def test_cursor_narrow_words(word, ranges_backend):
    name = ranges_backend(7, word)
    case = CopyCase(layout="kv_first", num_groups=3, ids="runs", num_blocks=48)
    check_copy(name, case, "h2d").close()
    check_copy(name, case, "d2h").close()


@pytest.mark.parametrize("num_ranges", [1, 7, 300])
@pytest.mark.parametrize("case", [
    CopyCase(layout="bhlnc", num_heads=3, head_size=256, block_size=4, ids="runs"),  # 4 KiB runs: whole segments
    CopyCase(layout="lbnhc", num_heads=8, head_size=128, block_size=4, ids="scattered"),  # 512 B runs: word by word
    CopyCase(layout="flashinfer_hnd", num_heads=3, head_size=8, ids="runs", dtype="fp8"),  # 8 B runs, 3 dims
], ids=lambda c: c.id + f"-h{c.num_heads}-d{c.head_size}")
def test_cursor_converting_runs_long_and_short(case, num_ranges, ranges_backend):
    """Runs above the kernel's gather threshold (2 KiB) move segment by segment, runs
    below it word by word through Item::byte_address; range cuts land inside runs."""
    name = ranges_backend(num_ranges)
    for direction in ("d2h", "h2d"):
        check_copy(name, case, direction).close()


# ---------------------------------------------------------------- the backend itself
def test_thread_count_comes_from_the_environment(monkeypatch):
    from kvcopy.copy_backends import cpu

    for text, want in (("", 0), ("3", 3), (" 2 ", 2), ("-1", 0)):
        monkeypatch.setenv("KVCOPY_CPU_THREADS", text)
        assert cpu._threads() == want
    monkeypatch.setenv("KVCOPY_CPU_THREADS", "two")
    with pytest.raises(ValueError, match="KVCOPY_CPU_THREADS must be an integer"):
        cpu._threads()


def test_tensors_off_the_host_are_refused():
    from types import SimpleNamespace

    import torch

    from kvcopy.copy_backends.cpu import CpuBackend

    cpu, meta = torch.device("cpu"), torch.device("meta")
    backend = CpuBackend()
    assert backend.unsupported_reason(SimpleNamespace(src_device=cpu, dst_device=cpu)) is None
    for src, dst in ((meta, cpu), (cpu, torch.device("cuda", 0))):
        assert "needs CPU tensors on both sides" in backend.unsupported_reason(
            SimpleNamespace(src_device=src, dst_device=dst))


def test_flush_caches_leaves_the_bytes_and_checks_its_arguments():
    """kvcopy-bench --cache: the flush writes lines back, so every byte, dirty ones
    included, reads back unchanged; a view flushes its whole storage (an unaligned start
    and a length that ends mid-line too); off-host tensors and bad spans are refused."""
    import torch

    from kvcopy.copy_backends.cpu import flush_caches

    flush = lib.kvcopy_cpu_flush
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    want = t.clone()
    t[1::4097] ^= 0x5A  # dirty lines, written just before the flush
    want[1::4097] ^= 0x5A
    assert flush_caches(t[13:1000]) == (platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"))
    assert torch.equal(t, want)
    assert flush(t.data_ptr() + 5, 123) in (0, 1) and torch.equal(t, want)
    assert flush(None, 0) in (0, 1)
    # The flush stays inside its span's lines: with the page after the span unmapped
    # for access (a flush there faults), a span ending at the page's last byte, a
    # one-byte span there, and a whole page.
    import mmap
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    ctypes.memset(base, 0x3C, page)
    try:
        for start, n in ((page - 1, 1), (0, page), (13, page - 13), (page - 64, 64)):
            assert flush(base + start, n) in (0, 1)
        assert ctypes.string_at(base, page) == b"\x3c" * page
    finally:
        libc.mprotect(base + page, page, 3)  # PROT_READ | PROT_WRITE: mmap can unmap it

    assert flush(t.data_ptr(), -1) == -1 and flush(None, 64) == -1
    with pytest.raises(ValueError, match="a CPU tensor"):
        flush_caches(torch.empty(4, device="meta"))


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_call_above_a_mebibyte_on_openmp_threads_is_bit_exact(threads, monkeypatch):
    """Calls of 1 MiB and more spread their items over OpenMP threads."""
    monkeypatch.setenv("KVCOPY_CPU_THREADS", threads)
    case = CopyCase(layout="kv_first", num_groups=3, ids="scattered", num_blocks=64, head_size=256, block_size=16,
                    num_heads=4)
    copier = check_copy("cpu", case, "d2h")
    assert copier.to_host(case.block_ids()[0], case.block_ids()[1]).total_bytes >= 1 << 20
    copier.close()
    check_copy("cpu", case, "h2d").close()


STREAM_CASES = standard_cases(quick=True) + [
    # runs of 3,216 and 3,360 bytes: destinations off a 16-byte line, so a head, 64-byte
    # steps and a tail; and 1-byte-aligned pages (uint8, odd heads)
    CopyCase(layout="lbnhc", num_heads=4, head_size=128, block_size=8, ids="odd"),
    CopyCase(layout="nhd", dtype="uint8", block_size=16, num_heads=3, head_size=67, ids="runs", num_blocks=32),
    CopyCase(layout="nhd", dtype="uint8", head_size=7, num_heads=1, block_size=3, ids="runs"),
    # 3 MiB a call: above kParallelMinBytes, so on 2 threads the items go to OpenMP
    CopyCase(layout="kv_first", num_groups=3, ids="scattered", num_blocks=64, head_size=256, block_size=16,
             num_heads=4),
]


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("case", STREAM_CASES, ids=[c.id for c in STREAM_CASES])
def test_streaming_stores_are_bit_exact(case, threads, monkeypatch):
    """Calls of at least KVCOPY_CPU_STREAM_BYTES store with non-temporal stores (here
    every call): the head that aligns the destination to 64 bytes, the 64-byte steps and
    the tail of every run, over poisoned destinations; the last case on OpenMP threads."""
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", "1")
    monkeypatch.setenv("KVCOPY_CPU_THREADS", threads)
    for direction in ("d2h", "h2d"):
        check_copy("cpu", case, direction).close()


def test_the_plain_copy_streams_from_the_threshold(monkeypatch):
    """The plain copy passes KVCOPY_CPU_STREAM_BYTES to the library, as the summing copy
    does, and the library streams a call from that many bytes (0: never)."""
    from kvcopy.copy_backends.cpu import CpuBackend

    streams = lib.kvcopy_cpu_copy_streams
    big = 1 << 40
    want = [1, 0, 0, 1, 0] if platform.machine() in ("x86_64", "AMD64") else [0] * 5  # SSE2's loop
    assert [streams(b, m) for b, m in ((big, big), (big - 1, big), (big, 0), (1, 1), (0, 1))] == want

    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", "12345")
    seen = _spy_stream_threshold(monkeypatch, CpuBackend())
    check_copy("cpu", STREAM_CASES[-1], "d2h").close()
    assert seen and all(v == 12345 for v in seen)


def _spy_stream_threshold(monkeypatch, backend) -> list:
    """Install ``backend`` as the ``cpu`` backend; the list it returns collects the
    streaming threshold each plain copy passes to the library."""
    seen = []
    real = backend._lib.kvcopy_cpu_copy

    def spy(*args):  # (tables, tuning, call, total bytes)
        seen.append(native.CpuTuning.from_address(args[1]).stream_min_bytes)
        return real(*args)

    monkeypatch.setattr(backend._lib, "kvcopy_cpu_copy", spy)
    monkeypatch.setitem(backends._instances, "cpu", backend)
    return seen


@pytest.mark.parametrize("vendor, want", [("GenuineIntel", 2 << 20), ("AuthenticAMD", 16 << 20), ("", 16 << 20)])
def test_the_streaming_threshold_defaults_by_cpu_vendor(vendor, want, monkeypatch, tmp_path):
    """Without KVCOPY_CPU_STREAM_BYTES a copier streams from 2 MiB on Intel CPUs and from
    16 MiB on others (what was measured on each: docs/backends.md); the variable, when
    set, wins on every CPU. The vendor comes from cpuinfo's vendor_id line: the first
    processor's fields are read, the file read once."""
    from kvcopy.copy_backends import cpu

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: sse2\n\nprocessor\t: 1\n"
                    "vendor_id\t: other\n" if vendor else "processor\t: 0\nBogoMIPS\t: 50.00\n")
    fields = cpu.cpuinfo(str(info))
    assert fields.get("vendor_id", "") == vendor and fields["processor"] == "0"
    info.unlink()
    assert cpu.cpuinfo(str(info)) is fields  # cached
    assert dict(cpu.cpuinfo(str(tmp_path / "missing"))) == {}

    monkeypatch.setattr(cpu, "cpu_vendor", lambda: vendor)
    monkeypatch.delenv("KVCOPY_CPU_STREAM_BYTES", raising=False)
    assert cpu.default_stream_bytes() == want
    seen = _spy_stream_threshold(monkeypatch, cpu.CpuBackend())
    check_copy("cpu", STREAM_CASES[0], "d2h").close()
    monkeypatch.setenv("KVCOPY_CPU_STREAM_BYTES", "0")
    check_copy("cpu", STREAM_CASES[0], "h2d").close()
    assert seen and seen[0] == want and seen[-1] == 0
