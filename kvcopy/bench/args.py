"""Arguments shared by the ``kvcopy-bench`` subcommands: the scenario flags, the
measurement flags of ``run``/``sweep``, and turning them into scenarios and a device.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import List

DEFAULT_CHUNKS = "2K,8K,32K,128K,512K,2M"


class BenchError(Exception):
    """A usage problem reported without a traceback."""


def int_list(text: str) -> List[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_scenario_group(p: argparse.ArgumentParser) -> None:
    from .presets import DTYPE_NAMES, LAYOUT_NAMES, PRESETS

    s = p.add_argument_group("scenario (a preset, then any of these override it)")
    s.add_argument("--preset", choices=list(PRESETS), default="seeds2",
                   help="; ".join(v["help"] for v in PRESETS.values()))
    s.add_argument("--num-layers", type=int, metavar="N", help="layers (every group has them all in the seeds2 "
                   "map; hybrid presets cut them into groups)")
    s.add_argument("--num-groups", type=int_list, metavar="N[,N...]",
                   help="KV cache group counts, one point each (seeds2: 1,2,3,6)")
    s.add_argument("--blocks-per-request", type=int, metavar="N",
                   help="blocks each group moves (hybrid: the full group)")
    s.add_argument("--window-blocks", type=int, metavar="N", help="hybrid presets: blocks a sliding group moves")
    s.add_argument("--block-size", type=int, metavar="TOKENS", help="tokens per block")
    s.add_argument("--num-kv-heads", type=int, metavar="N", help="KV heads per layer")
    s.add_argument("--head-size", type=int, metavar="N", help="elements per head (MLA: latent size)")
    s.add_argument("--dtype", choices=DTYPE_NAMES, help="element type (copies are byte copies)")
    s.add_argument("--layout", choices=LAYOUT_NAMES,
                   help="tensor layout (kvcopy.testing.LAYOUTS); lbnhc .. host_lbnhc are layout-converting pairs")
    s.add_argument("--ids", choices=["random", "contiguous"], help="scattered ids or one run per group")
    s.add_argument("--seed", type=int, default=0, help="seed of the block ids and the random KV bytes")


def add_scenario_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    add_scenario_group(p)
    m = p.add_argument_group("measurement")
    m.add_argument("--direction", choices=["h2d", "d2h", "both"], default="both",
                   help="h2d: host buffer to device cache; d2h: the other way")
    m.add_argument("--backends", default="default",
                   help="comma list of methods: memcpy is always first; baselines vllm, coalesced; "
                        "kvcopy backends torch, cpu, triton, cuda, ce, auto; 'default' (CPU: vllm, "
                        "coalesced, torch, cpu; GPU: all but cpu) or 'all'. Exit 2 when none of them can run")
    m.add_argument("--checksum", action="store_true",
                   help="also time each kvcopy backend (but ce) with checksums on, as a row '<backend>+sum' "
                        "(any backend can be named so in --backends too)")
    m.add_argument("--iters", type=int, metavar="N", help="timed calls per method (default: 200 GPU, 20 CPU)")
    m.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed calls of each method before the rounds (each timed call also follows "
                        "untimed ones of the same method: 6 on the CPU, 1 on a GPU)")
    m.add_argument("--budget", type=float, metavar="S",
                   help="seconds per method per point, untimed calls included, before it leaves the rotation "
                        "(after 5 calls; default 0.75 CPU, 3 GPU): bounds slow methods (the Triton "
                        "interpreter, baselines on a busy machine)")
    m.add_argument("--time-limit", type=float, metavar="S",
                   help="finish within S seconds: --budget shrinks for the points left, and no point is "
                        "started once S have passed (the points left are named). Without it the run aims at "
                        f"{'90' if sweep else '30'} s on a CPU (none on a GPU) by shrinking --budget only, "
                        "and measures every point; 0: no aim")
    m.add_argument("--max-ctas", type=int_list, default=[0], metavar="N[,N...]",
                   help="cap the grid of GPU kernel backends (0: uncapped); several values give a "
                        "row each")
    m.add_argument("--op-counts", action="store_true", help="device ops per call, from torch.profiler")
    m.add_argument("--verify", dest="verify", action="store_true", default=True,
                   help="bit-exact check against the torch reference (default on)")
    m.add_argument("--no-verify", dest="verify", action="store_false", help="skip the bit-exact check")
    m.add_argument("--verify-max-chunk", metavar="SIZE",
                   help="verify only points whose chunk is at most SIZE (e.g. 32K): checking a large "
                        "point reads every destination byte on the host")
    m.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when torch sees one, else cpu)")
    m.add_argument("--threads", type=int, metavar="N",
                   help="torch intra-op threads (torch.set_num_threads) and KVCOPY_CPU_THREADS for the "
                        "cpu backend, for every row, memcpy included. Default on a CPU device: 1 (a call on "
                        "N threads waits for its slowest one: on 2 idle cores the 36 MiB point's spread was "
                        "75-77%% with 2 threads, 4-7%% with 1); on a GPU and with 0: torch's default")
    m.add_argument("--host-memory", choices=["pinned", "pageable"], default="pinned",
                   help="host buffers on a GPU machine (vLLM allocates pageable ones)")
    m.add_argument("--cache", choices=["warm", "cold-dst", "cold"], default="warm",
                   help="CPU runs: where each timed call finds its bytes. warm: in the caches, after "
                        "untimed calls of the same method; cold-dst: the destination's lines flushed "
                        "from every cache level before each timed call (a serving engine's pack into "
                        "staging or scatter into its KV cache: pages other requests have pushed out); "
                        "cold: the source's too (kvcopy.copy_backends.cpu.flush_caches)")
    if sweep:
        w = p.add_argument_group("sweep")
        w.add_argument("--chunk-sizes", default=DEFAULT_CHUNKS, metavar="SIZE[,SIZE...]",
                       help=f"contiguous chunk sizes (block size is set to match); default {DEFAULT_CHUNKS}")
        w.add_argument("--max-call-bytes", default=None, metavar="SIZE",
                       help="where a call would move more: fewer blocks per group, then fewer layers "
                            "(default 8M CPU, 256M GPU)")
    o = p.add_argument_group("output (nothing is written unless asked; bench/out/ is ignored by git)")
    o.add_argument("--json", metavar="PATH", help="write results as JSON ('-': stdout, table to stderr)")
    o.add_argument("--csv", metavar="PATH", help="write result rows as CSV ('-': stdout)")
    o.add_argument("--plot", metavar="PNG",
                   help="GB/s per method: against chunk size, one panel per direction and group count "
                        "(sweep), or against group count, one panel per direction (run); needs matplotlib "
                        "(the kvcopy[plot] extra), checked before measuring")
    o.add_argument("--overwrite", action="store_true",
                   help="allow --json/--csv/--plot to replace a file git tracks (a committed result)")
    o.add_argument("--quiet", action="store_true", help="no progress bar (stderr)")


def scenarios(args, sweep: bool):
    """The list of scenarios to measure, from the preset and the overrides."""
    from .scenarios import PRESETS
    from .units import parse_size

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
    try:
        sizes = [parse_size(s) for s in args.chunk_sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise BenchError(f"--chunk-sizes: {exc}") from None
    for size in sizes:
        for b in bases:
            try:
                sc = b.with_chunk_bytes(size)
            except ValueError as exc:
                raise BenchError(str(exc)) from None
            out.append(sc.capped(limit))
    return out


def device(args) -> str:
    """``--device`` checked against what torch sees: ``cpu``, ``cuda`` or ``cuda:N``."""
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(dev)


def check_device(dev: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` (or ``N``, meaning ``cuda:N``), checked; else BenchError."""
    import torch

    if dev.isdigit():
        dev = f"cuda:{dev}"
    if dev == "cpu":
        return dev
    if dev != "cuda" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise BenchError(f"--device {dev!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise BenchError(f"--device {dev} but torch sees no CUDA device")
    index = int(dev[5:]) if ":" in dev else 0
    if index >= torch.cuda.device_count():
        raise BenchError(f"--device {dev} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev
