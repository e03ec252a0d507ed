#!/usr/bin/env python
"""Tables from ``kvcopy-bench`` JSON results (``bench/results/*.json``).

    python bench/report.py                      # markdown for the README's results section
    python bench/report.py --text FILE...       # the short plain table gpu_check.sh prints last

Sweeps become one matrix per direction: chunk size down, memcpy GB/s and every other
method's % of that memcpy across. Runs become one row per (groups, direction): each
method's time as a multiple of the memcpy of the same bytes.
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
            cells.append(f"{r['x_memcpy']:.2f}x" + (" FAIL" if bad else ""))
            if r.get("ops_per_call") is not None:  # "+1C": one native call the profiler cannot see
                ops.append(f"{r['ops_per_call']:g}" + ("+1C" if r.get("ops_note") else ""))
        cells.append("/".join(ops) if ops else "-")
        table.append(cells)
    headers = ["groups", "dir", "bytes", "memcpy GB/s"] + [f"{m} (x memcpy)" for m in methods] + [
        "ops/call (" + "/".join(methods) + ")"]
    return _table(headers, table, md) + [""]


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
    argv = " ".join(res.get("argv") or [])
    return (f"{res['command']} on {where}, {env.get('date', '?')[:10]}, commit {str(env.get('commit'))[:12]}"
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
                      "(1.00x is the floor); ops/call from --op-counts (`-`: not counted)", ""]
        lines += sweep_tables(res, md) if res["command"] == "sweep" else run_tables(res, md)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="result JSON files (default: bench/results/*.json)")
    p.add_argument("--text", action="store_true", help="plain text instead of markdown")
    args = p.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(HERE, "results", "*.json")))
    results = load(files)
    if not results:
        print("no kvcopy-bench results found", file=sys.stderr)
        return 1
    sys.stdout.write(render(results, md=not args.text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
