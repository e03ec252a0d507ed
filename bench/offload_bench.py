"""KV offloading copies per job: kvcopy's (:mod:`kvcopy.offload`) against vLLM 0.33's CPU
offloading spec on the same blocks, each as a fraction of a memcpy of the same bytes.

    # CPU, in the vLLM environment (vLLM's own worker code is the comparison):
    PYTHONPATH=. VLLM_TARGET_DEVICE=cpu build/venv-vllm/bin/python bench/offload_bench.py \
        [--pages-kib 4,16,28,64] [--layers 32] [--blocks 16] [--repeat 3] [--json FILE]
    # GPU (bench/gpu_check.sh runs it):
    python bench/offload_bench.py --device cuda [...]

A job is what vLLM's scheduler sends its worker: ``blocks`` blocks of one KV cache
group, each block one page of ``page`` bytes in each of ``layers`` layer tensors
(vLLM's canonical ``(blocks, page)`` int8 views, LBHNC), to or from a host chunk per
block (``blocks_per_chunk`` 1). Block ids and chunk ids are a random permutation (no
two adjacent: kvcopy cannot merge pages into longer runs, vLLM never does); the device
blocks of a load differ from the store's. Rows, per page size and direction (store:
device to host; load: back):

* ``memcpy``: one contiguous copy of the job's bytes (host to host on the CPU; pinned
  host to device or back on a GPU): the ceiling on a GPU; on the CPU torch's
  one-thread copy, which kvcopy's CPU backend passes where it streams (non-temporal
  stores in calls above its threshold: the 32 MiB jobs of 64 KiB pages);
* ``kvcopy``, ``kvcopy+sums``: ``OffloadCopier.submit`` (ids checked, one backend call
  for every layer), without and with page checksums (a load's sums compared);
  CPU: ``kvcopy plan``: the job's ids checked and packed, no copy (kvcopy's host cost
  per job, beside ``vllm plan``);
* CPU, with vLLM importable: ``vllm``: vLLM's ``CPUOffloadingWorker`` job (its
  ``transfer_async``: numpy descriptors, one per page and layer) with the batched DMA
  call done by a C loop of ``memcpy`` over its descriptors (compiled here with ``cc``;
  without a compiler, a Python ``memmove`` loop, labelled ``vllm(py)``), as
  :mod:`kvcopy.testing.vllm_offload` runs it; ``vllm plan``: the same job with the
  copy left out (vLLM's host cost per job);
* GPU: ``ce/page`` (kvcopy's copy engines, one descriptor per page: the
  ``cudaMemcpyBatchAsync`` call vLLM's stores make, issued by kvcopy) and
  ``triton/12`` (kvcopy's Triton kernel on 12 CTAs, the grid vLLM's small loads use);
  with a CUDA build of vLLM importable, ``vllm``: vLLM's own ``CPUOffloadingWorker`` on
  the same tensors (its batched copy for stores, its Triton kernel for loads under
  28 KiB pages and 16+ descriptors).

Each row: median time per job over rounds measured side by side
(:func:`kvcopy.bench.timing.measure`, one call of each row per round, CPU rows settled
with 6 untimed calls), GB/s, and ``x memcpy`` = memcpy's median / the row's (1.00: as
fast as the contiguous copy). A GPU job is timed from the current stream to the end of
its work on the copier's stream. Before timing, every kvcopy row's store and load are
checked against :func:`kvcopy.testing.reference.reference_offload_job` on these
tensors. ``--threads`` (default 1) sets torch's and kvcopy's CPU threads.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

_C_LOOP = r"""
#include <stdint.h>
#include <string.h>
void memcpy_batch(const int64_t* src, const int64_t* dst, const int64_t* sizes, int64_t n) {
    for (int64_t i = 0; i < n; ++i) memcpy((void*)(intptr_t)dst[i], (const void*)(intptr_t)src[i], (size_t)sizes[i]);
}
"""


def c_memcpy_batch() -> Optional[Callable]:
    """vLLM's descriptor triples copied by a C loop of memcpy, or None without ``cc``."""
    d = Path(tempfile.mkdtemp(prefix="offload_bench_"))
    (d / "loop.c").write_text(_C_LOOP)
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(d / "loop.so"), str(d / "loop.c")], check=True,
                       capture_output=True, timeout=60)
        lib = ctypes.CDLL(str(d / "loop.so"))
    except (OSError, subprocess.SubprocessError):
        return None
    fn = lib.memcpy_batch
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def batch(src, dst, sizes, is_src_access_order_any=False):
        fn(src.data_ptr(), dst.data_ptr(), sizes.data_ptr(), src.numel())

    return batch


def vllm_available() -> Optional[str]:
    """Why vLLM 0.33 cannot be the comparison here, or None."""
    try:
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed ({exc})"
    if not vllm.__version__.startswith("0.33"):
        return f"vLLM {vllm.__version__} is not 0.33"
    return None


class Setup:
    """The tensors of one page size: ``layers`` device tensors and their host tensors."""

    def __init__(self, torch, device: str, layers: int, blocks: int, page: int, seed: int):
        self.torch, self.device, self.page, self.blocks = torch, device, page, blocks
        num_blocks, num_chunks = 3 * blocks, 2 * blocks
        g = torch.Generator().manual_seed(seed)
        pin = device == "cuda"
        self.dev = [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=g).to(device)
                    for _ in range(layers)]
        self.host = [torch.zeros((num_chunks, page), dtype=torch.int8, pin_memory=pin) for _ in range(layers)]
        self.groups = [[(i, page) for i in range(layers)]]
        rng = np.random.default_rng(seed)
        ids = rng.permutation(num_blocks)
        self.store_ids, self.load_ids = sorted(ids[:blocks].tolist()), ids[blocks:2 * blocks].tolist()
        self.store_ids = rng.permutation(self.store_ids).tolist()
        self.chunks = rng.permutation(num_chunks)[:blocks].tolist()
        self.nbytes = layers * blocks * page
        self.a = torch.empty(self.nbytes, dtype=torch.int8, pin_memory=pin)
        self.b = torch.empty(self.nbytes, dtype=torch.int8, device=device) if pin else torch.empty_like(self.a)

    def job(self, store: bool):
        return ([self.blocks], [0], self.store_ids if store else self.load_ids, self.chunks)

    def memcpy(self, store: bool) -> Callable[[], None]:
        src, dst = (self.b, self.a) if store else (self.a, self.b)
        return lambda: dst.copy_(src, non_blocking=True)


def kvcopy_rows(torch, s: Setup, store: bool, verify: bool) -> Dict[str, Callable[[], None]]:
    from kvcopy.offload import OffloadCopier, OffloadOptions
    from kvcopy.testing.reference import reference_offload_job

    variants = {"kvcopy": {}, "kvcopy+sums": {"checksum": True}}
    if s.device == "cuda":
        variants.update({"ce/page": {"copy_backend": "ce"}, "triton/12": {"copy_backend": "triton", "max_ctas": 12}})
    rows: Dict[str, Callable[[], None]] = {}
    for name, opts in variants.items():
        opts = {"checksum": False, **opts}
        try:
            copier = OffloadCopier(s.dev, s.groups, s.host, 1, OffloadOptions(**opts))
        except ValueError as exc:  # a backend this machine lacks
            print(f"  {name}: not measured ({exc})", flush=True)
            continue
        if verify:
            _check(torch, s, copier, reference_offload_job)
        stream = copier._streams.get("store" if store else "load")
        rows[name] = _job_fn(torch, copier, s, store, stream)
        if name == "kvcopy" and s.device == "cpu":
            rows["kvcopy plan"] = _plan_fn(copier, s, store)
    return rows


def _plan_fn(copier, s: Setup, store: bool) -> Callable[[], None]:
    """What ``submit`` does before its copy: the ids checked and split per copier group, the call planned."""
    job, direction = s.job(store), "d2h" if store else "h2d"

    def plan():
        dev, host, _ = copier.job_ids(*job)
        copier.copier.plan(direction, dev, host)
    return plan


def _job_fn(torch, copier, s: Setup, store: bool, stream) -> Callable[[], None]:
    job = s.job(store)
    count = [0]

    def run():
        count[0] += 1
        copier.submit(count[0], store, *job)
        if stream is not None:  # the timing's end event waits for the job's stream
            torch.cuda.current_stream().wait_stream(stream)
        if count[0] % 64 == 0:
            copier.finished()
    if store:  # a load reads chunks a checksummed store wrote
        return run
    copier.submit(0, True, *s.job(True))
    if stream is not None:
        torch.cuda.synchronize()
    copier.finished()
    return run


def _check(torch, s: Setup, copier, reference) -> None:
    """One store and one load against the reference on clones (the bench's tensors untouched after)."""
    host_before = [h.clone() for h in s.host]
    dev_before = [d.clone() for d in s.dev]
    ref_host = [h.clone() for h in s.host]
    copier.submit(-1, True, *s.job(True))
    reference(s.dev, s.groups, ref_host, 1, True, *s.job(True))
    if s.device == "cuda":
        torch.cuda.synchronize()
    assert all(r.ok for r in copier.finished())
    assert all(torch.equal(a, b) for a, b in zip(s.host, ref_host)), "store bytes differ from the reference"
    ref_dev = [d.clone() for d in s.dev]
    copier.submit(-2, False, *s.job(False))
    reference(ref_dev, s.groups, ref_host, 1, False, *s.job(False))
    if s.device == "cuda":
        torch.cuda.synchronize()
    assert all(r.ok for r in copier.finished())
    assert all(torch.equal(a, b) for a, b in zip(s.dev, ref_dev)), "load bytes differ from the reference"
    for h, b in zip(s.host, host_before):
        h.copy_(b)
    for d, b in zip(s.dev, dev_before):
        d.copy_(b)


def vllm_rows(torch, s: Setup, store: bool, batch: Optional[Callable]) -> Dict[str, Callable[[], None]]:
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, s.page) for t in s.dev],
                           [[_ref(i, s.page) for i in range(len(s.dev))]])
    sizes, starts, dev_ids, chunks = s.job(store)
    gpu = GPULoadStoreSpec(list(dev_ids), group_sizes=sizes, block_indices=starts)
    cpu = CPULoadStoreSpec(list(chunks))
    rows: Dict[str, Callable[[], None]] = {}
    if s.device == "cuda":
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

        w = CPUOffloadingWorker(kv, 1, len(s.host[0]))
        handler = w._store_handler if store else w._load_handler
        count = [0]

        def real():
            count[0] += 1  # vLLM keys its events by job id
            (w.submit_store(count[0], gpu, cpu) if store else w.submit_load(count[0], cpu, gpu))
            torch.cuda.current_stream().wait_stream(handler._transfers[-1].stream)
            w.get_finished()
        rows["vllm"] = real
        return rows
    from kvcopy.testing.vllm_offload import VllmCpuWorker

    for name, fn in (("vllm" if batch else "vllm(py)", batch), ("vllm plan", lambda *a, **k: None)):
        ref = VllmCpuWorker(kv, 1, len(s.host[0]), fn)
        rows[name] = (lambda r=ref: r.store(1, gpu, cpu)) if store else (lambda r=ref: r.load(1, cpu, gpu))
    return rows


def _ref(i: int, page: int):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef

    return CanonicalKVCacheRef(i, page)


def measure_size(torch, args, page: int, batch, why_not_vllm) -> List[dict]:
    from kvcopy.bench.timing import measure

    s = Setup(torch, args.device, args.layers, args.blocks, page, seed=page)
    out = []
    for store in (True, False):
        direction = "store" if store else "load"
        rows: Dict[str, Callable[[], None]] = {"memcpy": s.memcpy(store)}
        rows.update(kvcopy_rows(torch, s, store, verify=store))
        if why_not_vllm is None:
            rows.update(vllm_rows(torch, s, store, batch))
        timings = measure(rows, args.device, args.iters, warmup=2, budget_s=args.budget,
                          settle=6 if args.device == "cpu" else 1)
        base = timings["memcpy"].stats()["median_us"]
        for name, t in timings.items():
            st = t.stats()
            med = st["median_us"]
            out.append({"page_bytes": page, "direction": direction, "method": name, "bytes": s.nbytes,
                        "median_us": med, "p10_us": st["p10_us"], "p90_us": st["p90_us"], "spread": st["spread"],
                        "gbps": s.nbytes / med / 1e3, "x_memcpy": base / med})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--pages-kib", default="4,16,28,64", help="page sizes per block and layer, KiB")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per job")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per row and size at most")
    ap.add_argument("--repeat", type=int, default=1, help="whole runs, one after the other")
    ap.add_argument("--threads", type=int, default=1, help="torch and kvcopy CPU threads")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args(argv)
    os.environ["KVCOPY_CPU_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    why_not_vllm = vllm_available()
    batch = c_memcpy_batch() if args.device == "cpu" and why_not_vllm is None else None
    print(f"offload_bench: {args.device}, {args.layers} layers x {args.blocks} blocks per job, {args.threads} "
          f"thread(s); vLLM rows: {why_not_vllm or 'yes'}"
          + ("" if args.device != "cpu" or why_not_vllm else f"; vLLM descriptors copied by "
             f"{'a C memcpy loop' if batch else 'a Python memmove loop (no cc)'}"), flush=True)
    results: List[dict] = []
    for rep in range(args.repeat):
        for kib in (int(x) for x in args.pages_kib.split(",")):
            rows = measure_size(torch, args, kib * 1024, batch, why_not_vllm)
            for r in rows:
                r["repeat"] = rep
                flag = "  (noisy)" if r["spread"] > 0.25 else ""
                print(f"run {rep} {kib:>3} KiB {r['direction']:<5} {r['method']:<12} {r['median_us']:9.1f} us "
                      f"{r['gbps']:6.2f} GB/s {r['x_memcpy']:5.2f}x memcpy{flag}", flush=True)
            results += rows
            if args.json:  # after every size: a run cut short keeps what it measured
                tmp = Path(args.json + ".tmp")
                tmp.write_text(json.dumps({"device": args.device, "layers": args.layers, "blocks": args.blocks,
                                           "threads": args.threads, "vllm": why_not_vllm or "yes",
                                           "results": results}, indent=1) + "\n")
                os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
