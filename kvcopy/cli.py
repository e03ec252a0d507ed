"""``kvcopy-bench`` (also ``python -m kvcopy``): the microbenchmark.

    kvcopy-bench                          # seeds/2 scenario, both directions, this device
    kvcopy-bench --preset hybrid7 --op-counts
    kvcopy-bench sweep --max-ctas 16 --json out.json --plot out.png
    kvcopy-bench nixl                     # NIXL pull vs one bulk READ (two agents, UCX)
    kvcopy-bench fuzz --cases 10000       # byte-oracle fuzzer of heterogeneous P/D plans
    kvcopy-bench list                     # presets and which backends run here

Every table starts with a contiguous memcpy of the same bytes (pinned host memory on
a GPU, plain memory on the CPU), measured in the same run, round-robin with the other
rows; each row then gives median and p20/p80 time per request-sync, GB/s, % of that
memcpy, device ops per call (``--op-counts``) and a bit-exact check against the torch
reference with the destination poisoned first (on by default; ``--no-verify``).

Subcommands live in :data:`SUBCOMMANDS`; :func:`register` adds one (a ``calibrate``
command for ``auto`` belongs there) with its own argument parser.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_CHUNKS = "2K,4K,8K,16K,32K,64K,128K,256K,512K,1M,2M"


# ---------------------------------------------------------------------- subcommands
class Subcommand:
    def __init__(self, name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int]):
        self.name, self.help, self.add_args, self.run = name, help, add_args, run

    def parser(self) -> argparse.ArgumentParser:
        prog = "kvcopy-bench" + ("" if self.name == "run" else f" {self.name}")
        p = argparse.ArgumentParser(prog=prog, description=self.help, epilog=_epilog(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_args(p)
        return p


SUBCOMMANDS: Dict[str, Subcommand] = {}


def register(name: str, help: str, add_args, run) -> None:
    """Add a subcommand: ``add_args(parser)`` declares its flags, ``run(args)`` returns
    the exit code."""
    SUBCOMMANDS[name] = Subcommand(name, help, add_args, run)


def _epilog() -> str:
    lines = ["subcommands (the first argument; default: run):"]
    lines += [f"  {s.name:<10} {s.help}" for s in SUBCOMMANDS.values()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"
    if argv and argv[0] == name:
        argv = argv[1:]
    sub = SUBCOMMANDS[name]
    args = sub.parser().parse_args(argv)
    args.argv = [name] + argv
    try:
        return sub.run(args)
    except BenchError as exc:
        print(f"kvcopy-bench: error: {exc}", file=sys.stderr)
        return 2


class BenchError(Exception):
    """A usage problem reported without a traceback."""


# ---------------------------------------------------------------------- arguments
def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _add_scenario_group(p: argparse.ArgumentParser) -> None:
    from .bench_scenarios import PRESETS
    from .testing import DTYPES, LAYOUTS

    s = p.add_argument_group("scenario (a preset, then any of these override it)")
    s.add_argument("--preset", choices=sorted(PRESETS), default="seeds2",
                   help="; ".join(v["help"] for v in PRESETS.values()))
    s.add_argument("--num-layers", type=int)
    s.add_argument("--num-groups", type=_int_list, metavar="N[,N...]",
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


def _add_scenario_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    _add_scenario_group(p)
    m = p.add_argument_group("measurement")
    m.add_argument("--direction", choices=["h2d", "d2h", "both"], default="both")
    m.add_argument("--backends", default="default",
                   help="comma list of methods: memcpy is always first; baselines vllm, coalesced; "
                        "kvcopy backends torch, cpu, triton, cuda, ce, auto; 'default' (CPU: vllm, "
                        "coalesced, torch, cpu; GPU: all but cpu) or 'all'")
    m.add_argument("--iters", type=int, help="timed calls per method (default: 200 GPU, 20 CPU)")
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--budget", type=float,
                   help="seconds of timed calls per method per point before it leaves the rotation "
                        "(after 5 calls; default 0.75 CPU, 3 GPU): bounds slow methods (the Triton "
                        "interpreter, baselines on a busy machine)")
    m.add_argument("--time-limit", type=float,
                   help="aim to finish the timed part within this many seconds by shrinking --budget "
                        "for the points left (default 30 on CPU, none on GPU; 0: none)")
    m.add_argument("--max-ctas", type=_int_list, default=[0], metavar="N[,N...]",
                   help="cap the grid of GPU kernel backends (0: uncapped); several values give a "
                        "row each")
    m.add_argument("--op-counts", action="store_true", help="device ops per call, from torch.profiler")
    m.add_argument("--verify", dest="verify", action="store_true", default=True,
                   help="bit-exact check against the torch reference (default on)")
    m.add_argument("--no-verify", dest="verify", action="store_false")
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


def _scenarios(args, sweep: bool):
    """The list of scenarios to measure, from the preset and the overrides."""
    from .bench_scenarios import PRESETS, parse_size

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


def _device(args) -> str:
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA device")
    return dev


def _busy() -> bool:
    try:
        return os.getloadavg()[0] >= max(1, (os.cpu_count() or 1) / 2)
    except OSError:
        return False


def _methods(args, device: str) -> Tuple[List[str], Dict[str, str]]:
    """(methods to run, skipped method -> reason). memcpy is always first."""
    from .bench_scenarios import BASELINES, KVCOPY_BACKENDS

    gpu = device != "cpu"
    if args.backends in ("default", ""):
        wanted = list(BASELINES) + (["torch", "cuda", "triton", "ce", "auto"] if gpu else ["torch", "cpu"])
    elif args.backends == "all":
        wanted = list(BASELINES) + list(KVCOPY_BACKENDS)
    else:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip() and b.strip() != "memcpy"]
    unknown = [b for b in wanted if b not in BASELINES + KVCOPY_BACKENDS]
    if unknown:
        raise BenchError(f"unknown method(s) {unknown}; known: memcpy, {', '.join(BASELINES + KVCOPY_BACKENDS)}")
    if "triton" in wanted and not gpu and not os.environ.get("TRITON_INTERPRET"):
        # The interpreter runs Triton on CPU tensors; it must be set before triton loads.
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
    from . import available_backends

    avail = available_backends()
    skipped = {}
    out = []
    for b in wanted:
        if b in KVCOPY_BACKENDS and b != "auto" and avail.get(b):
            skipped[b] = avail[b]
        elif b not in out:
            out.append(b)
    return ["memcpy"] + out, skipped


# ---------------------------------------------------------------------- measuring
class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet = total, 0, quiet or total <= 0
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        if self.quiet:
            return
        self.done += 1
        width = 24
        fill = int(width * self.done / self.total)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:5.1f}s {label}")
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120) + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def measure_point(point, direction: str, methods: List[str], args, device: str,
                  skipped: Dict[str, str], budget: Optional[float] = None) -> List[dict]:
    """All rows of one (scenario, direction): memcpy first, then each method."""
    from .bench_timing import measure, op_counts

    sc = point.scenario
    fns: Dict[str, Callable[[], None]] = {}
    meta: Dict[str, dict] = {}
    for m in methods:
        caps = args.max_ctas if (device != "cpu" and m in ("cuda", "triton", "auto")) else [0]
        for cap in caps:
            key = m if not cap else f"{m}@{cap}"
            try:
                fns[key] = point.method(m, direction, cap or None)
            except (ValueError, TypeError, RuntimeError, ImportError) as exc:
                skipped.setdefault(m, f"{type(exc).__name__}: {exc}")
                continue
            meta[key] = {"method": m, "max_ctas": cap or None}
    verify: Dict[str, str] = {}
    if args.verify:
        expected = point.expected(direction)
        for key, fn in fns.items():
            if key == "memcpy":
                verify[key] = "n/a"
                continue
            try:
                err = point.check(fn, direction, expected)
            except Exception as exc:  # a backend that fails at run time: report, do not time it
                err = f"raised {type(exc).__name__}: {exc}"
            verify[key] = "ok" if err is None else f"FAIL: {err}"
        del expected
    raised = [k for k, v in verify.items() if v.startswith("FAIL: raised")]
    for key in raised:  # not timed; still a row, so the failure shows and sets the exit code
        fns.pop(key)
    iters = args.iters or (200 if device != "cpu" else 20)
    base = args.budget if args.budget is not None else (3.0 if device != "cpu" else 0.75)
    budget = base if budget is None else budget
    floor = 5 if budget >= base else 3  # fewer calls when --time-limit bites
    timings = measure(fns, device, iters, args.warmup, budget_s=budget, min_iters=min(floor, iters))
    rows = []
    ref = timings["memcpy"].stats().get("median_us")
    for key, fn in fns.items():
        st = timings[key].stats()
        row = {
            "scenario": sc.name, "groups": len(sc.groups()), "layers": sc.num_layers,
            "chunk_bytes": sc.chunk_bytes(), "block_size": sc.block_size,
            "blocks_per_group": sc.blocks_per_group(), "direction": direction,
            "method": key, "kind": _kind(meta[key]["method"]), "max_ctas": meta[key]["max_ctas"],
            "bytes": point.total_bytes, **st,
        }
        med = st.get("median_us")
        if med:
            row["gbps"] = point.total_bytes / (med * 1e-6) / 1e9
            row["pct_of_memcpy"] = 100.0 * ref / med if ref else None
            row["x_memcpy"] = med / ref if ref else None
        row["verify"] = verify.get(key, "skipped" if not args.verify else "n/a")
        if args.op_counts:
            try:
                counts = op_counts(fn, device)
            except Exception as exc:  # the profiler is best effort
                counts = {"error": f"{type(exc).__name__}: {exc}"}
            row["ops"] = counts
            row["ops_per_call"] = counts.get("total")
            if device == "cpu" and meta[key]["method"] in ("cpu", "auto"):
                row["ops_note"] = "one native C call per copy, not seen by the profiler"
        rows.append(row)
    for key in raised:
        rows.append({"scenario": sc.name, "groups": len(sc.groups()), "layers": sc.num_layers,
                     "chunk_bytes": sc.chunk_bytes(), "block_size": sc.block_size,
                     "blocks_per_group": sc.blocks_per_group(), "direction": direction, "method": key,
                     "kind": _kind(meta[key]["method"]), "max_ctas": meta[key]["max_ctas"],
                     "bytes": point.total_bytes, "iters": 0, "verify": verify[key]})
    return rows


def _kind(method: str) -> str:
    from .bench_scenarios import BASELINES

    return "floor" if method == "memcpy" else "baseline" if method in BASELINES else "kvcopy"


def run_bench(args, sweep: bool) -> dict:
    import torch

    from .bench_scenarios import copier_accepts, fmt_bytes, parse_size
    from .bench_timing import env_info

    device = _device(args)
    notes = []
    threads = args.threads
    if threads is None and device == "cpu" and _busy():
        threads = 1
        notes.append(f"machine busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
                     "1 thread for every method; --threads 0 to keep torch's default")
    if threads:
        torch.set_num_threads(threads)
        os.environ["KVCOPY_CPU_THREADS"] = str(threads)  # read when the cpu backend loads
    if sweep and args.max_call_bytes is None:
        args.max_call_bytes = (256 << 20) if device != "cpu" else (32 << 20)
    elif sweep:
        args.max_call_bytes = parse_size(str(args.max_call_bytes))
    scenarios = _scenarios(args, sweep)
    methods, skipped = _methods(args, device)
    directions = ["h2d", "d2h"] if args.direction == "both" else [args.direction]
    if device != "cpu" and any(args.max_ctas) and not copier_accepts("max_ctas"):
        notes.append("BlockCopier takes no max_ctas in this install: rows marked @N ran uncapped")
    if os.environ.get("TRITON_INTERPRET") and "triton" in methods:
        notes.append("triton runs in the interpreter (TRITON_INTERPRET=1): ~1 ms per program instance")
    rows: List[dict] = []
    result = {
        "tool": "kvcopy-bench",
        "command": "sweep" if sweep else "run",
        "argv": getattr(args, "argv", None),
        "env": env_info(device),
        "scenario": scenarios[0].to_dict() if len(scenarios) == 1 else [s.to_dict() for s in scenarios],
        "description": scenarios[0].describe(
            sorted({len(s.groups()) for s in scenarios}) if not sweep else ()) + (
            f"; swept: chunk {fmt_bytes(min(s.chunk_bytes() for s in scenarios))} to "
            f"{fmt_bytes(max(s.chunk_bytes() for s in scenarios))}, blocks/group down to "
            f"{min(s.blocks_per_request for s in scenarios)} where a call would pass "
            f"{fmt_bytes(args.max_call_bytes)}" if sweep else ""),
        "methods": methods,
        "skipped": skipped,
        "notes": notes,
        "results": rows,
    }
    progress = Progress(len(scenarios) * len(directions), args.quiet or len(scenarios) * len(directions) < 2)
    base_budget = args.budget if args.budget is not None else (3.0 if device != "cpu" else 0.75)
    limit = args.time_limit if args.time_limit is not None else (30.0 if device == "cpu" else 0.0)
    t_start, steps_left = time.perf_counter(), len(scenarios) * len(directions)
    for sc in scenarios:
        point = sc.build(device, pinned=args.host_memory == "pinned")
        try:
            for direction in directions:
                budget = base_budget
                if limit > 0:  # share what is left of the limit among the points left
                    left = max(0.0, limit - (time.perf_counter() - t_start))
                    budget = min(base_budget, left / steps_left / max(1, len(methods)))
                steps_left -= 1
                rows += measure_point(point, direction, methods, args, device, skipped, budget)
                progress.step(f"{len(sc.groups())} groups, chunk {sc.chunk_bytes()} B, {direction}")
                if args.json and args.json != "-" and steps_left:
                    # A checkpoint: a run killed by a timeout still leaves its finished points.
                    _write(args.json, json.dumps(dict(result, partial=True), indent=1, default=str) + "\n")
        finally:
            point.close()
            del point
            if device != "cpu":
                torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------- output
def format_table(result: dict, sweep: bool) -> str:
    from .bench_scenarios import fmt_bytes

    env = result["env"]
    out = io.StringIO()
    where = env.get("gpu") or f"{env['cpu_count']} CPU cores, torch {env['torch']} ({env['torch_threads']} threads)"
    out.write(f"kvcopy-bench {result['command']}  on {env['device']}: {where}\n")
    out.write(f"scenario {result['description']}\n")
    headers = (["chunk"] if sweep else []) + ["groups", "dir", "method", "bytes", "median us", "p20 us",
                                             "p80 us", "GB/s", "% memcpy", "x memcpy", "ops/call", "verify"]
    table = []
    for r in result["results"]:
        ops = r.get("ops_per_call")
        ops_s = "-" if ops is None else f"{ops:g}" + ("+1C" if r.get("ops_note") else "")
        cells = ([fmt_bytes(r["chunk_bytes"])] if sweep else []) + [
            str(r["groups"]), r["direction"], r["method"], fmt_bytes(r["bytes"]),
            _f(r.get("median_us"), 1), _f(r.get("p20_us"), 1), _f(r.get("p80_us"), 1), _f(r.get("gbps"), 2),
            _f(r.get("pct_of_memcpy"), 1), _f(r.get("x_memcpy"), 2), ops_s,
            r["verify"] if len(r["verify"]) < 40 else r["verify"][:37] + "...",
        ]
        table.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in table)) if table else len(h) for i, h in enumerate(headers)]
    left = {"dir", "method", "verify"}

    def line(cells):
        return "  ".join(c.ljust(w) if h in left else c.rjust(w) for c, w, h in zip(cells, widths, headers))

    out.write(line(headers) + "\n")
    prev = None
    for r, cells in zip(result["results"], table):
        key = (r["chunk_bytes"], r["groups"], r["direction"])
        if prev is not None and key != prev:
            out.write("\n" if not sweep or key[0] != prev[0] else "")
        prev = key
        out.write(line(cells) + "\n")
    for name, why in result["skipped"].items():
        out.write(f"skipped {name}: {why}\n")
    for note in result["notes"]:
        out.write(f"note: {note}\n")
    if any(r.get("ops_note") for r in result["results"]):
        out.write("ops/call: on the CPU, torch operators that move bytes (+1C: one native call)\n")
    out.write(summary(result))
    return out.getvalue()


def summary(result: dict) -> str:
    """One line per method: its worst and median ratio to memcpy over all points."""
    by_method: Dict[str, List[float]] = {}
    for r in result["results"]:
        if r["method"] != "memcpy" and r.get("x_memcpy"):
            by_method.setdefault(r["method"], []).append(r["x_memcpy"])
    if not by_method:
        return ""
    lines = ["summary (time / memcpy time of the same bytes, same run):"]
    for m, xs in by_method.items():
        xs.sort()
        lines.append(f"  {m:<12} median {xs[len(xs) // 2]:.2f}x  worst {xs[-1]:.2f}x  best {xs[0]:.2f}x "
                     f"over {len(xs)} point(s)")
    failed = [r for r in result["results"] if r["verify"].startswith("FAIL")]
    lines.append(f"verify: {len(failed)} failure(s)" if failed else "verify: every checked method bit-exact")
    return "\n".join(lines) + "\n"


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


CSV_FIELDS = ["scenario", "groups", "layers", "chunk_bytes", "block_size", "direction", "method", "kind",
              "max_ctas", "bytes", "iters", "median_us", "p20_us", "p80_us", "min_us", "host_us", "gbps",
              "pct_of_memcpy", "x_memcpy", "ops_per_call", "verify"]


def write_outputs(result: dict, args, sweep: bool) -> None:
    table = format_table(result, sweep)
    to_stdout = [p for p in (args.json, args.csv) if p == "-"]
    print(table, end="", file=sys.stderr if to_stdout else sys.stdout)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        _write(args.json, text + "\n")
    if args.csv:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["results"])
        _write(args.csv, buf.getvalue())
    if args.plot:
        msg = plot(result, args.plot)
        print(msg, file=sys.stderr)


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def plot(result: dict, path: str) -> str:
    """GB/s against chunk size (or group count) per method, one panel per direction."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written"
    rows = result["results"]
    xkey = "chunk_bytes" if len({r["chunk_bytes"] for r in rows}) > 1 else "groups"
    dirs = sorted({r["direction"] for r in rows})
    fig, axes = plt.subplots(1, len(dirs), figsize=(6 * len(dirs), 4.2), squeeze=False)
    for ax, d in zip(axes[0], dirs):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r[xkey], r["gbps"]) for r in rows if r["direction"] == d and r["method"] == m
                         and r.get("gbps"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m,
                        linestyle="--" if m == "memcpy" else "-")
        if xkey == "chunk_bytes":
            from .bench_scenarios import fmt_bytes

            ticks = sorted({r["chunk_bytes"] for r in rows})
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], fontsize=8)
        ax.set_xlabel("chunk bytes" if xkey == "chunk_bytes" else "KV cache groups")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{d}  ({result['env'].get('gpu') or 'CPU'})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"--plot: wrote {path}"


# ---------------------------------------------------------------------- commands
def _cmd_run(args, sweep: bool = False) -> int:
    import torch

    # --threads changes process-wide settings: put them back for in-process callers.
    saved = torch.get_num_threads(), os.environ.get("KVCOPY_CPU_THREADS")
    try:
        result = run_bench(args, sweep=sweep)
    finally:
        torch.set_num_threads(saved[0])
        if saved[1] is None:
            os.environ.pop("KVCOPY_CPU_THREADS", None)
        else:
            os.environ["KVCOPY_CPU_THREADS"] = saved[1]
    write_outputs(result, args, sweep=sweep)
    return 1 if any(r["verify"].startswith("FAIL") for r in result["results"]) else 0


def _cmd_sweep(args) -> int:
    return _cmd_run(args, sweep=True)


def _add_list_args(p) -> None:
    pass


def _cmd_list(args) -> int:
    from . import available_backends
    from .bench_scenarios import PRESETS

    print("presets:")
    for name, p in PRESETS.items():
        print(f"  {name:<8} {p['help']}")
    print("backends:")
    for name, why in available_backends().items():
        print(f"  {name:<8} {'available' if why is None else 'unavailable: ' + why}")
    print("baselines: vllm (per group, per layer), coalesced (seeds/2: one op per layer)")
    return 0


def _nixl_add_args(p):
    from .bench_nixl import add_args

    add_args(p)


def _nixl_run(args):
    from .bench_nixl import run

    return run(args)


register("run", "measure one scenario (default command)", lambda p: _add_scenario_args(p, False), _cmd_run)
register("sweep", "chunk sizes x directions x backends (GB/s against chunk size)",
         lambda p: _add_scenario_args(p, True), _cmd_sweep)
register("nixl", "NIXL pull over UCX: PullPlan / per-page / merged descriptors vs one bulk READ",
         _nixl_add_args, _nixl_run)
register("list", "presets and the backends this install can run", _add_list_args, _cmd_list)


def _from_fuzz(attr):
    def call(x):
        from .nixl import fuzz

        return getattr(fuzz, attr)(x)
    return call


register("fuzz", "byte-oracle fuzzer of heterogeneous P/D pull plans (python -m kvcopy.nixl.fuzz)",
         _from_fuzz("add_args"), _from_fuzz("run"))


def _calibrate_add_args(p):
    from .calibration import add_args

    add_args(p)


def _calibrate_run(args):
    from .calibration import run

    return run(args)


register("calibrate", "measure this GPU's backends per descriptor size; store the table auto reads",
         _calibrate_add_args, _calibrate_run)


if __name__ == "__main__":
    sys.exit(main())
