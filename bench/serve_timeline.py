"""Per-request phases of the arena connectors in ``bench/serve_pd.py``, and their timeline.

The hooks' ``kvcopy_timeline`` (kvcopy.testing.engine.hooks) gives, per P step, the
``time.monotonic()`` of ``bind_connector_metadata`` (the forward starts), of every
``save_kv_layer`` (a layer's attention wrote its KV), of every layer-wise unit copy's start
and end, of ``wait_for_save`` entered (``fwd_end``: the forward is done, the **prefill
end**) and returned (``saved``: P's records are made), with the requests whose prefill
ended in it; and, per request D pulled, when D's puller took it, posted its READ, and when
the READ and scatter completed (**KV ready**). One clock for every process of the host,
so P's, D's and the client's times compare. :func:`attach_events` joins them to the
client's requests through P's request id (``kv_transfer_params["remote_request_id"]``), or,
for a push under concurrent dispatch (D names its own id), through the id without the
engine's random suffix.

Phases of a request (:data:`PHASES`, seconds):

* ``p_forward_s``: the forward of the step its prefill ended in;
* ``p_tail_s``: ``wait_for_save``, after the forward: the whole copy (``arena``), or the
  last layers' copies and the record (``arena-layerwise``);
* ``end_to_ready_s``: prefill end to KV ready at D (P's tail, P's answer through the
  proxy to D, D's scheduling, record fetch, READ and scatter);
* ``sent_to_ready_s``: D got the request (the client sent it) to KV ready;
* ``end_to_first_s``: prefill end to the first token at the client: the part of the
  client's time to first token a transfer mode changes (P's queue and forward, which
  load on a shared machine moves by seconds, left out);
* ``ttft_d_s``: D's time to first token at the client.

A push adds (:data:`PUSH_PHASES`, joined to P's events by the reservation's token):

* ``reserve_to_took_s``: D sent its RESERVE to P's worker taking it from P's listener;
* ``took_to_end_s``: that to P's prefill end (negative: the reservation came after it);
* ``end_to_post_s``: prefill end to P's WRITE posted (P's staging, and the reservation
  if it came later);
* ``write_s``: WRITE posted to its end seen on P (``f`` sent in that poll);
* ``f_to_landing_s``: that to D seeing ``f`` (D's ``reservations.complete`` called; P's time is
  taken after its poll returned, so this can be slightly negative);
* ``landing_s``: D's check of the record and its scatter (KV ready at its end);
* ``ready_to_first_s``: KV ready to the first token at the client (D's scheduler
  taking the request, its decode step, the stream);
* a layer-wise push's chunk WRITEs (``push_chunk_bytes``): ``chunks`` (how many),
  ``chunk_write_s_median`` and ``last_chunk_write_s``: a chunk from P's post to D reading
  P's ``c`` for it (the WRITE over the link, P's status check seeing it end, the
  notice): what sending one chunk takes, one layer where a layer's pages are at least
  ``push_chunk_bytes``.

:func:`plot_timeline` draws one request per connector on one time axis (0 = prefill end,
matplotlib): P's forward, per layer its ``save_kv_layer`` tick and its copy,
``wait_for_save``, P's answer reaching D, D's record fetch, READ, and first token; for a
push, D's reservation, each chunk WRITE (post to D reading its ``c``), the final WRITE
and D's landing.
``python bench/serve_timeline.py SERVE_JSON OUT_PNG`` draws a saved run again.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

PHASES = (("p_forward_s", "P forward"), ("p_tail_s", "P after forward"), ("end_to_ready_s", "prefill end->KV ready"),
          ("sent_to_ready_s", "D request->KV ready"), ("end_to_first_s", "prefill end->1st token"),
          ("ttft_d_s", "TTFT at D"))

PUSH_PHASES = (("reserve_to_took_s", "RESERVE->P took"), ("took_to_end_s", "P took->prefill end"),
               ("end_to_post_s", "prefill end->WRITE"), ("write_s", "WRITE->f sent"),
               ("f_to_landing_s", "f sent->D saw"), ("landing_s", "D check+scatter"),
               ("ready_to_first_s", "KV ready->1st token"))


def _layer_index(name: str) -> int:
    digits = [int(part) for part in name.replace(".", " ").split() if part.isdigit()]
    return digits[0] if digits else -1


def _base_id(request_id: str) -> str:
    """A vLLM engine's request id without the random suffix its engine added (``-`` and 8
    hex digits), which differs on P and D for one client request."""
    head, dash, tail = request_id.rpartition("-")
    return head if dash and len(tail) == 8 and all(c in "0123456789abcdefABCDEF" for c in tail) else request_id


def attach_events(results: List[Dict[str, Any]], p_timeline: Dict[str, Any], d_timeline: Dict[str, Any]) -> None:
    """Add each request's events and phases (module docstring) to its result, in place."""
    steps = {rid: s for s in p_timeline["steps"] for rid in s.get("final", ())}
    pulls = {p["p_request"]: p for p in d_timeline["pulls"]}
    for p in d_timeline["pulls"]:  # a push under concurrent dispatch: D named its own id, P's shares its base
        pulls.setdefault(_base_id(p["p_request"]), p)
    unit_layers = p_timeline.get("unit_layers")
    pushes = p_timeline.get("pushes") or {}
    for r in results:
        step = steps.get(r["p_request"])
        pull = pulls.get(r["p_request"]) or pulls.get(_base_id(r["p_request"] or ""))
        if step is None or pull is None:
            r["events"] = None
            continue
        copies = []
        for c in step.get("copies", ()):
            if r["p_request"] in c["requests"] and "end" in c:
                names = [n for u in c["units"] for n in (unit_layers[u] if unit_layers else [str(u)])]
                # the copy's end for this request: before it was handed to the chunked push (whose
                # posts run inside the same call), else the call's end
                handed = c.get("handed") or {}
                end = handed.get(r["p_request"], c["end"])
                # and its start: after the hand-ons of the requests before it in the call
                start = max([c["start"]] + [t for rid, t in (c.get("handed_end") or {}).items()
                                            if rid != r["p_request"] and handed.get(rid, end) <= end])
                copies.append({"layers": names, "start": start, "end": end})
        r["events"] = {"bind": step["bind"], "fwd_end": step["fwd_end"], "saved": step["saved"],
                       "layers": [list(x) for x in step.get("layers", ())], "copies": copies,
                       "taken": pull["taken"], "posted": pull["posted"], "kv_ready": pull["kv_ready"],
                       "d_sent": r["d_sent"], "d_first": r["d_first"]}
        e = r["events"]
        r.update(p_forward_s=e["fwd_end"] - e["bind"], p_tail_s=e["saved"] - e["fwd_end"],
                 end_to_ready_s=e["kv_ready"] - e["fwd_end"], sent_to_ready_s=e["kv_ready"] - e["d_sent"],
                 end_to_first_s=None if e["d_first"] is None else e["d_first"] - e["fwd_end"])
        push = pushes.get(pull.get("token") or "")
        if push and all(k in push for k in ("took", "post", "closed")) and pull.get("landing") is not None:
            e.update(reserve_sent=pull["posted"], p_took=push["took"], write_post=push["post"],
                     write_closed=push["closed"], d_landing=pull["landing"])
            r.update(reserve_to_took_s=push["took"] - pull["posted"], took_to_end_s=e["fwd_end"] - push["took"],
                     end_to_post_s=push["post"] - e["fwd_end"], write_s=push["closed"] - push["post"],
                     f_to_landing_s=pull["landing"] - push["closed"], landing_s=e["kv_ready"] - pull["landing"],
                     ready_to_first_s=None if e["d_first"] is None else e["d_first"] - e["kv_ready"])
        chunks = _chunks(push, pull, unit_layers)
        if chunks:
            e["chunks"] = chunks
            sent = [c["seen"] - c["post"] for c in chunks if c["seen"] is not None]
            r.update(chunks=len(chunks), chunk_write_s_median=statistics.median(sent) if sent else None,
                     last_chunk_write_s=sent[-1] if sent and chunks[-1]["seen"] is not None else None)
        if copies:
            last = max(copies, key=lambda c: c["end"])
            r["last_copy_s"] = last["end"] - last["start"]
            r["copy_after_end_s"] = max(0.0, last["end"] - e["fwd_end"])  # copy time left when the forward ended
            r["copy_s_median"] = statistics.median(c["end"] - c["start"] for c in copies)


def _chunks(push: Optional[Dict[str, Any]], pull: Dict[str, Any], unit_layers) -> List[Dict[str, Any]]:
    """A layer-wise push's chunk WRITEs, in the order P posted them: their units and
    layers, P's ``post``/``post_done``, and ``seen``, when D read P's ``c`` for them (the
    WRITE ended on P, P's status check saw it, the notice crossed; None: not seen)."""
    seen: Dict[Tuple[int, int], float] = {}  # (lo, hi) -> when D had it from every P rank that sent it
    for lo, hi, t, *_sender in pull.get("chunks") or ():
        seen[(lo, hi)] = max(t, seen.get((lo, hi), t))
    out = []
    for lo, hi, t0, t1 in (push or {}).get("chunks") or ():
        names = [n for u in range(lo, hi) for n in (unit_layers[u] if unit_layers else [str(u)])]
        out.append({"units": [lo, hi], "layers": names, "post": t0, "post_done": t1, "seen": seen.get((lo, hi))})
    return out


def phase_summary(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Median of every phase, per prompt length; how many requests had their events."""
    out: Dict[str, Any] = {"timed": sum(r.get("events") is not None for r in results), "phases": {}}
    keys = [k for k, _ in PHASES + PUSH_PHASES] + ["last_copy_s", "copy_after_end_s", "copy_s_median",
                                                    "chunks", "chunk_write_s_median", "last_chunk_write_s"]
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


def plot_timeline(rows: Sequence[Dict[str, Any]], path: str, title: str) -> str:
    """One panel per row (a connector's run): its :func:`representative` request, on one
    time axis in ms from P's prefill end; the per-layer copy figures as text beside it."""
    panels = [(row["connector"], r) for row in rows for r in [representative(row)] if r is not None]
    if not panels:
        return "no timeline (no timed request)"
    try:
        import matplotlib
    except ImportError as exc:
        return f"no timeline ({exc}; pip install matplotlib, the kvcopy[plot] extra)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = 1000.0
    heights = [len(r["events"]["layers"]) + len(r["events"].get("chunks", ())) + 8 for _, r in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 0.22 * sum(heights) + 1.5), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, sharex=True)
    for ax, (connector, r) in zip(axes[:, 0], panels):
        e = r["events"]

        def rel(t: float, e=e) -> float:
            return (t - e["fwd_end"]) * ms

        lanes: List[str] = []

        def lane(label: str, t0: float, t1: float, color: str, note: str = "", ax=ax, lanes=lanes) -> None:
            y = len(lanes)
            lanes.append(label)
            ax.broken_barh([(t0, max(t1 - t0, 0.05))], (y - 0.35, 0.7), color=color)
            if note:
                ax.text(t1, y, " " + note, va="center", fontsize=7)

        lane("P forward (last step)", rel(e["bind"]), 0.0, "#8fa9d6", f"{r['p_forward_s'] * ms:.0f} ms")
        copies = {name: c for c in e["copies"] for name in c["layers"]}
        for name, t in sorted(e["layers"], key=lambda item: _layer_index(item[0])):
            y = len(lanes)
            lanes.append(f"layer {_layer_index(name)}")
            ax.plot([rel(t)], [y], marker="|", color="black", markersize=9)
            c = copies.get(name)
            if c is not None:
                ax.broken_barh([(rel(c["start"]), max(rel(c["end"]) - rel(c["start"]), 0.05))], (y - 0.3, 0.6),
                               color="#e08a3c")
                ax.text(1.0, y, f" copy {(c['end'] - c['start']) * ms:.2f} ms, ends {rel(c['end']):+.1f} ms",
                        va="center", fontsize=6, transform=ax.get_yaxis_transform())
        lane("P wait_for_save", 0.0, rel(e["saved"]), "#c0504d", f"{r['p_tail_s'] * ms:.2f} ms")
        if "write_post" in e:  # a push: D reserved while P computed, P WRITEs
            lane("D: request -> RESERVE sent", rel(e["d_sent"]), rel(e["reserve_sent"]), "#9bbb59")
            lane("RESERVE -> P's worker took it", rel(e["reserve_sent"]), rel(e["p_took"]), "#bbbbbb",
                 f"{r['reserve_to_took_s'] * ms:.1f} ms")
            for c in e.get("chunks", ()):
                layers = sorted({_layer_index(n) for n in c["layers"]})
                which = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else \
                    f"layer {layers[0]}" if layers else "no layer"
                end = c["seen"] if c["seen"] is not None else c["post_done"]
                lane(f"P: chunk WRITE, {which} -> D saw c", rel(c["post"]), rel(end), "#9dc3e6",
                     f"{(end - c['post']) * ms:.1f} ms" + ("" if c["seen"] is not None else " (c not seen)"))
            lane("P: final WRITE posted -> ended", rel(e["write_post"]), rel(e["write_closed"]), "#4f81bd",
                 f"{r['write_s'] * ms:.1f} ms")
            lane("D: saw f, check + scatter", rel(e["d_landing"]), rel(e["kv_ready"]), "#4f81bd",
                 f"KV ready {rel(e['kv_ready']):.1f} ms")
        else:
            lane("P answer -> proxy -> D", rel(e["saved"]), rel(e["d_sent"]), "#bbbbbb")
            lane("D: schedule, fetch record", rel(e["d_sent"]), rel(e["posted"]), "#9bbb59")
            lane("D: READ + scatter", rel(e["posted"]), rel(e["kv_ready"]), "#4f81bd",
                 f"KV ready {rel(e['kv_ready']):.1f} ms")
        lane("D: to first token", rel(e["kv_ready"]), rel(e["d_first"]), "#8064a2",
             f"first token {rel(e['d_first']):.0f} ms")
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(0.0, color="red", linestyle="--", linewidth=0.8)
        ax.set_title(f"{connector}: {r['tokens']}-token request; prefill end -> KV ready "
                     f"{r['end_to_ready_s'] * ms:.1f} ms, TTFT at D {r['ttft_d_s'] * ms:.0f} ms", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from P's prefill end (wait_for_save entered, red line); "
                           "black ticks: save_kv_layer, orange: that layer's copy")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"timeline: {path}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python bench/serve_timeline.py SERVE_JSON OUT_PNG``: draw a saved run's timeline
    (the first repeat's arena connectors) again."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("serve_json")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    with open(args.serve_json) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r.get("repeat", 0) == 0 and "phases" in r]
    layers = data["args"].get("layers", 2)
    print(plot_timeline(rows, args.out, f"vLLM 0.33 P/D on the CPU, {layers}-layer Llama: "
                                        "one request per arena connector"))


if __name__ == "__main__":
    main()
