"""Arguments shared by the ``kvcopy-bench`` subcommands: the scenario flags, the
measurement flags of ``run``/``sweep``, and turning them into scenarios and a device.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import List

DEFAULT_CHUNKS = "2K,4K,8K,16K,32K,64K,128K,256K,512K,1M,2M"


class BenchError(Exception):
    """A usage problem reported without a traceback."""


def int_list(text: str) -> List[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_scenario_group(p: argparse.ArgumentParser) -> None:
    from .scenarios import PRESETS
    from ..testing import DTYPES, LAYOUTS

    s = p.add_argument_group("scenario (a preset, then any of these override it)")
    s.add_argument("--preset", choices=sorted(PRESETS), default="seeds2",
                   help="; ".join(v["help"] for v in PRESETS.values()))
    s.add_argument("--num-layers", type=int)
    s.add_argument("--num-groups", type=int_list, metavar="N[,N...]",
                   help="KV cache group counts, one run each (seeds/2: 1,2,3,6)")
    s.add_argument("--blocks-per-request", type=int, help="blocks each group moves (hybrid: the full group)")
    s.add_argument("--window-blocks", type=int, help="hybrid presets: blocks a sliding group moves")
    s.add_argument("--block-size", type=int, help="tokens per block")
    s.add_argument("--num-kv-heads", type=int)
    s.add_argument("--head-size", type=int, help="elements per head (MLA: latent size)")
    s.add_argument("--dtype", choices=sorted(DTYPES))
    s.add_argument("--layout", choices=sorted(LAYOUTS))
    s.add_argument("--ids", choices=["random", "contiguous"], help="scattered ids or one run per group")
    s.add_argument("--seed", type=int, default=0)


def add_scenario_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_scenario_group(p)
    m = p.add_argument_group("measurement")
    m.add_argument("--direction", choices=["h2d", "d2h", "both"], default="both")
    m.add_argument("--backends", default="default",
                   help="comma list of methods: memcpy is always first; baselines vllm, coalesced; "
                        "kvcopy backends torch, cpu, triton, cuda, ce, auto; 'default' (CPU: vllm, "
                        "coalesced, torch, cpu; GPU: all but cpu) or 'all'")
    m.add_argument("--checksum", action="store_true",
                   help="also time each kvcopy backend (but ce) with checksums on, as a row '<backend>+sum' "
                        "(any backend can be named so in --backends too)")
    m.add_argument("--iters", type=int, help="timed calls per method (default: 200 GPU, 20 CPU)")
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--budget", type=float,
                   help="seconds of timed calls per method per point before it leaves the rotation "
                        "(after 5 calls; default 0.75 CPU, 3 GPU): bounds slow methods (the Triton "
                        "interpreter, baselines on a busy machine)")
    m.add_argument("--time-limit", type=float,
                   help="aim to finish within this many seconds: --budget shrinks for the points left, "
                        "and no new point is built once it has passed (default 30 on CPU, none on GPU; "
                        "0: none)")
    m.add_argument("--max-ctas", type=int_list, default=[0], metavar="N[,N...]",
                   help="cap the grid of GPU kernel backends (0: uncapped); several values give a "
                        "row each")
    m.add_argument("--op-counts", action="store_true", help="device ops per call, from torch.profiler")
    m.add_argument("--verify", dest="verify", action="store_true", default=True,
                   help="bit-exact check against the torch reference (default on)")
    m.add_argument("--no-verify", dest="verify", action="store_false")
    m.add_argument("--verify-max-chunk", metavar="SIZE",
                   help="verify only points whose chunk is at most SIZE (e.g. 32K): checking a large "
                        "point reads every destination byte on the host")
    m.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available)")
    m.add_argument("--threads", type=int,
                   help="torch intra-op threads (torch.set_num_threads) and KVCOPY_CPU_THREADS for the "
                        "cpu backend. Default on a CPU device: 1 when the machine is busy (1-minute load "
                        "average >= half the cores: threads that wait for a descheduled peer make "
                        "timings swing 10x), else torch's default; 0: torch's default always")
    m.add_argument("--host-memory", choices=["pinned", "pageable"], default="pinned",
                   help="host buffers on a GPU machine (vLLM allocates pageable ones)")
    if sweep:
        w = p.add_argument_group("sweep")
        w.add_argument("--chunk-sizes", default=DEFAULT_CHUNKS,
                       help=f"contiguous chunk sizes (block size is set to match); default {DEFAULT_CHUNKS}")
        w.add_argument("--max-call-bytes", default=None,
                       help="fewer blocks per group where a call would move more (default 256M GPU, 32M CPU)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write results as JSON ('-': stdout, table to stderr)")
    o.add_argument("--csv", metavar="PATH", help="write result rows as CSV ('-': stdout)")
    o.add_argument("--plot", metavar="PNG", help="GB/s against chunk size per method (needs matplotlib)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def scenarios(args, sweep: bool):
    """The list of scenarios to measure, from the preset and the overrides."""
    from .scenarios import PRESETS, parse_size

    preset = PRESETS[args.preset]
    base = preset["scenario"]
    over = {k: getattr(args, k) for k in ("num_layers", "blocks_per_request", "window_blocks", "block_size",
                                          "num_kv_heads", "head_size", "dtype", "layout", "ids")
            if getattr(args, k) is not None}
    base = replace(base, seed=args.seed, **over)
    groups = args.num_groups or preset["num_groups"]
    if base.layer_map == "hybrid":
        if args.num_groups:
            raise BenchError(f"preset {args.preset} derives its groups from --num-layers; drop --num-groups")
        bases = [base]
    else:
        if any(g < 1 for g in groups):
            raise BenchError("--num-groups values must be >= 1")
        bases = [replace(base, num_groups=g) for g in groups]
    if not sweep:
        return bases
    limit = args.max_call_bytes
    out = []
    for size in [parse_size(s) for s in args.chunk_sizes.split(",") if s.strip()]:
        for b in bases:
            try:
                sc = b.with_chunk_bytes(size)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            out.append(sc.capped(limit))
    return out


def device(args) -> str:
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA device")
    return dev


def busy() -> bool:
    try:
        return os.getloadavg()[0] >= max(1, (os.cpu_count() or 1) / 2)
    except OSError:
        return False
