"""``kvcopy-bench run`` (the default) and ``sweep``: every method against a contiguous
memcpy of the same bytes, measured in the same run; and ``list``.

Every table starts with a contiguous memcpy of the same bytes, copied within the same
buffers as every other row (the point's device and host slabs: pinned host memory on a
GPU, plain memory on the CPU), measured in the same run, round by round with the other
rows, each timed call after untimed ones of the same method (:mod:`.timing`; with
``--cache cold-dst`` after those and a flush of the destination, with ``cold`` after a
flush of both sides alone); each
row then gives min, median and p90 time per request-sync and the spread, GB/s, % of
that memcpy, device ops per call (``--op-counts``), a bit-exact check against the torch
reference with the destination poisoned first (on by default; ``--no-verify``), and a
noise flag when its spread or the floor's says the ratio is noise (:mod:`.output`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .args import BenchError, add_scenario_args, device as _device, scenarios as _scenarios
from .output import Progress, check_output_paths, write_file, write_outputs


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
    from .. import available_copy_backends

    avail = available_copy_backends()
    skipped: Dict[str, str] = {}
    out: List[str] = []
    for b in wanted:
        why = avail.get(base(b)) if base(b) in KVCOPY_BACKENDS and base(b) != "auto" else None
        if why:
            skipped[b] = why
        elif b not in out:
            out.append(b)
    if not out:
        raise BenchError("none of the methods asked for can run here: "
                         + "; ".join(f"{b}: {why}" for b, why in skipped.items()))
    return ["memcpy"] + out, skipped


def measure_point(point, direction: str, methods: List[str], args, device: str,
                  skipped: Dict[str, str], budget: Optional[float] = None) -> List[dict]:
    """All rows of one (scenario, direction): memcpy first, then each method."""
    from .timing import measure

    fns: Dict[str, Callable[[], None]] = {}
    meta: Dict[str, str] = {}  # row key -> method
    caps: Dict[str, Optional[int]] = {}
    for m in methods:
        for cap in (args.max_ctas if (device != "cpu" and _base_method(m) in ("cuda", "triton", "auto")) else [0]):
            key = m if not cap else f"{m}@{cap}"
            try:
                fns[key] = point.method(m, direction, cap or None)
            except (ValueError, TypeError, RuntimeError, ImportError) as exc:
                skipped.setdefault(m, f"{type(exc).__name__}: {exc}")
                continue
            meta[key], caps[key] = m, cap or None
    verify = _verify(point, direction, fns, args)
    raised = [k for k, v in verify.items() if v.startswith("FAIL: raised")]
    for key in raised:  # not timed; still a row, so the failure shows and sets the exit code
        fns.pop(key)
    iters = args.iters or (200 if device != "cpu" else 20)
    base = args.budget if args.budget is not None else (3.0 if device != "cpu" else 0.75)
    budget = base if budget is None else budget
    floor = 5 if budget >= base else 3  # fewer calls when --time-limit bites
    # Each timed call follows untimed ones of the same method on the same buffers, so the
    # floor is as warm as the rows compared with it: 6 on the CPU (an 18 MiB copy got
    # faster for 6 calls after the torch row), 1 on a GPU (timing module doc).
    # --cache cold-dst: settled as warm (each row's source as warm as every other's, as a
    # serving engine's source pages were just written), then the destination flushed;
    # cold: the flush leaves both sides in memory, so nothing settles.
    cache = getattr(args, "cache", "warm")
    flush = _cache_flush(point, direction, cache)
    settle = (0 if cache == "cold" else SETTLE_CPU) if device == "cpu" else 1
    timings = measure(fns, device, iters, args.warmup, budget_s=budget, min_iters=min(floor, iters),
                      settle=settle, flush=flush)
    ref = timings["memcpy"].stats().get("median_us")
    rows = []
    for key, fn in fns.items():
        st = timings[key].stats()
        row = {**_row_head(point, direction, key, meta[key], caps[key]), **st}
        med = st.get("median_us")
        if med:
            row["gbps"] = point.total_bytes / (med * 1e-6) / 1e9
            row["pct_of_memcpy"] = 100.0 * ref / med if ref else None
            row["x_memcpy"] = med / ref if ref else None
        row["verify"] = verify.get(key, "skipped" if not verify_point(args, point.scenario) else "n/a")
        if args.op_counts:
            row.update(_op_counts(fn, device, meta[key]))
        rows.append(row)
    for key in raised:
        rows.append({**_row_head(point, direction, key, meta[key], caps[key]), "iters": 0, "verify": verify[key]})
    return rows


def _cache_flush(point, direction: str, cache: str) -> Optional[Callable[[], None]]:
    """``--cache``: None (warm), else a call that evicts the destination slab's lines
    (``cold-dst``) and the source's (``cold``): every byte any row of the point touches
    on that side, the memcpy floor's included."""
    if cache == "warm":
        return None
    from ..copy_backends.cpu import flush_caches

    src_side, dst_side = point._ends(direction)
    slabs = [point.slabs[dst_side]] + ([point.slabs[src_side]] if cache == "cold" else [])

    def flush() -> None:
        for slab in slabs:
            flush_caches(slab)

    return flush


def _check_cache(args, device: str) -> None:
    """``--cache`` other than warm: a CPU run on a CPU the library can flush."""
    cache = getattr(args, "cache", "warm")
    if cache == "warm":
        return
    if device != "cpu":
        raise BenchError(f"--cache {cache}: CPU runs only (a GPU's copies reach host memory over PCIe, "
                         "not through the CPU's caches, and its own L2 is not flushed this way)")
    import torch

    from ..copy_backends.cpu import flush_caches

    try:
        flushed = flush_caches(torch.empty(64, dtype=torch.uint8))
    except RuntimeError as exc:
        raise BenchError(f"--cache {cache}: {exc}") from None
    if not flushed:
        raise BenchError(f"--cache {cache}: the kvcopy_cpu library has no cache flush for this CPU "
                         "(x86-64 and Arm64 only)")


def _row_head(point, direction: str, key: str, method: str, cap: Optional[int]) -> dict:
    """The fields that say what a row measured."""
    sc = point.scenario
    return {"scenario": sc.name, "groups": len(sc.groups()), "layers": sc.num_layers,
            "chunk_bytes": sc.chunk_bytes(), "block_size": sc.block_size,
            "blocks_per_group": sc.blocks_per_group(), "direction": direction, "method": key,
            "kind": _kind(method), "max_ctas": cap, "bytes": point.total_bytes}


def _verify(point, direction: str, fns: Dict[str, Callable[[], None]], args) -> Dict[str, str]:
    """Row key -> "ok", "n/a" (the floor) or "FAIL: ...", when this point is checked."""
    verify: Dict[str, str] = {}
    if not verify_point(args, point.scenario):
        return verify
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
    return verify


def _op_counts(fn: Callable[[], None], device: str, method: str) -> dict:
    from .timing import op_counts

    counts: Dict[str, Any]
    try:
        counts = dict(op_counts(fn, device))
    except Exception as exc:  # the profiler is best effort
        counts = {"error": f"{type(exc).__name__}: {exc}"}
    out: Dict[str, Any] = {"device_us": counts.pop("device_us", None), "ops": counts,
                           "ops_per_call": counts.get("total")}
    if device == "cpu" and method in ("cpu", "auto"):
        out["ops_note"] = "one native C call per copy, not seen by the profiler"
    return out


def verify_point(args, scenario) -> bool:
    """Whether this point is checked bit-exact (``--verify``, ``--verify-max-chunk``)."""
    if not args.verify:
        return False
    limit = getattr(args, "verify_max_chunk", None)
    if limit in (None, ""):
        return True
    from .units import parse_size

    return scenario.chunk_bytes() <= parse_size(str(limit))


SETTLE_CPU = 6  # untimed calls before each timed one on the CPU (kvcopy.bench.timing)
SUMS = "+sum"  # method suffix: the same copier's copy with checksums (kvcopy.core.checksum)


def _base_method(method: str) -> str:
    return method[: -len(SUMS)] if method.endswith(SUMS) else method


def _kind(method: str) -> str:
    from .scenarios import BASELINES

    return "floor" if method == "memcpy" else "baseline" if method in BASELINES else "kvcopy"


def run_bench(args, sweep: bool) -> dict:
    import torch

    from .scenarios import copier_accepts
    from .units import parse_size

    device = _device(args)
    _check_cache(args, device)
    threads, threads_why = _threads(args, device)
    # Every method and the memcpy floor on the same threads: torch's intra-op pool (the
    # floor, the baselines, the torch backend) and the cpu backend's OpenMP team, which
    # reads KVCOPY_CPU_THREADS when a copier is prepared.
    torch.set_num_threads(threads)
    os.environ["KVCOPY_CPU_THREADS"] = str(threads)
    if sweep:
        args.max_call_bytes = parse_size(str(args.max_call_bytes or DEFAULT_MAX_CALL[device != "cpu"]))
    scenarios = _scenarios(args, sweep)
    methods, skipped = _methods(args, device)
    result = _result(args, sweep, device, scenarios, methods, skipped, threads, threads_why)
    if device != "cpu" and any(args.max_ctas) and not copier_accepts("max_ctas"):
        result["notes"].append("BlockCopier takes no max_ctas in this install: rows marked @N ran uncapped")
    if os.environ.get("TRITON_INTERPRET") and "triton" in methods:
        result["notes"].append("triton runs in the interpreter (TRITON_INTERPRET=1): ~1 ms per program instance")
    _measure_all(args, result, scenarios, methods, device)
    return result


# Bytes a sweep's call moves at most (fewer blocks, then fewer layers, where it would
# move more): [CPU, GPU]. 8 MiB is a millisecond of memcpy on a CPU.
DEFAULT_MAX_CALL = ("8M", "256M")
# The whole run's aim in seconds when --time-limit is not given, by command: [CPU, GPU]
# (0: none). The default sweep has 6 times the default run's points.
DEFAULT_AIM_S = {"run": (30.0, 0.0), "sweep": (90.0, 0.0)}


def _result(args, sweep: bool, device: str, scenarios, methods, skipped, threads: int, threads_why: str) -> dict:
    """The result's header: what was run, where, and how (rows are added as measured)."""
    from .units import fmt_bytes
    from .timing import NOISE_SPREAD, env_info

    counts = sorted({len(s.groups()) for s in scenarios})
    if not sweep:
        description = scenarios[0].describe(counts)
    else:
        first = next(s for s in scenarios if s.num_layers == max(x.num_layers for x in scenarios))
        small = min(scenarios, key=lambda s: (s.blocks_per_request, s.num_layers))
        description = (first.describe(counts, swept=True)
                       + f"; swept: chunk {fmt_bytes(min(s.chunk_bytes() for s in scenarios))} to "
                       f"{fmt_bytes(max(s.chunk_bytes() for s in scenarios))} (T tokens per block), and where "
                       f"a call would pass {fmt_bytes(args.max_call_bytes)}, fewer blocks/group (down to "
                       f"{small.blocks_per_request}), then fewer layers (down to {small.num_layers})")
    loop = None
    if "cpu+sum" in methods:
        from ..copy_backends.cpu import CpuBackend
        try:
            loop = CpuBackend().checksum_loop()
        except ValueError as e:  # a KVCOPY_CPU_SIMD the backend refuses
            raise BenchError(str(e)) from None
    return {
        "tool": "kvcopy-bench",
        "command": "sweep" if sweep else "run",
        "cpu_checksum_loop": loop,
        "argv": getattr(args, "argv", None),
        "env": env_info(device),
        "scenario": scenarios[0].to_dict() if len(scenarios) == 1 else [s.to_dict() for s in scenarios],
        "description": description,
        "methods": methods,
        "threads": {"count": threads, "why": threads_why},
        "cache": getattr(args, "cache", "warm"),
        "noise_limit": NOISE_SPREAD,
        "skipped": skipped,
        "notes": [],
        "results": [],
    }


def _measure_all(args, result: dict, scenarios, methods: List[str], device: str) -> None:
    """Every (scenario, direction) point into ``result["results"]``.

    The time aim (``--time-limit``, else the device's default) shrinks the per-method
    budget for the points left. Every point is measured (3 calls per method at least)
    unless ``--time-limit`` was given: then no point is started once it has passed, and
    the points not reached are named in a note.
    """
    import torch

    from .units import fmt_bytes, plural

    directions = ["h2d", "d2h"] if args.direction == "both" else [args.direction]
    total = len(scenarios) * len(directions)
    progress = Progress(total, args.quiet or total < 2)
    base_budget = args.budget if args.budget is not None else (3.0 if device != "cpu" else 0.75)
    hard = args.time_limit is not None
    aim = args.time_limit if hard else DEFAULT_AIM_S[result["command"]][device != "cpu"]
    t_start, steps_left = time.perf_counter(), total
    for n_done, sc in enumerate(scenarios):
        if hard and aim > 0 and n_done and time.perf_counter() - t_start > aim:
            left = [f"{fmt_bytes(s.chunk_bytes())} x {plural(len(s.groups()), 'group')}" for s in scenarios[n_done:]]
            result["notes"].append(f"--time-limit {aim:g} s reached: {plural(len(left), 'point')} not measured "
                                   f"({', '.join(left)})")
            result["truncated"] = len(left)
            break
        point = sc.build(device, pinned=args.host_memory == "pinned")
        try:
            for direction in directions:
                budget = base_budget
                if aim > 0:  # share what is left of the aim among the points left
                    left_s = max(0.0, aim - (time.perf_counter() - t_start))
                    budget = min(base_budget, left_s / steps_left / max(1, len(methods)))
                steps_left -= 1
                result["results"] += measure_point(point, direction, methods, args, device, result["skipped"],
                                                   budget)
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
    spent = time.perf_counter() - t_start
    result["seconds"] = round(spent, 1)
    if aim > 0 and spent > 1.2 * aim and not result.get("truncated"):
        result["notes"].append(f"took {spent:.0f} s against an aim of {aim:g} s: fewer calls per row "
                               "(each method still had 3 at least)")


def _threads(args, device: str) -> Tuple[int, str]:
    """(threads for every method, why that many)."""
    import torch

    if args.threads:
        return args.threads, "--threads"
    if args.threads is None and device == "cpu":
        # Not torch's default: a call on N threads waits for its slowest one, and the
        # choice must not hang on the load the previous run left. On 2 idle cores the
        # 36 MiB point's spread was 75-77% with 2 threads, 4-7% with 1.
        return 1, "the CPU default (--threads N for more; 0: torch's default)"
    return torch.get_num_threads(), "torch's default" + (" (--threads 0)" if args.threads == 0 else "")


def cmd_run(args, sweep: bool = False) -> int:
    import torch

    check_output_paths(args)  # before measuring: a missing matplotlib or a committed file
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
    if not any(r["method"] != "memcpy" for r in result["results"]):
        print("kvcopy-bench: error: none of the methods asked for ran (see 'skipped' above)", file=sys.stderr)
        return 2
    return 1 if any(r["verify"].startswith("FAIL") for r in result["results"]) else 0


def cmd_sweep(args) -> int:
    return cmd_run(args, sweep=True)


def cmd_list(args) -> int:
    from .. import available_copy_backends
    from .scenarios import PRESETS

    width = max(len(n) for n in PRESETS)
    print("presets:")
    for name, p in PRESETS.items():
        print(f"  {name:<{width}}  {p['help']}")
    from ..native import BUILD_INFO, build_info, build_note

    print(f"native libraries (install record: {BUILD_INFO if build_info() else 'none'}):")
    for stem in ("kvcopy_cpu", "kvcopy_cuda"):
        print(f"  {build_note(stem)}")
    print("backends:")
    report = available_copy_backends()
    width = max(len(n) for n in report)
    for name, why in report.items():
        print(f"  {name:<{width}}  {'available' if why is None else 'unavailable: ' + why}")
    print("baselines: vllm (per group, per layer), coalesced (vLLM after it coalesced groups: one op per layer)")
    return 0


def add_run_args(p) -> None:
    add_scenario_args(p, sweep=False)


def add_sweep_args(p) -> None:
    add_scenario_args(p, sweep=True)
