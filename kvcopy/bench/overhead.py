"""``kvcopy-bench overhead``: the host cost of one call, measured without a GPU.

The copier is built on CPU tensors (``copy_backend="cpu"``: tables, planner and ids are
the real ones) and each GPU backend's per-call host path runs over its tables with
the device launch **replaced by a no-op**:

``plan``
    ``BlockCopier.plan``: validation and packing in the native planner, the block
    prefix the ``cuda`` call array needs included.
``cuda stubbed``
    plan + ``kvcopy.copy_backends.cuda.InlineLaunch``: the grid rule, the current device
    and stream getters (stubbed: no device), one ctypes call with
    ``kvcopy_cuda_copy``'s argument types into a C function that does nothing.
``triton stubbed``
    plan + ``kvcopy.copy_backends.triton_backend.SmallCallUpload`` (the call array's upload
    through ``kvcopy_cuda_store_words``, a no-op here) + the grid rule; Triton's own
    Python launcher is not in it, so this is a floor, not the Triton figure.

With ``--real`` on a GPU: ``to_device``/``to_host`` with real launches on real
backends, timed on the host without waiting for the device (a sync every 50 calls,
outside the timing): the host cost per call as an engine sees it.

Median over rounds of the mean per call; rounds alternate the modes so every row
comes from the same seconds. ``--clock thread`` times by the thread's CPU clock instead
of the wall clock: on a shared machine the time this thread waited for a core is not
counted (the host cost itself still varies with what shares the caches).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

from .output import write_file


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--blocks", type=int, default=1, help="blocks per group per call")
    p.add_argument("--backends", default="cuda,triton", help="stubbed per-call paths to measure")
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--real", action="store_true", help="also real launches on the local GPU")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: time.perf_counter; thread: the thread's CPU time (time.thread_time)")
    p.add_argument("--json", metavar="PATH")


def noop_launch(argtypes=None):
    """A C function that does nothing and returns 0, typed as ``kvcopy_cuda_copy`` (or
    ``argtypes``): ctypes converts the same arguments as for the real launch
    (:func:`kvcopy.native.noop_function`)."""
    from .. import native

    return native.noop_function(argtypes or native.CUDA_COPY_ARGS)


def build(layers: int, groups: int, blocks: int, device: str = "cpu", backend: str = "cpu"):
    from ..core.copier import BlockCopier
    from .scenarios import Scenario

    sc = Scenario(name="overhead", num_layers=layers, num_groups=groups, blocks_per_request=blocks, block_size=1)
    point = sc.build(device)
    copier = BlockCopier(point.dev, point.host, point.layer_groups, copy_backend=backend,
                         block_dim=sc.block_dim(), kv_layout=sc.kv_layout())
    return point, copier


def stubbed_modes(copier, backends: List[str]) -> Dict[str, Callable[[], None]]:
    import torch

    from .. import native
    from ..copy_backends.cuda import InlineLaunch
    from ..copy_backends.kernel_inputs import INLINE_WORDS

    ids = copier._bench_ids
    tables = copier.tables("h2d")
    modes: Dict[str, Callable[[], None]] = {"plan": lambda: copier.plan("h2d", ids)}
    if "cuda" in backends:
        path = InlineLaunch.stubbed(tables, noop_launch())

        def cuda():
            if path(copier.plan("h2d", ids)) != 0:
                raise RuntimeError("the call does not fit the kernel parameters")
        modes["cuda stubbed"] = cuda
    if "triton" in backends:
        try:
            from ..kernels import triton_copy
        except ImportError as exc:
            print(f"triton stubbed: skipped ({exc})")
            return modes
        from ..copy_backends.triton_backend import SmallCallUpload

        # the grid rule's cost, any shape
        cfg = triton_copy.launch_config(tables.word_bytes, 2048, native.ENTRY_FIELDS)
        upload = SmallCallUpload(noop_launch(native.CUDA_STORE_ARGS), 0, INLINE_WORDS,
                                 lambda device: 0, lambda n: torch.empty(n, dtype=torch.int64))

        def triton():
            call = copier.plan("h2d", ids)
            if upload(call) is None:
                raise RuntimeError("the call does not fit the store launch's parameters")
            triton_copy.grid_size(call.total_bytes, cfg, 132)
        modes["triton stubbed"] = triton
    return modes


def real_modes(layers: int, groups: int, blocks: int, backends: List[str]):
    import torch

    out, keep = {}, []
    for b in backends:
        point, copier = build(layers, groups, blocks, "cuda", b)
        keep.append((point, copier))
        ids = point.ids
        out[f"{b} real h2d"] = lambda c=copier, ids=ids: c.to_device(ids)
        out[f"{b} real d2h"] = lambda c=copier, ids=ids: c.to_host(ids)
    torch.cuda.synchronize()
    return out, keep


def time_modes(modes: Dict[str, Callable[[], None]], calls: int, rounds: int, sync=None,
               clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    per: Dict[str, List[float]] = {m: [] for m in modes}
    for fn in modes.values():  # warm: first-call work, caches
        for _ in range(min(50, calls)):
            fn()
    for _ in range(rounds):
        for name, fn in modes.items():
            spent = 0.0
            done = 0
            while done < calls:
                n = min(50, calls - done)
                t0 = clock()
                for _ in range(n):
                    fn()
                spent += clock() - t0
                done += n
                if sync is not None:
                    sync()  # outside the timing: the device queue never grows without bound
            per[name].append(spent / calls * 1e6)
    return per


def run(args) -> int:
    from .timing import env_info

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    point, copier = build(args.layers, args.groups, args.blocks)
    copier._bench_ids = point.ids
    modes = stubbed_modes(copier, backends)
    clock = CLOCKS[args.clock]
    per = time_modes(modes, args.calls, args.rounds, clock=clock)
    rows = [dict(backend=name.split()[0], mode=" ".join(name.split()[1:]) or "plan", label=name,
                 median_us=statistics.median(v), min_us=min(v)) for name, v in per.items()]
    keep = []
    if args.real:
        import torch

        real, keep = real_modes(args.layers, args.groups, args.blocks, backends)
        per_real = time_modes(real, max(100, args.calls // 10), args.rounds, sync=torch.cuda.synchronize, clock=clock)
        rows += [dict(backend=name.split()[0], mode=" ".join(name.split()[1:]), label=name,
                      median_us=statistics.median(v), min_us=min(v)) for name, v in per_real.items()]
    entries = copier.tables("h2d").num_entries
    head = (f"kvcopy-bench overhead: host cost per call, {args.layers} layers x {args.groups} groups "
            f"({entries} entries), {args.blocks} block(s)/group; 'stubbed' = the device launch replaced by a "
            f"no-op (no GPU involved); median of {args.rounds} rounds x {args.calls} calls, {args.clock} clock")
    print(head)
    for r in rows:
        print(f"  {r['label']:<22} {r['median_us']:8.2f} us/call  (min {r['min_us']:.2f})")
    if args.json:
        res = {"tool": "kvcopy-bench-overhead", "description": head, "env": env_info("cuda" if args.real else "cpu"),
               "layers": args.layers, "groups": args.groups, "blocks": args.blocks, "entries": entries,
               "clock": args.clock,
               "rows": rows}
        write_file(args.json, json.dumps(res, indent=1, default=str) + "\n")
    for _, c in keep:
        c.close()
    copier.close()
    return 0
