"""What ``kvcopy-bench run``/``sweep`` print and write: the table, the summary, JSON,
CSV, the plot, and the progress bar on stderr.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from typing import Dict, List

from .scenarios import fmt_bytes, plural


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


def format_table(result: dict, sweep: bool) -> str:
    env = result["env"]
    out = io.StringIO()
    where = env.get("gpu") or f"{plural(env['cpu_count'], 'CPU core')}, torch {env['torch']}"
    out.write(f"kvcopy-bench {result['command']}  on {env['device']}: {where}\n")
    out.write(f"scenario {result['description']}\n")
    th = result.get("threads")
    if th and env["device"] == "cpu":
        out.write(f"threads: {plural(th['count'], 'thread')} for every row, memcpy included "
                  f"(torch.set_num_threads, KVCOPY_CPU_THREADS for cpu): {th['why']}\n")
        load = env.get("load_average")
        if load is not None and load >= max(1, env["cpu_count"] / 2) and "busy" not in th["why"]:
            out.write(f"load: average {load:.1f} on {plural(env['cpu_count'], 'core')} at the start: other "
                      "work shares these cores, so ratios from this run will not reproduce closely\n")
    headers = (["chunk"] if sweep else []) + ["groups", "dir", "method", "bytes", "median us", "p20 us",
                                             "p80 us", "GB/s", "% memcpy", "x memcpy", "ops/call", "verify"]
    table = []
    below = below_floor(result)
    for r in result["results"]:
        ops = r.get("ops_per_call")
        ops_s = "-" if ops is None else f"{ops:g}" + ("+1C" if r.get("ops_note") else "")
        cells = ([fmt_bytes(r["chunk_bytes"])] if sweep else []) + [
            str(r["groups"]), r["direction"], r["method"], fmt_bytes(r["bytes"]),
            _f(r.get("median_us"), 1), _f(r.get("p20_us"), 1), _f(r.get("p80_us"), 1), _f(r.get("gbps"), 2),
            _f(r.get("pct_of_memcpy"), 1), _f(r.get("x_memcpy"), 2) + ("!" if id(r) in below else ""), ops_s,
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
    out.write(legend(result))
    if below:
        out.write(f"! {plural(len(below), 'row')} faster than the memcpy floor (p80 below memcpy's p20): "
                  "a measurement problem (load, threads, caches), not a result; rerun on a quiet "
                  "machine with --threads 1\n")
    out.write(summary(result))
    return out.getvalue()


def legend(result: dict) -> str:
    """What the columns mean and which way is better."""
    lines = ["columns: time per call (median, p20, p80); x memcpy = time / memcpy time of the same "
             "bytes in the same run, lower is better (1.00x is the floor); % memcpy = its inverse, "
             "higher is better"]
    counted = any(r.get("ops_per_call") is not None for r in result["results"])
    if not counted:
        lines.append("ops/call: '-' = not counted (pass --op-counts: torch.profiler, slower)")
    elif result["env"]["device"] == "cpu":
        lines.append("ops/call: on the CPU, torch operators that move bytes (+1C: one native call "
                     "the profiler cannot see)")
    else:
        lines.append("ops/call: device kernels + memcpys + memsets per call")
    return "".join(line + "\n" for line in lines)


def below_floor(result: dict) -> set:
    """ids of rows clearly faster than their point's memcpy (p80 < memcpy p20): no copy
    of the same bytes beats a contiguous memcpy, so such a row is a measurement bug."""
    floors = {}
    for r in result["results"]:
        if r["method"] == "memcpy" and r.get("p20_us"):
            floors[(r["chunk_bytes"], r["groups"], r["direction"])] = r["p20_us"]
    out = set()
    for r in result["results"]:
        floor = floors.get((r["chunk_bytes"], r["groups"], r["direction"]))
        if r["method"] != "memcpy" and floor and r.get("p80_us") and r["p80_us"] < floor:
            out.add(id(r))
    return out


def summary(result: dict) -> str:
    """One line per method: its worst and median ratio to memcpy over all points."""
    by_method: Dict[str, List[float]] = {}
    for r in result["results"]:
        if r["method"] != "memcpy" and r.get("x_memcpy"):
            by_method.setdefault(r["method"], []).append(r["x_memcpy"])
    if not by_method:
        return ""
    lines = ["summary (x memcpy: time / memcpy time of the same bytes, same run; lower is better):"]
    for m, xs in by_method.items():
        xs.sort()
        lines.append(f"  {m:<12} median {xs[len(xs) // 2]:.2f}x  worst {xs[-1]:.2f}x  best {xs[0]:.2f}x "
                     f"over {plural(len(xs), 'point')}")
    failed = [r for r in result["results"] if r["verify"].startswith("FAIL")]
    lines.append(f"verify: {plural(len(failed), 'failure')}" if failed else "verify: every checked method bit-exact")
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
        write_file(args.json, text + "\n")
    if args.csv:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["results"])
        write_file(args.csv, buf.getvalue())
    if args.plot:
        msg = plot(result, args.plot)
        print(msg, file=sys.stderr)


def write_file(path: str, text: str) -> None:
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
