"""``kvcopy-bench calibrate``: measure this GPU's backends per descriptor size and store
the table ``auto`` reads (:mod:`kvcopy.copy_backends.calibration` says how it is used).

Pages of each size from 2 KiB to 2 MiB, every other page copied (no run merges, so one
descriptor is one page), both directions, every GPU backend, plus a contiguous pinned
memcpy of the same bytes.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence



def _time_ms(fn, iters: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def measure(device: int = 0, sizes: Optional[Iterable[int]] = None, backends: Optional[Sequence[str]] = None,
            directions: Sequence[str] = ("h2d", "d2h"), call_bytes: int = 64 << 20, iters: int = 10,
            warmup: int = 3, max_ctas: Optional[int] = None, progress=None) -> dict:
    """GB/s per (direction, descriptor size, backend) on ``device``, plus the pinned
    memcpy of the same bytes. Pages of ``size`` bytes, every other page copied (no run
    merges, so one descriptor is one page), ``call_bytes`` per call, 4 layers."""
    import numpy as np
    import torch

    from .. import BlockCopier, available_copy_backends
    from ..copy_backends.calibration import DEFAULT_SIZES, PREFERENCE

    sizes = DEFAULT_SIZES if sizes is None else sizes
    backends = PREFERENCE if backends is None else backends

    avail = available_copy_backends()
    names = [b for b in backends if avail.get(b) is None]
    out: Dict[str, list] = {d: [] for d in directions}
    layers = 4
    for size in sizes:
        blocks = max(2, call_bytes // (size * layers))
        nb = 2 * blocks
        dev = {f"l{i}": torch.empty((nb, size), dtype=torch.uint8, device=f"cuda:{device}") for i in range(layers)}
        host = {f"l{i}": torch.empty((nb, size), dtype=torch.uint8, pin_memory=True) for i in range(layers)}
        ids: list = [np.arange(0, nb, 2, dtype=np.int64)]  # numpy ids: no per-call list conversion
        nbytes = layers * blocks * size
        flat_d = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        flat_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for direction in directions:
            src, dst = (flat_h, flat_d) if direction == "h2d" else (flat_d, flat_h)
            ref = _time_ms(lambda s=src, d=dst: d.copy_(s, non_blocking=True), iters, warmup)
            gbps: Dict[str, Optional[float]] = {}
            errors: Dict[str, str] = {}
            for name in names:
                try:
                    copier = BlockCopier(dev, host, [list(dev)], copy_backend=name, max_ctas=max_ctas or None)
                    copy = copier.to_device if direction == "h2d" else copier.to_host
                    gbps[name] = nbytes / _time_ms(lambda c=copy, i=ids: c(i), iters, warmup) / 1e6
                    copier.close()
                except (ValueError, RuntimeError) as exc:
                    gbps[name] = None
                    errors[name] = str(exc)[:200]
            row = {"bytes": size, "memcpy_gbps": nbytes / ref / 1e6, "gbps": gbps}
            if errors:
                row["errors"] = errors
            out[direction].append(row)
            if progress:
                progress(direction, row)
        del dev, host, flat_d, flat_h
        torch.cuda.empty_cache()
    return out


HELP = "measure this GPU's backends and store the table auto uses"


def add_args(ap: argparse.ArgumentParser) -> None:
    """The flags of ``kvcopy-bench calibrate`` (kvcopy.bench.cli registers this module)."""
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N, as kvcopy-bench run takes it (a bare N: cuda:N)")
    # No defaults from kvcopy.copy_backends here: importing it imports torch, and --help should not.
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="descriptor sizes in bytes, comma separated (default: 2 KiB, 4 KiB, .. 2 MiB)")
    ap.add_argument("--backends", type=lambda s: s.split(","), default=None,
                    help="GPU backends to measure, comma separated (default: ce,cuda,triton)")
    ap.add_argument("--call-mib", type=int, default=64, help="bytes per timed call (MiB)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per (size, direction, backend)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    ap.add_argument("--output", type=Path, default=None,
                    help="table file (default: the one auto reads, $KVCOPY_CALIBRATION, else "
                         "calibration.json in $XDG_CACHE_HOME/kvcopy or ~/.cache/kvcopy)")
    ap.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")


def run(args: argparse.Namespace) -> int:
    """Measure, print one line per (direction, size) and auto's picks, store the table."""
    import torch

    from ..copy_backends.calibration import device_key, pick, save
    from .args import BenchError, check_device

    if not torch.cuda.is_available():
        print("kvcopy calibrate: no CUDA device; auto uses cpu/torch on the host, nothing to calibrate")
        return 1
    dev = check_device(args.device)
    if dev == "cpu":
        raise BenchError("calibrate measures GPU backends: --device cuda or cuda:N")
    index = int(dev[5:]) if ":" in dev else torch.cuda.current_device()

    def show(direction, row):
        cells = "  ".join(f"{b} {g:6.1f}" if g else f"{b}    n/a" for b, g in row["gbps"].items())
        print(f"{direction} {row['bytes']:>8} B  memcpy {row['memcpy_gbps']:6.1f} GB/s  {cells}", flush=True)

    measured = measure(index, args.sizes, args.backends, call_bytes=args.call_mib << 20,
                       iters=args.iters, warmup=args.warmup, progress=show)
    key = device_key(index)
    for direction, rows in measured.items():
        picks = [f"{r['bytes']}:{pick(direction, r['bytes'], list(r['gbps']), measured)}" for r in rows]
        print(f"auto {direction}: " + " ".join(picks))
    if not args.dry_run:
        print(f"stored for {key} in {save(key, measured, args.output)}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m kvcopy.bench.calibrate``: the same as ``kvcopy-bench calibrate``."""
    from .args import BenchError

    ap = argparse.ArgumentParser(prog="kvcopy-bench calibrate", description=HELP)
    add_args(ap)
    try:
        return run(ap.parse_args(argv))
    except BenchError as exc:
        print(f"kvcopy-bench calibrate: error: {exc}")
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
