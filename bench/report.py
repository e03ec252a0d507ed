#!/usr/bin/env python
"""Tables from ``kvcopy-bench`` JSON results (``bench/results/*.json``).

    python bench/report.py                      # markdown tables of bench/results/ (docs/bench.md, "Figures")
    python bench/report.py --text FILE...       # the short plain table gpu_check.sh prints last
    python bench/report.py --runs A.json B.json C.json   # repeated runs of one command: one table,
                                                # each cell the median of the runs and their range

Sweeps become one matrix per direction: chunk size down, memcpy GB/s and every other
method's % of that memcpy across. Runs become one row per (groups, direction): each
method's time as a multiple of the memcpy of the same bytes; a ratio the run flagged as
noise (its own spread or its floor's, see kvcopy.bench.output) is marked "noise".
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def load(paths: List[str]) -> List[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        if data.get("tool") == "kvcopy-bench" and data.get("results"):
            data["_path"] = os.path.relpath(p, os.path.dirname(HERE))
            out.append(data)
    out.sort(key=lambda d: (d["env"].get("date", ""), d["_path"]))
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return str(n)


def _table(headers: List[str], rows: List[List[str]], md: bool) -> List[str]:
    if md:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        return lines + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [fmt(headers)] + [fmt(r) for r in rows]


def sweep_tables(res: dict, md: bool) -> List[str]:
    rows = res["results"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "memcpy"]
    lines = []
    for d in dict.fromkeys(r["direction"] for r in rows):
        by = {(r["chunk_bytes"], r["method"]): r for r in rows if r["direction"] == d}
        chunks = sorted({c for c, _ in by})
        table = []
        for c in chunks:
            mem = by.get((c, "memcpy"), {})
            cells = [_size(c), f"{mem.get('gbps', 0):.1f}"]
            for m in methods:
                r = by.get((c, m))
                ok = r is None or not str(r.get("verify", "")).startswith("FAIL")
                cells.append("-" if r is None or r.get("pct_of_memcpy") is None
                             else f"{r['pct_of_memcpy']:.0f}%" + ("" if ok else " FAIL"))
            table.append(cells)
        lines.append(f"{d}: % of a contiguous {'pinned ' if res['env'].get('gpu') else ''}memcpy of the same "
                     "bytes, same run")
        lines += [""] if md else []
        lines += _table(["chunk", "memcpy GB/s"] + methods, table, md)
        lines.append("")
    return lines


def run_tables(res: dict, md: bool) -> List[str]:
    """One row per (groups, direction): memcpy GB/s, then each method's time as a
    multiple of that memcpy (lower is better; 1.00x is the byte floor), then the
    device ops per call of each method at the row's point."""
    rows = res["results"]
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "memcpy"]
    by = {(r["groups"], r["direction"], r["method"]): r for r in rows}
    table = []
    for g, d in dict.fromkeys((r["groups"], r["direction"]) for r in rows):
        mem = by.get((g, d, "memcpy"), {})
        cells = [str(g), d, _size(mem.get("bytes", 0)), f"{mem.get('gbps', 0):.2f}"]
        ops = []
        for m in methods:
            r = by.get((g, d, m))
            if r is None or r.get("x_memcpy") is None:
                cells.append("-")
                continue
            bad = str(r.get("verify", "")).startswith("FAIL")
            cell = f"{r['x_memcpy']:.2f}x"
            if r.get("x_range"):
                cell += f" ({r['x_range'][0]:.2f}-{r['x_range'][1]:.2f})"
            if r.get("noisy_runs"):
                cell += f" noise in {r['noisy_runs']}"
            elif r.get("noise"):
                cell += " noise"
            cells.append(cell + (" FAIL" if bad else ""))
            if r.get("ops_per_call") is not None:  # "+1C": one native call the profiler cannot see
                ops.append(f"{r['ops_per_call']:g}" + ("+1C" if r.get("ops_note") else ""))
        cells.append("/".join(ops) if ops else "-")
        table.append(cells)
    headers = ["groups", "dir", "bytes", "memcpy GB/s"] + [f"{m} (x memcpy)" for m in methods] + [
        "ops/call (" + "/".join(methods) + ")"]
    return _table(headers, table, md) + [""]


OUTPUT_FLAGS = ("--json", "--csv", "--plot")  # where a run writes, not what it measures


def _measuring(argv: List[str]) -> List[str]:
    """``argv`` without the output flags and their values: runs that differ only in where
    they wrote are runs of one command."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in OUTPUT_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in OUTPUT_FLAGS)):
            out.append(a)
    return out


def combine(results: List[dict]) -> dict:
    """Repeated runs of one command as one result: each row's x memcpy is the median over
    the runs, ``x_range`` their min and max, ``noisy_runs`` in how many runs it was flagged."""
    first = results[0]
    argvs = {" ".join(_measuring(r.get("argv") or [])) for r in results}
    threads = {(r.get("threads") or {}).get("count") for r in results}  # the default changed once
    if len(argvs) > 1 or len({r["command"] for r in results}) > 1 or len(threads) > 1:
        raise SystemExit(f"--runs: the files are not runs of one command ({sorted(argvs)}, threads "
                         f"{sorted(threads, key=str)})")
    rows: Dict[tuple, List[dict]] = {}
    for res in results:
        for r in res["results"]:
            rows.setdefault((r["groups"], r["direction"], r["method"], r.get("chunk_bytes")), []).append(r)
    out = []
    for same in rows.values():
        row = dict(same[0])
        xs = sorted(r["x_memcpy"] for r in same if r.get("x_memcpy") is not None)
        if xs:
            row["x_memcpy"] = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
            row["x_range"] = (xs[0], xs[-1])
        gbps = sorted(r["gbps"] for r in same if r.get("gbps"))
        if gbps:
            row["gbps"] = gbps[len(gbps) // 2]
        noisy = sum(1 for r in same if r.get("noise"))
        row["noisy_runs"] = f"{noisy} of {len(same)} runs" if noisy else None
        row["verify"] = next((r["verify"] for r in same if str(r.get("verify", "")).startswith("FAIL")),
                             same[0].get("verify"))
        out.append(row)
    loads = [r["env"].get("load_average") for r in results if r["env"].get("load_average") is not None]
    env = dict(first["env"], date=f"{results[0]['env'].get('date', '?')[:10]}",
               load_average=f"{min(loads)}-{max(loads)}" if loads else None)
    return dict(first, env=env, results=out, runs=len(results), _path=", ".join(r["_path"] for r in results))


def describe(res: dict) -> str:
    env = res["env"]
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda_runtime", "cuda_driver", "triton")
                         if env.get(k))
    partial = " (partial: the run was cut short)" if res.get("partial") else ""
    load = f", load average {env['load_average']}" if env.get("load_average") is not None else ""
    if res.get("threads"):
        n = res["threads"]["count"]
        threads = f"{n} thread{'' if n == 1 else 's'} for every method"
    else:  # a run older than the thread rule: only torch's count was recorded
        threads = f"torch on {env.get('torch_threads')} threads (the cpu backend's not recorded)"
    cpu = f", {threads}{load}" if env.get("device") == "cpu" else ""
    argv = " ".join(_measuring(res.get("argv") or []))
    runs = f"{res['runs']} runs, " if res.get("runs") else ""
    return (f"{res['command']} on {where}, {runs}{env.get('date', '?')[:10]}, commit {str(env.get('commit'))[:12]}"
            f" ({versions}){cpu}{partial}" + (f"; `kvcopy-bench {argv}`" if argv else ""))


def render(results: List[dict], md: bool) -> str:
    lines = []
    for res in results:
        head = describe(res)
        lines.append(f"### {head}" if md else f"== {head}")
        lines.append("")
        lines.append(f"`{res['_path']}`: {res.get('description', '')}" if md else res.get("description", ""))
        lines.append("")
        if res["command"] != "sweep":
            lines += ["x memcpy: time / memcpy time of the same bytes in the same run, lower is better "
                      "(1.00x is the floor)" + ("; median of the runs (lowest-highest)" if res.get("runs") else "")
                      + "; noise: flagged by its spread or its floor's; ops/call from --op-counts "
                      "(`-`: not counted)", ""]
        lines += sweep_tables(res, md) if res["command"] == "sweep" else run_tables(res, md)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="result JSON files (default: bench/results/*.json)")
    p.add_argument("--text", action="store_true", help="plain text instead of markdown")
    p.add_argument("--runs", action="store_true", help="the files are repeated runs of one command: one table")
    args = p.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(HERE, "results", "*.json")))
    results = load(files)
    if not results:
        print("no kvcopy-bench results found", file=sys.stderr)
        return 1
    if args.runs:
        results = [combine(results)]
    sys.stdout.write(render(results, md=not args.text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
