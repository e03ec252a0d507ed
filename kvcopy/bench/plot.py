"""``--plot PNG`` of ``kvcopy-bench run``/``sweep``: GB/s per method (needs matplotlib).

A sweep (several chunk sizes) gives one panel per (direction, group count), rows by
direction and columns by group count, GB/s against chunk size with one line per method,
both axes logarithmic (the baselines sit 5-50x below the floor); a run gives one panel
per direction, GB/s against the number of KV cache groups (bars when there is one group
count). The memcpy floor is dashed; a point whose ratio is flagged as noise
(:func:`kvcopy.bench.output.noise_flags`) is drawn hollow. The figure's title is the
scenario and the machine, so a PNG read on its own says what it shows.
"""
from __future__ import annotations

import importlib
import textwrap
from typing import Dict, Optional


def matplotlib_missing() -> Optional[str]:
    """None when matplotlib imports, else why not."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        return str(exc)
    return None


def plot(result: dict, path: str, flags: Dict[int, str]) -> str:
    """Write the figure to ``path``; ``flags``: :func:`kvcopy.bench.output.noise_flags`
    of ``result``. Returns the line to print."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .units import fmt_bytes

    rows = [r for r in result["results"] if r.get("gbps")]
    sweep = len({r["chunk_bytes"] for r in rows}) > 1
    dirs = list(dict.fromkeys(r["direction"] for r in rows))
    groups = sorted({r["groups"] for r in rows}) if sweep else [None]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(len(dirs), len(groups), figsize=(4.6 * len(groups) + 1.4, 3.4 * len(dirs) + 1.1),
                             squeeze=False, sharey="row")
    for i, d in enumerate(dirs):
        for j, g in enumerate(groups):
            ax = axes[i][j]
            mine = [r for r in rows if r["direction"] == d and (g is None or r["groups"] == g)]
            if sweep:
                _lines(ax, mine, methods, colors, flags, "chunk_bytes")
                ticks = sorted({r["chunk_bytes"] for r in mine})
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], fontsize=8)
                ax.set_xlabel("contiguous chunk")
                ax.set_title(f"{d}, {g} KV cache group{'' if g == 1 else 's'}", fontsize=10)
            else:
                xs = sorted({r["groups"] for r in mine})
                if len(xs) > 1:
                    _lines(ax, mine, methods, colors, flags, "groups")
                    ax.set_xticks(xs, [str(x) for x in xs])
                else:
                    _bars(ax, mine, methods, colors, flags)
                ax.set_xlabel("KV cache groups")
                ax.set_title(d, fontsize=10)
            if j == 0:
                ax.set_ylabel("GB/s (higher is better)")
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8, title="method", title_fontsize=8)
    fig.suptitle(_title(result), fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1 - 1.2 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"--plot: wrote {path}"


def _lines(ax, rows, methods, colors, flags, xkey: str) -> None:
    for m in methods:
        pts = sorted((r[xkey], r["gbps"], id(r) in flags) for r in rows if r["method"] == m)
        if not pts:
            continue
        style = "--" if m == "memcpy" else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[m], label=m, linewidth=1.4)
        for x, y, noisy in pts:
            ax.plot([x], [y], "o", color=colors[m], markersize=4.5, markerfacecolor="white" if noisy else colors[m])


def _bars(ax, rows, methods, colors, flags) -> None:
    for k, m in enumerate(methods):
        mine = [r for r in rows if r["method"] == m]
        if mine:
            r = mine[0]
            noisy = id(r) in flags
            ax.bar([k], [r["gbps"]], color="white" if noisy else colors[m], edgecolor=colors[m],
                   hatch="//" if m == "memcpy" else None, label=m)
    ax.set_xticks(range(len(methods)), methods, fontsize=8, rotation=30)


def _title(result: dict) -> str:
    env = result["env"]
    where = env.get("gpu") or f"CPU, {env.get('cpu_count')} cores"
    th = result.get("threads")
    threads = f", {th['count']} thread{'' if th['count'] == 1 else 's'}" if th and env.get("device") == "cpu" else ""
    head = (f"kvcopy-bench {result['command']} on {env.get('device')} ({where}{threads}), "
            f"{str(env.get('date', ''))[:10]}, commit {str(env.get('commit'))[:12]}; hollow: flagged as noise")
    return head + "\n" + "\n".join(textwrap.wrap(str(result.get("description", "")), 150))
