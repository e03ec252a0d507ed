"""What ``kvcopy-bench run``/``sweep`` print and write: the table, the noise flags, the
summary, JSON, CSV, the plot, and the progress bar on stderr.

Noise flags. Each row's spread is ``p90 / p10 - 1`` over its timed calls. A ratio to
memcpy is the ratio of two medians, so it is only as steady as the wider of the two
spreads: a row is flagged ``floor`` when its point's memcpy row is noisy, ``row`` when
it is itself (:func:`kvcopy.bench.timing.noisy`), and the note under the table says
what ran beside it and what to do. Nothing else flags a row: a row below the floor
with tight spreads is a result (the floor is torch's ``copy_``, with its own per-call
cost), not a measurement error.
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from .units import fmt_bytes, plural


class Progress:
    """A one-line progress bar on stderr. When stderr is not a terminal, one line per
    step, or per ``every`` seconds when steps are many (a fuzzer's cases)."""

    def __init__(self, total: int, quiet: bool, every_s: float = 0.0):
        self.total, self.done, self.quiet = total, 0, quiet or total <= 0
        self.tty = sys.stderr.isatty()
        self.t0 = self.shown = time.perf_counter()
        self.every_s = every_s

    def step(self, label: str = "", n: int = 1) -> None:
        if self.quiet:
            return
        self.done += n
        now = time.perf_counter()
        last = self.done >= self.total
        if not last and now - self.shown < (self.every_s if not self.tty else min(self.every_s, 0.2)):
            return
        self.shown = now
        width = 24
        fill = int(width * min(self.done, self.total) / self.total)
        spent = now - self.t0
        eta = f" ~{spent * (self.total - self.done) / self.done:.0f}s left" if self.done and not last else ""
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{spent:5.1f}s{eta} {label}").rstrip()
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120) + ("\n" if last else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------- noise
def _point(r: dict) -> Tuple:
    return (r["chunk_bytes"], r["groups"], r["direction"])


def noise_flags(result: dict) -> Dict[int, str]:
    """``id(row)`` -> ``"floor"``, ``"row"`` or ``"floor, row"`` for the rows whose ratio
    to memcpy is noise (see the module doc); the memcpy rows themselves as ``"floor"``."""
    from .timing import NOISE_SPREAD, noisy

    limit = result.get("noise_limit", NOISE_SPREAD)
    floors = {_point(r): noisy(r, limit) for r in result["results"] if r["method"] == "memcpy"}
    out: Dict[int, str] = {}
    for r in result["results"]:
        if not r.get("iters"):
            continue
        if r["method"] == "memcpy":
            why = ["floor"] if floors[_point(r)] else []
        else:
            why = (["floor"] if floors.get(_point(r)) else []) + (["row"] if noisy(r, limit) else [])
        if why:
            out[id(r)] = ", ".join(why)
    return out


def noise_note(result: dict, flags: Dict[int, str]) -> str:
    """What the flags mean, what shared the machine, and what to do about it."""
    from .timing import NOISE_SPREAD

    rows = [r for r in result["results"] if id(r) in flags and r["method"] != "memcpy"]
    if not rows:
        return ""
    env = result["env"]
    limit = result.get("noise_limit", NOISE_SPREAD)
    load, cores = env.get("load_average"), env.get("cpu_count") or 1
    if load is not None and load >= max(1.0, cores / 2):
        cause = f"other work shared the machine (load average {load:.1f} on {plural(cores, 'core')} at the start)"
    else:
        cause = "something else ran during the run" + (f" (load average {load:.1f} at the start)"
                                                         if load is not None else "")
        if any("floor" in flags[id(r)] for r in rows):
            cause += (", or the point's bytes sit at the edge of what the caches hold (its calls then "
                      "alternate between cache and memory speed, on an idle machine too: compare the "
                      "points whose floor is steady)")
    todo = ["rerun on an idle machine"]
    threads = (result.get("threads") or {}).get("count", 1)
    if env.get("device") == "cpu" and threads > 1:
        todo.append(f"or with --threads 1 (with {threads} threads a call waits for its slowest thread, "
                    "and one descheduled thread stretches it)")
    if any(r.get("iters", 0) < 3 for r in result["results"] if id(r) in flags):
        todo.append("give slow rows more time (--budget S, --time-limit 0): fewer than 3 calls give no spread")
    which = sorted({f for r in rows for f in flags[id(r)].split(", ")})
    return (f"noise: {plural(len(rows), 'row')} flagged ({' and '.join(which)}): the spread (p90 / p10 - 1) of "
            f"the point's memcpy floor ('floor') or of the row itself ('row') is over {limit:.0%}, so its "
            f"x memcpy is not a result; {cause}. To do: {'; '.join(todo)}.\n")


# ---------------------------------------------------------------------- the table
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
    if result.get("cache", "warm") != "warm":
        what = "destination's" if result["cache"] == "cold-dst" else "source's and destination's"
        out.write(f"cache: {result['cache']}: the {what} lines flushed from every cache level before each "
                  "timed call, memcpy included (--cache)\n")
    if result.get("cpu_checksum_loop"):
        out.write(f"cpu+sum: the {result['cpu_checksum_loop']} loop (KVCOPY_CPU_SIMD; docs/backends.md, "
                  "\"Checksums\")\n")
    flags = noise_flags(result)
    headers = (["chunk"] if sweep else []) + ["groups", "dir", "method", "bytes", "calls", "min us", "median us",
                                             "p90 us", "spread", "GB/s", "% memcpy", "x memcpy", "ops/call",
                                             "verify", "noise"]
    table = []
    for r in result["results"]:
        ops = r.get("ops_per_call")
        ops_s = "-" if ops is None else f"{ops:g}" + ("+1C" if r.get("ops_note") else "")
        spread = r.get("spread")
        cells = ([fmt_bytes(r["chunk_bytes"])] if sweep else []) + [
            str(r["groups"]), r["direction"], r["method"], fmt_bytes(r["bytes"]), str(r.get("iters", 0)),
            _f(r.get("min_us"), 1), _f(r.get("median_us"), 1), _f(r.get("p90_us"), 1),
            "-" if spread is None else f"{100 * spread:.0f}%", _f(r.get("gbps"), 2),
            _f(r.get("pct_of_memcpy"), 1), _f(r.get("x_memcpy"), 2), ops_s,
            r["verify"] if len(r["verify"]) < 40 else r["verify"][:37] + "...", flags.get(id(r), ""),
        ]
        table.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in table)) if table else len(h) for i, h in enumerate(headers)]
    left = {"dir", "method", "verify", "noise"}

    def line(cells):
        text = "  ".join(c.ljust(w) if h in left else c.rjust(w) for c, w, h in zip(cells, widths, headers))
        return text.rstrip()

    out.write(line(headers) + "\n")
    prev = None
    for r, cells in zip(result["results"], table):
        key = _point(r)
        if prev is not None and key != prev:
            out.write("\n" if not sweep or key[0] != prev[0] else "")
        prev = key
        out.write(line(cells) + "\n")
    for name, why in result["skipped"].items():
        out.write(f"skipped {name}: {why}\n")
    for note in result["notes"]:
        out.write(f"note: {note}\n")
    out.write(legend(result))
    out.write(noise_note(result, flags))
    out.write(summary(result, flags))
    return out.getvalue()


def legend(result: dict) -> str:
    """What the columns mean and which way is better."""
    lines = ["columns: calls timed; time per call (min, median, p90) and spread = p90 / p10 - 1 "
             "(p10 in the JSON); "
             "x memcpy = median time / the memcpy's median time, same bytes, same buffers, same run, "
             "lower is better (1.00x is the floor); % memcpy = its inverse, higher is better"]
    counted = any(r.get("ops_per_call") is not None for r in result["results"])
    if not counted:
        lines.append("ops/call: '-' = not counted (pass --op-counts: torch.profiler, slower)")
    elif result["env"]["device"] == "cpu":
        lines.append("ops/call: on the CPU, torch operators that move bytes (+1C: one native call "
                     "the profiler cannot see)")
    else:
        lines.append("ops/call: device kernels + memcpys + memsets per call")
    return "".join(line + "\n" for line in lines)


def checksum_costs(result: dict, flags: Dict[int, str]) -> Dict[str, Tuple[List[float], int]]:
    """Per ``<backend>+sum`` method: its median time over its backend's at each point
    where both ran (``--checksum``), and at how many of those either row is flagged
    as noise."""
    plain = {(_point(r), r["method"]): r for r in result["results"]}
    out: Dict[str, Tuple[List[float], int]] = {}
    for r in result["results"]:
        base = plain.get((_point(r), r["method"][: -len("+sum")])) if r["method"].endswith("+sum") else None
        if base is None or not r.get("median_us") or not base.get("median_us"):
            continue
        ratios, noisy = out.setdefault(r["method"], ([], 0))
        ratios.append(r["median_us"] / base["median_us"])
        out[r["method"]] = (ratios, noisy + (id(r) in flags or id(base) in flags))
    return out


def summary(result: dict, flags: Optional[Dict[int, str]] = None) -> str:
    """One line per method: its median, worst and best ratio to memcpy over the points
    whose ratio is not flagged as noise."""
    flags = noise_flags(result) if flags is None else flags
    by_method: Dict[str, List[float]] = {}
    left_out: Dict[str, int] = {}
    for r in result["results"]:
        if r["method"] == "memcpy" or not r.get("x_memcpy"):
            continue
        if id(r) in flags:
            left_out[r["method"]] = left_out.get(r["method"], 0) + 1
            by_method.setdefault(r["method"], [])
        else:
            by_method.setdefault(r["method"], []).append(r["x_memcpy"])
    if not by_method:
        return ""
    lines = ["summary (x memcpy: time / memcpy time of the same bytes, same run; lower is better):"]
    for m, xs in by_method.items():
        xs.sort()
        noise = f" ({left_out[m]} more flagged as noise, left out)" if left_out.get(m) else ""
        if xs:
            lines.append(f"  {m:<12} median {xs[len(xs) // 2]:.2f}x  worst {xs[-1]:.2f}x  best {xs[0]:.2f}x "
                         f"over {plural(len(xs), 'point')}{noise}")
        else:
            lines.append(f"  {m:<12} every point flagged as noise ({left_out[m]})")
    for m, (ratios, noisy) in checksum_costs(result, flags).items():
        ratios.sort()
        flagged = f"; {noisy} with a row flagged as noise" if noisy else ""
        lines.append(f"  {m:<12} checksum cost: median {ratios[len(ratios) // 2]:.2f}x  worst {ratios[-1]:.2f}x  "
                     f"best {ratios[0]:.2f}x over {plural(len(ratios), 'point')} (its median time / "
                     f"{m[: -len('+sum')]}'s, same point{flagged})")
    failed = [r for r in result["results"] if r["verify"].startswith("FAIL")]
    lines.append(f"verify: {plural(len(failed), 'failure')}" if failed else "verify: every checked method bit-exact")
    return "\n".join(lines) + "\n"


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# ---------------------------------------------------------------------- files
CSV_FIELDS = ["scenario", "groups", "layers", "chunk_bytes", "block_size", "direction", "method", "kind",
              "max_ctas", "bytes", "iters", "min_us", "median_us", "p90_us", "spread", "host_us", "gbps",
              "pct_of_memcpy", "x_memcpy", "ops_per_call", "verify", "noise"]


def write_outputs(result: dict, args, sweep: bool) -> None:
    flags = noise_flags(result)
    for r in result["results"]:
        r["noise"] = flags.get(id(r))
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
        from .plot import plot

        print(plot(result, args.plot, flags), file=sys.stderr)


def check_output_paths(args) -> None:
    """Before measuring: every output can be written, and none overwrites a file git
    tracks (a committed result) unless ``--overwrite`` says so; ``--plot`` has matplotlib."""
    from .args import BenchError

    if getattr(args, "plot", None):
        from .plot import matplotlib_missing

        why = matplotlib_missing()
        if why:
            raise BenchError(f"--plot needs matplotlib ({why}): pip install matplotlib, or the "
                             "kvcopy[plot] extra; nothing was measured")
    for flag in ("json", "csv", "plot"):
        path = getattr(args, flag, None)
        if not path or path == "-":
            continue
        if os.path.isdir(path):
            raise BenchError(f"--{flag} {path} is a folder; name a file")
        if not getattr(args, "overwrite", False) and _tracked_by_git(path):
            raise BenchError(f"--{flag} {path} is a file git tracks (a committed result): write to another "
                             "path (bench/out/ is ignored by git), or pass --overwrite to replace it")


def _tracked_by_git(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    folder = os.path.dirname(os.path.abspath(path))
    try:
        proc = subprocess.run(["git", "-C", folder, "ls-files", "--error-unmatch", os.path.abspath(path)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def write_file(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
