"""kvcopy.offload: offloading jobs against the block-by-block torch reference, bit for bit.

Layouts as vLLM 0.33's CPU offloading makes them: device tensors ``(blocks, page)``
with padded or packed rows, groups sharing tensors (overlaid hybrids) with layer pages
shorter than the row, private host tensors or strided slots of one shared region,
several blocks per chunk and groups starting mid-chunk, chunks past 4 GiB of a host
tensor. The destination is poisoned first (host tensors 0x5A before the stores, device
storages 0x5A before the loads); every byte of every host tensor (store) or device
storage (load) must equal the reference's. The GPU tests (``-m gpu``) run the same jobs on CUDA device tensors and
pinned host memory, asynchronously, on the copier's streams.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcopy.offload import JobResult, OffloadCopier, OffloadOptions
from kvcopy.testing.reference import reference_offload_job


POISON = 0x5A


def _rand(shape, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g).to(device)


class Case:
    """Device storages, their (blocks, page) views and the host tensors of one layout."""

    def __init__(self, kind: str, bpc: int, device: str = "cpu", num_blocks: int = 40, num_chunks: int = 24):
        self.bpc, self.device = bpc, device
        pin = device == "cuda"
        if kind == "one_group":  # 3 layers, one tensor each
            self.storages = [_rand((num_blocks, 512), i, device) for i in range(3)]
            self.tensors = list(self.storages)
            self.groups = [[(0, 512), (1, 512), (2, 512)]]
        elif kind == "overlay":  # two groups on the same two tensors; one group's pages shorter (padded)
            self.storages = [_rand((num_blocks, 768), i, device) for i in range(2)]
            self.tensors = list(self.storages)
            self.groups = [[(0, 768), (1, 768)], [(0, 520), (1, 520)]]
        elif kind == "padded_packed":  # one row per block holding 3 layers, stride > page (packed + padding)
            self.storages = [_rand((num_blocks, 4096), 5, device)]
            self.tensors = [self.storages[0][:, :3000]]
            self.groups = [[(0, 3000)], [(0, 1000)]]
        else:
            raise ValueError(kind)
        rows = [bpc * t.shape[1] for t in self.tensors]
        if kind == "overlay":  # host tensors: slots of one shared region, rows padded (vLLM's mmap layout)
            stride = sum(rows) + 4096 * 2
            self.region = torch.full((num_chunks * stride,), POISON, dtype=torch.int8, pin_memory=pin)
            self.hosts, at = [], 0
            for r in rows:
                self.hosts.append(torch.as_strided(self.region, (num_chunks, r), (stride, 1), at))
                at += r
        else:
            self.hosts = [torch.full((num_chunks, r), POISON, dtype=torch.int8, pin_memory=pin) for r in rows]
        self.num_blocks, self.num_chunks = num_blocks, num_chunks

    def copier(self, **opts) -> OffloadCopier:
        return OffloadCopier(self.tensors, self.groups, self.hosts, self.bpc, OffloadOptions(**opts))

    def host_raws(self):
        return [self.region] if hasattr(self, "region") else self.hosts

    def snapshot(self):
        return [t.clone() for t in self.storages], [t.clone() for t in self.host_raws()]

    def twin(self):
        """The same tensors over clones of every storage (the reference's copy)."""
        dev = [s.clone() for s in self.storages]
        host = [h.clone() for h in self.host_raws()]
        tw = object.__new__(Case)
        tw.__dict__.update(self.__dict__)
        tw.storages = dev
        tw.tensors = [torch.as_strided(dev[self._storage_of(t)], t.shape, t.stride(), t.storage_offset())
                      for t in self.tensors]
        if hasattr(self, "region"):
            tw.region = host[0]
            tw.hosts = [torch.as_strided(host[0], h.shape, h.stride(), h.storage_offset()) for h in self.hosts]
        else:
            tw.hosts = host
        return tw

    def _storage_of(self, t):
        return next(i for i, s in enumerate(self.storages) if s.data_ptr() == t.untyped_storage().data_ptr())

    def reference(self, store, job):
        reference_offload_job(self.tensors, self.groups, self.hosts, self.bpc, store, *job)

    def equal(self, other) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.storages + self.host_raws(),
                                                     other.storages + other.host_raws()))


def _span(n, start, bpc):
    """Chunks a group's ``n`` blocks from block index ``start`` span (none when ``n`` is 0)."""
    return -(-(n + start % bpc) // bpc) if n else 0


def _jobs(case: Case, count: int, seed: int):
    """Random jobs: per group a few blocks from a random position in its first chunk;
    device blocks and chunks distinct across jobs and groups."""
    rng = np.random.default_rng(seed)
    blocks = list(rng.permutation(case.num_blocks))
    chunks = list(rng.permutation(case.num_chunks))
    out = []
    for _ in range(count):
        sizes = [int(rng.integers(0, 4)) for _ in case.groups]
        sizes[int(rng.integers(len(sizes)))] += 1
        starts = [int(rng.integers(0, 9)) for _ in case.groups]
        dev = [int(blocks.pop()) for _ in range(sum(sizes))]
        ch = [int(chunks.pop()) for n, s in zip(sizes, starts) for _ in range(_span(n, s, case.bpc))]
        out.append((sizes, starts, dev, ch))
    return out, blocks


def _finish_all(copier: OffloadCopier, n: int):
    if copier.on_gpu:
        torch.cuda.synchronize()
    done = copier.finished()
    assert len(done) == n and all(isinstance(r, JobResult) for r in done)
    return done


def _roundtrip(kind, bpc, device, checksum=True):
    case = Case(kind, bpc, device)
    ref = case.twin()
    copier = case.copier(checksum=checksum)
    jobs, free = _jobs(case, 4, seed=bpc * 31 + len(kind))
    for i, job in enumerate(jobs):
        copier.submit(i, True, *job)
        ref.reference(True, job)
    stores = _finish_all(copier, len(jobs))
    assert all(r.ok and r.store for r in stores)
    assert case.equal(ref), "host bytes differ from the reference after the stores"
    for s in case.storages + ref.storages:  # poisoned device, the same on both sides
        s.fill_(POISON)
    loads = []
    for i, (sizes, starts, _dev, ch) in enumerate(jobs):
        dst = [int(free.pop()) for _ in range(sum(sizes))]
        copier.submit(100 + i, False, sizes, starts, dst, ch, "expedited" if i % 2 else "load")
        ref.reference(False, (sizes, starts, dst, ch))
        loads.append(100 + i)
    done = _finish_all(copier, len(jobs))
    assert sorted(r.job_id for r in done) == loads and all(r.ok and not r.store for r in done)
    assert case.equal(ref), "device bytes differ from the reference after the loads"
    copier.close()
    return case, done


KINDS = ["one_group", "overlay", "padded_packed"]


@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_stores_and_loads_equal_the_reference(kind, bpc):
    _roundtrip(kind, bpc, "cpu")


def test_checksums_off_moves_the_same_bytes():
    _roundtrip("overlay", 2, "cpu", checksum=False)


def test_a_flipped_host_byte_fails_only_the_load_that_reads_it():
    case = Case("overlay", 2)
    copier = case.copier()
    jobs, free = _jobs(case, 2, seed=3)
    for i, job in enumerate(jobs):
        copier.submit(i, True, *job)
    copier.finished()
    sizes, starts, _, ch = jobs[0]
    g = next(i for i, n in enumerate(sizes) if n)
    first = sum(_span(n, s, 2) for n, s in zip(sizes[:g], starts[:g]))
    idx, nbytes = case.groups[g][1]
    j = starts[g] % 2
    page = case.tensors[idx].shape[1]
    case.hosts[idx][ch[first], j * page + nbytes - 1] ^= 1  # the last byte of the layer's page
    for i, (sizes, starts, _, ch) in enumerate(jobs):
        copier.submit(10 + i, False, sizes, starts, [int(free.pop()) for _ in range(sum(sizes))], ch)
    done = {r.job_id: r for r in copier.finished()}
    assert not done[10].ok and done[10].bad_pages == 1 and done[10].unstored_pages == 0
    assert done[11].ok and done[11].bad_chunks == ()
    assert done[10].bad_chunks == (jobs[0][3][first],)


def test_a_padding_byte_is_not_part_of_any_page():
    case = Case("overlay", 1)
    copier = case.copier()
    # group 1 moves 520 of 768 bytes; its store and load sum those bytes only
    copier.submit(1, True, [0, 1], [0, 0], [3], [4])
    copier.finished()
    case.hosts[0][4, 600] ^= 1
    copier.submit(2, False, [0, 1], [0, 0], [7], [4])
    assert copier.finished()[0].ok


def test_a_sub_block_never_stored_fails_its_load():
    case = Case("one_group", 2)
    copier = case.copier()
    copier.submit(1, True, [1], [0], [3], [5])  # sub-block 0 of chunk 5
    copier.finished()
    copier.submit(2, False, [2], [0], [8, 9], [5])  # sub-blocks 0 and 1
    (r,) = copier.finished()
    assert not r.ok and r.unstored_pages == 1 and r.bad_pages == 0 and r.bad_chunks == (5,)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bit_flipped_anywhere_in_a_stored_chunk_fails_the_load_iff_a_page_holds_it(kind):
    """Each byte of a stored chunk's row in every host tensor, one bit flipped in turn
    (bit ``byte % 8``): the load of that chunk fails with one bad page, naming the
    chunk, when the byte lies in a page of one of the group's layers; a byte no page
    holds (the row's padding past a shorter page, another tensor's row) leaves it ok."""
    case = Case(kind, 2, num_chunks=8)
    g = len(case.groups) - 1  # overlay, padded_packed: the group with the shorter pages
    sizes, starts = [0] * len(case.groups), [0] * len(case.groups)
    sizes[g] = 2
    copier = case.copier()
    copier.submit(1, True, sizes, starts, [3, 4], [5])  # both sub-blocks of chunk 5
    assert copier.finished()[0].ok
    held = {idx: {j * case.tensors[idx].shape[1] + b for j in range(2) for b in range(nbytes)}
            for idx, nbytes in case.groups[g]}
    checked = 0
    for idx, host in enumerate(case.hosts):
        row = host[5]
        for b in range(row.numel()):
            row[b] ^= 1 << (b % 8)
            copier.submit(2, False, sizes, starts, [7, 8], [5])
            (r,) = copier.finished()
            row[b] ^= 1 << (b % 8)
            in_page = b in held.get(idx, ())
            assert (r.ok, r.bad_pages, r.bad_chunks) == ((False, 1, (5,)) if in_page else (True, 0, ())), (idx, b)
            checked += in_page
    assert checked == sum(len(v) for v in held.values())
    copier.close()


def test_chunks_past_4_gib_of_a_host_tensor(tmp_path):
    """vLLM's host tensors hold ``cpu_bytes_to_use`` (64 GiB and more): a chunk's offset
    passes 2^32 bytes. The host tensor here is a sparse file mapped with rows 3 GiB
    apart (chunk 2 starts past 6 GiB; only the pages touched take memory); a store
    and a load across chunks 1 and 2 equal the reference on a compact twin, and a bit
    flipped in chunk 2 fails the load that reads it."""
    page, stride, rows = 4096, (3 << 30) + 4096, 3
    path = tmp_path / "host"
    with open(path, "wb") as f:
        f.truncate((rows - 1) * stride + 2 * page)
    raw = torch.from_file(str(path), shared=True, size=(rows - 1) * stride + 2 * page, dtype=torch.int8)
    host = torch.as_strided(raw, (rows, 2 * page), (stride, 1))
    host.fill_(POISON)
    twin = torch.full((rows, 2 * page), POISON, dtype=torch.int8)
    dev = _rand((8, page), 7)
    ref_dev = dev.clone()
    groups = [[(0, page)]]
    copier = OffloadCopier([dev], groups, [host], 2, OffloadOptions())
    job = ([2], [1], [3, 5], [1, 2])  # sub-block 1 of chunk 1, sub-block 0 of chunk 2
    copier.submit(1, True, *job)
    reference_offload_job([ref_dev], groups, [twin], 2, True, *job)
    assert copier.finished()[0].ok
    assert torch.equal(host, twin)
    dev.fill_(POISON)
    ref_dev.fill_(POISON)
    load = ([2], [1], [6, 7], [1, 2])
    copier.submit(2, False, *load)
    reference_offload_job([ref_dev], groups, [twin], 2, False, *load)
    assert copier.finished()[0].ok
    assert torch.equal(dev, ref_dev)
    host[2, 100] ^= 1
    copier.submit(3, False, *load)
    (r,) = copier.finished()
    assert not r.ok and r.bad_pages == 1 and r.bad_chunks == (2,)
    copier.close()


def test_a_backend_that_cannot_sum_is_refused_at_build_with_checksums_on(monkeypatch):
    from kvcopy import copy_backends as backends

    case = Case("one_group", 1)
    monkeypatch.setattr(type(backends.get_backend("cpu")), "checksum_reason", lambda self, tables: "it cannot")
    with pytest.raises(ValueError, match="kvcopy.checksum is on but it cannot"):
        case.copier(copy_backend="cpu")
    case.copier(copy_backend="cpu", checksum=False).close()


@pytest.mark.parametrize("sizes,starts,dev,chunks", [
    ([2], [0], [1], [0]),  # one device id short
    ([2], [1], [1, 2], [0]),  # blocks 1..2 of a 2-block chunk span two chunks
    ([1, 0], [0, 0], [1], [0]),  # two groups named, the caches have one
    ([1], [0], [1], [99]),  # a chunk out of range
    ([2], [0], [1, 1], [0]),  # one device block twice
])
def test_bad_jobs_raise_before_any_byte_moves(sizes, starts, dev, chunks):
    case = Case("one_group", 2)
    copier = case.copier()
    before = case.snapshot()
    with pytest.raises(ValueError):
        copier.submit(1, False, sizes, starts, dev, chunks)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], case.storages + case.host_raws()))
    assert copier.finished() == []


def test_bad_geometry_is_refused_at_build():
    case = Case("one_group", 1)
    with pytest.raises(ValueError, match="overlap"):
        OffloadCopier([torch.as_strided(case.storages[0], (40, 512), (256, 1))], [[(0, 512)]], case.hosts[:1], 1,
                      OffloadOptions())
    with pytest.raises(ValueError, match="page of 600 bytes"):
        OffloadCopier(case.tensors[:1], [[(0, 600)]], case.hosts[:1], 1, OffloadOptions())
    with pytest.raises(ValueError, match="host tensor 0"):
        OffloadCopier(case.tensors[:1], [[(0, 512)]], case.hosts[:1], 2, OffloadOptions())
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        OffloadCopier(case.tensors[:1], [[(0, 512)]], case.hosts[:1], 0, OffloadOptions())


@pytest.mark.parametrize("raw,exc,match", [
    ({"checksum": 1}, TypeError, "checksum must be true or false"),
    ({"max_ctas": True}, TypeError, "max_ctas must be a positive integer"),
    ({"max_ctas": 0}, ValueError, "max_ctas must be a positive integer"),
    ({"copy_backend": 3}, TypeError, "copy_backend must be a backend name"),
    ({"copy_backend": ""}, ValueError, "copy_backend must be a backend name"),
    ({"backend": "cpu"}, TypeError, "unexpected keyword argument 'backend'"),
])
def test_bad_options_are_refused(raw, exc, match):
    """(Unknown keys and a value that is no object: kvcopy.vllm.config's parser, tests/vllm.)"""
    with pytest.raises(exc, match=match):
        OffloadOptions(**raw)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_stores_and_loads_equal_the_reference(kind, bpc):
    case, done = _roundtrip(kind, bpc, "cuda")
    assert all(r.seconds > 0 for r in done)


@pytest.mark.gpu
def test_gpu_jobs_wait_for_the_current_stream_and_fail_a_flipped_byte():
    case = Case("overlay", 2, "cuda")
    copier = case.copier()
    jobs, free = _jobs(case, 1, seed=9)
    expected = [s.clone() for s in case.storages]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the store's source is written on another stream, not yet done
        torch.cuda._sleep(50_000_000)
        for s, e in zip(case.storages, expected):
            e.add_(1)
            s.copy_(e)
    torch.cuda.current_stream().wait_stream(side)
    copier.submit(1, True, *jobs[0])
    copier.wait({1})
    (r,) = copier.finished()
    assert r.ok
    ref = Case("overlay", 2)
    ref.storages = [e.cpu() for e in expected]
    ref.tensors = list(ref.storages)
    reference_offload_job(ref.tensors, ref.groups, ref.hosts, 2, True, *jobs[0])
    assert all(torch.equal(a, b) for a, b in zip(case.hosts, ref.hosts))
    sizes, starts, _, ch = jobs[0]
    g = next(i for i, n in enumerate(sizes) if n)
    first = sum(_span(n, s, 2) for n, s in zip(sizes[:g], starts[:g]))
    case.hosts[case.groups[g][0][0]][ch[first], starts[g] % 2 * 768 + 3] ^= 1
    copier.submit(2, False, sizes, starts, [int(free.pop()) for _ in range(sum(sizes))], ch)
    copier.wait({2})
    (r,) = copier.finished()
    assert not r.ok and r.bad_pages == 1
    copier.close()


# ---------------------------------------------------------------- the benchmark script
def run_offload_bench(*args: str) -> str:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, str(root / "bench" / "offload_bench.py"), "--pages-kib", "4", "--layers", "2",
                        "--blocks", "3", "--iters", "3", "--budget", "0.05", *args], capture_output=True, text=True,
                       timeout=300, cwd=root, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout


def test_the_offload_benchmark_times_every_row_side_by_side():
    import re

    out = run_offload_bench()
    for direction in ("store", "load"):
        for method in ("memcpy", "kvcopy", "kvcopy+sums", "kvcopy plan"):
            assert re.search(rf"^run 0 +4 KiB {direction} +{re.escape(method)} +\d+\.\d+ us .* \d\.\d\dx memcpy", out,
                             re.M), (direction, method, out)


# ---------------------------------------------------------------- the vLLM package's version gate
@pytest.mark.parametrize("fake,says", [
    ("fake = types.ModuleType('vllm'); fake.__version__ = '0.32.1'; sys.modules['vllm'] = fake",
     "needs vLLM 0.33.x, found vLLM 0.32.1"),
    ("sys.modules['vllm'] = None", "needs vLLM 0.33.x (pip install 'vllm==0.33.0'); vLLM is not importable"),
])
def test_kvcopy_vllm_offload_names_the_vllm_it_needs(fake, says):
    import subprocess
    import sys
    from pathlib import Path

    code = f"import sys, types\n{fake}\ntry:\n    import kvcopy.vllm.offload\nexcept ImportError as e:\n    print(e)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and f"kvcopy.vllm {says}" in r.stdout, r.stdout + r.stderr


def test_the_job_engine_never_imports_vllm():
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", "import sys, kvcopy.offload; print('vllm' in sys.modules)"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
