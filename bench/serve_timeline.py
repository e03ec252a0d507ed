"""Per-request phases of the arena connectors in ``bench/serve_pd.py``, and their timeline.

The hooks' ``kvcopy_timeline`` (kvcopy.testing.engine.hooks) gives, per P step, the
``time.monotonic()`` of ``bind_connector_metadata`` (the forward starts), of every
``save_kv_layer`` (a layer's attention wrote its KV), of every layer-wise unit copy's start
and end, of ``wait_for_save`` entered (``fwd_end``: the forward is done, the **prefill
end**) and returned (``saved``: P's records are made), with the requests whose prefill
ended in it; and, per request D pulled, when D's puller took it, posted its READ, and when
the READ and scatter completed (**KV ready**). One clock for every process of the host,
so P's, D's and the client's times compare. :func:`attach_events` joins them to the
client's requests through P's request id (``kv_transfer_params["remote_request_id"]``).

Phases of a request (:data:`PHASES`, seconds):

* ``p_forward_s``: the forward of the step its prefill ended in;
* ``p_tail_s``: ``wait_for_save``, after the forward: the whole copy (``arena``), or the
  last layers' copies and the record (``arena-layerwise``);
* ``end_to_ready_s``: prefill end to KV ready at D (P's tail, P's answer through the
  proxy to D, D's scheduling, record fetch, READ and scatter);
* ``sent_to_ready_s``: D got the request (the client sent it) to KV ready;
* ``ttft_d_s``: D's time to first token at the client.

:func:`write_svg` draws one request per connector on one time axis (0 = prefill end):
P's forward, per layer its ``save_kv_layer`` tick and its copy, ``wait_for_save``, D's
READ, and D's first token. No plotting library: the SVG is written here.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

PHASES = (("p_forward_s", "P forward"), ("p_tail_s", "P after forward"), ("end_to_ready_s", "prefill end->KV ready"),
          ("sent_to_ready_s", "D request->KV ready"), ("ttft_d_s", "TTFT at D"))


def _layer_index(name: str) -> int:
    digits = [int(part) for part in name.replace(".", " ").split() if part.isdigit()]
    return digits[0] if digits else -1


def attach_events(results: List[Dict[str, Any]], p_timeline: Dict[str, Any], d_timeline: Dict[str, Any]) -> None:
    """Add each request's events and phases (module docstring) to its result, in place."""
    steps = {rid: s for s in p_timeline["steps"] for rid in s.get("final", ())}
    pulls = {p["p_request"]: p for p in d_timeline["pulls"]}
    unit_layers = p_timeline.get("unit_layers")
    for r in results:
        step, pull = steps.get(r["p_request"]), pulls.get(r["p_request"])
        if step is None or pull is None:
            r["events"] = None
            continue
        copies = []
        for c in step.get("copies", ()):
            if r["p_request"] in c["requests"] and "end" in c:
                names = [n for u in c["units"] for n in (unit_layers[u] if unit_layers else [str(u)])]
                copies.append({"layers": names, "start": c["start"], "end": c["end"]})
        r["events"] = {"bind": step["bind"], "fwd_end": step["fwd_end"], "saved": step["saved"],
                       "layers": [list(x) for x in step.get("layers", ())], "copies": copies,
                       "taken": pull["taken"], "posted": pull["posted"], "kv_ready": pull["kv_ready"],
                       "d_sent": r["d_sent"], "d_first": r["d_first"]}
        e = r["events"]
        r.update(p_forward_s=e["fwd_end"] - e["bind"], p_tail_s=e["saved"] - e["fwd_end"],
                 end_to_ready_s=e["kv_ready"] - e["fwd_end"], sent_to_ready_s=e["kv_ready"] - e["d_sent"])
        if copies:
            last = max(copies, key=lambda c: c["end"])
            r["last_copy_s"] = last["end"] - last["start"]
            r["copy_after_end_s"] = max(0.0, last["end"] - e["fwd_end"])  # copy time left when the forward ended
            r["copy_s_median"] = statistics.median(c["end"] - c["start"] for c in copies)


def phase_summary(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Median of every phase, per prompt length; how many requests had their events."""
    out: Dict[str, Any] = {"timed": sum(r.get("events") is not None for r in results), "phases": {}}
    keys = [k for k, _ in PHASES] + ["last_copy_s", "copy_after_end_s", "copy_s_median"]
    for n in sorted({r["tokens"] for r in results}):
        rows = [r for r in results if r["tokens"] == n and r.get("events") is not None]
        out["phases"][str(n)] = {k: statistics.median(r[k] for r in rows) for k in keys
                                 if rows and all(r.get(k) is not None for r in rows)}
    return out


def representative(row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The request of the longest prompt with the median prefill end -> KV ready."""
    timed = [r for r in row["results"] if r.get("events") is not None]
    if not timed:
        return None
    longest = max(r["tokens"] for r in timed)
    timed = sorted((r for r in timed if r["tokens"] == longest), key=lambda r: r["end_to_ready_s"])
    return timed[len(timed) // 2]


def write_svg(rows: Sequence[Dict[str, Any]], path: str, title: str) -> str:
    """One panel per row (a connector's run): its :func:`representative` request."""
    panels = [(row["connector"], r) for row in rows for r in [representative(row)] if r is not None]
    if not panels:
        return "no timeline (no timed request)"
    ms = 1000.0
    lo = min((r["events"]["bind"] - r["events"]["fwd_end"]) * ms for _, r in panels)
    hi = max((r["events"]["d_first"] - r["events"]["fwd_end"]) * ms for _, r in panels)
    left, width, lane = 230, 900, 14
    x = lambda t: left + (t - lo) / (hi - lo) * width  # noqa: E731 -- ms from prefill end -> pixels
    out: List[str] = []
    y = 40

    def bar(t0: float, t1: float, label: str, color: str, note: str = "") -> None:
        nonlocal y
        out.append(f'<text x="{left - 6}" y="{y + 10}" text-anchor="end">{label}</text>')
        out.append(f'<rect x="{x(t0):.1f}" y="{y}" width="{max(1.0, x(t1) - x(t0)):.1f}" height="{lane - 3}" '
                   f'fill="{color}"/>')
        if note:
            out.append(f'<text x="{x(t1) + 4:.1f}" y="{y + 10}">{note}</text>')
        y += lane

    for connector, r in panels:
        e = r["events"]
        rel = lambda t, e=e: (t - e["fwd_end"]) * ms  # noqa: E731
        out.append(f'<text x="10" y="{y + 12}" font-weight="bold">{connector}: request of {r["tokens"]} tokens, '
                   f'prefill end -> KV ready {r["end_to_ready_s"] * ms:.1f} ms, TTFT at D '
                   f'{r["ttft_d_s"] * ms:.1f} ms</text>')
        y += 20
        bar(rel(e["bind"]), 0.0, "P forward (final step)", "#8fa9d6", f"{r['p_forward_s'] * ms:.1f} ms")
        copies = {}
        for c in e["copies"]:
            for name in c["layers"]:
                copies[name] = c
        for name, t in sorted(e["layers"], key=lambda item: _layer_index(item[0])):
            i = _layer_index(name)
            out.append(f'<text x="{left - 6}" y="{y + 10}" text-anchor="end">layer {i}</text>')
            out.append(f'<line x1="{x(rel(t)):.1f}" x2="{x(rel(t)):.1f}" y1="{y}" y2="{y + lane - 3}" '
                       f'stroke="black" stroke-width="2"/>')
            c = copies.get(name)
            if c is not None:
                out.append(f'<rect x="{x(rel(c["start"])):.1f}" y="{y + 2}" '
                           f'width="{max(1.0, x(rel(c["end"])) - x(rel(c["start"]))):.1f}" height="{lane - 7}" '
                           f'fill="#e08a3c"/>')
                out.append(f'<text x="{left + width + 6}" y="{y + 10}">copy {(c["end"] - c["start"]) * ms:.2f} ms, '
                           f'ends {rel(c["end"]):+.1f} ms</text>')
            y += lane
        bar(0.0, rel(e["saved"]), "P wait_for_save", "#c0504d", f"{r['p_tail_s'] * ms:.2f} ms")
        bar(rel(e["saved"]), rel(e["d_sent"]), "P answer -> proxy -> D", "#bbbbbb")
        bar(rel(e["d_sent"]), rel(e["posted"]), "D: schedule, fetch record", "#9bbb59")
        bar(rel(e["posted"]), rel(e["kv_ready"]), "D: READ + scatter", "#4f81bd",
            f"KV ready at {rel(e['kv_ready']):.1f} ms")
        bar(rel(e["kv_ready"]), rel(e["d_first"]), "D: to first token", "#8064a2",
            f"first token at {rel(e['d_first']):.1f} ms")
        y += 16
    # axis: ms from prefill end
    out.append(f'<line x1="{x(0):.1f}" x2="{x(0):.1f}" y1="30" y2="{y}" stroke="red" stroke-dasharray="4,3"/>')
    step = 10 ** max(0, len(str(int(hi - lo))) - 1)
    t = (lo // step) * step
    while t <= hi:
        if t >= lo:
            out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y}" y2="{y + 5}" stroke="black"/>')
            out.append(f'<text x="{x(t):.1f}" y="{y + 18}" text-anchor="middle">{t:g}</text>')
        t += step
    out.append(f'<text x="{left + width / 2}" y="{y + 36}" text-anchor="middle">ms from P\'s prefill end '
               f'(wait_for_save entered; red line). Black ticks: save_kv_layer; orange: that layer\'s copy</text>')
    height = y + 50
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 230}" height="{height}" '
            f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>'
            f'<text x="10" y="20" font-size="13" font-weight="bold">{title}</text>')
    with open(path, "w") as f:
        f.write("\n".join([head] + out + ["</svg>\n"]))
    return f"timeline: {path}"
