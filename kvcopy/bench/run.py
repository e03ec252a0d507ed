"""``kvcopy-bench run`` (the default) and ``sweep``: every method against a contiguous
memcpy of the same bytes, measured in the same run; and ``list``.

Every table starts with a contiguous memcpy of the same bytes (pinned host memory on
a GPU, plain memory on the CPU), measured in the same run, round-robin with the other
rows; each row then gives median and p20/p80 time per request-sync, GB/s, % of that
memcpy, device ops per call (``--op-counts``) and a bit-exact check against the torch
reference with the destination poisoned first (on by default; ``--no-verify``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from .args import BenchError, add_scenario_args, busy, device as _device, scenarios as _scenarios
from .output import Progress, write_file, write_outputs


def _methods(args, device: str) -> Tuple[List[str], Dict[str, str]]:
    """(methods to run, skipped method -> reason). memcpy is always first."""
    from .scenarios import BASELINES, KVCOPY_BACKENDS

    gpu = device != "cpu"
    base = _base_method
    if args.backends in ("default", ""):
        wanted = list(BASELINES) + (["torch", "cuda", "triton", "ce", "auto"] if gpu else ["torch", "cpu"])
    elif args.backends == "all":
        wanted = list(BASELINES) + list(KVCOPY_BACKENDS)
    else:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip() and b.strip() != "memcpy"]
    if getattr(args, "checksum", False):  # a checksummed row beside each kvcopy row
        wanted += [f"{b}{SUMS}" for b in wanted if b in KVCOPY_BACKENDS and b != "ce"]
    known = BASELINES + KVCOPY_BACKENDS
    unknown = [b for b in wanted if base(b) not in (KVCOPY_BACKENDS if b.endswith(SUMS) else known)]
    if unknown:
        raise BenchError(f"unknown method(s) {unknown}; known: memcpy, {', '.join(BASELINES + KVCOPY_BACKENDS)} "
                         f"(a kvcopy backend with {SUMS!r}: the copy with checksums)")
    if "triton" in wanted and not gpu and not os.environ.get("TRITON_INTERPRET"):
        # The interpreter runs Triton on CPU tensors; it must be set before triton loads.
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
    from .. import available_backends

    avail = available_backends()
    skipped = {}
    out = []
    for b in wanted:
        if base(b) in KVCOPY_BACKENDS and base(b) != "auto" and avail.get(base(b)):
            skipped[b] = avail[base(b)]
        elif b not in out:
            out.append(b)
    return ["memcpy"] + out, skipped


def measure_point(point, direction: str, methods: List[str], args, device: str,
                  skipped: Dict[str, str], budget: Optional[float] = None) -> List[dict]:
    """All rows of one (scenario, direction): memcpy first, then each method."""
    from .timing import measure, op_counts

    sc = point.scenario
    fns: Dict[str, Callable[[], None]] = {}
    meta: Dict[str, dict] = {}
    for m in methods:
        caps = args.max_ctas if (device != "cpu" and _base_method(m) in ("cuda", "triton", "auto")) else [0]
        for cap in caps:
            key = m if not cap else f"{m}@{cap}"
            try:
                fns[key] = point.method(m, direction, cap or None)
            except (ValueError, TypeError, RuntimeError, ImportError) as exc:
                skipped.setdefault(m, f"{type(exc).__name__}: {exc}")
                continue
            meta[key] = {"method": m, "max_ctas": cap or None}
    verify: Dict[str, str] = {}
    if verify_point(args, sc):
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
        row["verify"] = verify.get(key, "skipped" if not verify_point(args, sc) else "n/a")
        if args.op_counts:
            try:
                counts = op_counts(fn, device)
            except Exception as exc:  # the profiler is best effort
                counts = {"error": f"{type(exc).__name__}: {exc}"}
            row["device_us"] = counts.pop("device_us", None)
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


def verify_point(args, scenario) -> bool:
    """Whether this point is checked bit-exact (``--verify``, ``--verify-max-chunk``)."""
    if not args.verify:
        return False
    limit = getattr(args, "verify_max_chunk", None)
    if limit in (None, ""):
        return True
    from .scenarios import parse_size

    return scenario.chunk_bytes() <= parse_size(str(limit))


SUMS = "+sum"  # method suffix: the same copier's copy with checksums (kvcopy.checksum)


def _base_method(method: str) -> str:
    return method[: -len(SUMS)] if method.endswith(SUMS) else method


def _kind(method: str) -> str:
    from .scenarios import BASELINES

    return "floor" if method == "memcpy" else "baseline" if method in BASELINES else "kvcopy"


def run_bench(args, sweep: bool) -> dict:
    import torch

    from .scenarios import copier_accepts, fmt_bytes, parse_size, plural
    from .timing import env_info

    device = _device(args)
    notes = []
    threads, threads_why = _threads(args, device)
    # Every method and the memcpy floor on the same threads: torch's intra-op pool (the
    # floor, the baselines, the torch backend) and the cpu backend's OpenMP team, which
    # reads KVCOPY_CPU_THREADS when a copier is prepared.
    torch.set_num_threads(threads)
    os.environ["KVCOPY_CPU_THREADS"] = str(threads)
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
        "threads": {"count": threads, "why": threads_why},
        "skipped": skipped,
        "notes": notes,
        "results": rows,
    }
    progress = Progress(len(scenarios) * len(directions), args.quiet or len(scenarios) * len(directions) < 2)
    base_budget = args.budget if args.budget is not None else (3.0 if device != "cpu" else 0.75)
    limit = args.time_limit if args.time_limit is not None else (30.0 if device == "cpu" else 0.0)
    t_start, steps_left = time.perf_counter(), len(scenarios) * len(directions)
    for n_done, sc in enumerate(scenarios):
        if limit > 0 and n_done and time.perf_counter() - t_start > limit:
            # --time-limit bounds building and verifying too: points not reached are named.
            left = [f"{fmt_bytes(s.chunk_bytes())} x {len(s.groups())} groups" for s in scenarios[n_done:]]
            notes.append(f"time limit {limit:g} s reached: {len(left)} point(s) not measured ({', '.join(left)})")
            result["truncated"] = len(left)
            break
        point = sc.build(device, pinned=args.host_memory == "pinned")
        try:
            for direction in directions:
                budget = base_budget
                if limit > 0:  # share what is left of the limit among the points left
                    left = max(0.0, limit - (time.perf_counter() - t_start))
                    budget = min(base_budget, left / steps_left / max(1, len(methods)))
                steps_left -= 1
                rows += measure_point(point, direction, methods, args, device, skipped, budget)
                progress.step(f"{plural(len(sc.groups()), 'group')}, chunk {fmt_bytes(sc.chunk_bytes())}, "
                              f"{direction}")
                if args.json and args.json != "-" and steps_left:
                    # A checkpoint: a run killed by a timeout still leaves its finished points.
                    write_file(args.json, json.dumps(dict(result, partial=True), indent=1, default=str) + "\n")
        finally:
            point.close()
            del point
            if device != "cpu":
                torch.cuda.empty_cache()
    return result


def _threads(args, device: str) -> Tuple[int, str]:
    """(threads for every method, why that many)."""
    import torch

    if args.threads:
        return args.threads, "--threads"
    if args.threads is None and device == "cpu" and busy():
        return 1, (f"machine busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); "
                   "--threads N to choose")
    return torch.get_num_threads(), "torch's default" + (" (--threads 0)" if args.threads == 0 else "")


def cmd_run(args, sweep: bool = False) -> int:
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


def cmd_sweep(args) -> int:
    return cmd_run(args, sweep=True)


def cmd_list(args) -> int:
    from .. import available_backends
    from .scenarios import PRESETS

    print("presets:")
    for name, p in PRESETS.items():
        print(f"  {name:<8} {p['help']}")
    from ..backends.native import BUILD_INFO, build_info, build_note

    print(f"native libraries (install record: {BUILD_INFO if build_info() else 'none'}):")
    for stem in ("kvcopy_cpu", "kvcopy_cuda"):
        print(f"  {build_note(stem)}")
    print("backends:")
    for name, why in available_backends().items():
        print(f"  {name:<8} {'available' if why is None else 'unavailable: ' + why}")
    print("baselines: vllm (per group, per layer), coalesced (seeds/2: one op per layer)")
    return 0


def add_run_args(p) -> None:
    add_scenario_args(p, sweep=False)


def add_sweep_args(p) -> None:
    add_scenario_args(p, sweep=True)
