"""The serving benchmark: ``vllm serve`` P and D on the CPU, the connectors side by side.

    VLLM_TARGET_DEVICE=cpu build/engine-env/bin/python bench/serve_pd.py \\
        [--connectors stock,mirror,arena,arena-layerwise] [--requests 16] [--lengths 256,1024] \\
        [--new-tokens 8] [--concurrency 4] [--bind auto|nobind|split] [--layers 2] [--repeats 1] \\
        [--proxy sequential|concurrent] [--kv-heads 2] [--head-dim 64] [--link RATE] \\
        [--out bench/out/serve]

(the environment: ``bench/engine_env.sh``). For each connector in turn (one P/D pair on the
machine at a time), one ``vllm serve`` P and one D (``kvcopy.testing.engine.serve``, a
float32 Llama with random weights, ``--layers`` layers, ``--kv-heads`` KV heads of
``--head-dim``: ``layers x 2 x kv_heads x head_dim x 4`` bytes of KV per prompt token,
printed above the table and kept in the JSON's ``args``), then what a proxy does per
request: P runs it with ``do_remote_decode`` and ``max_tokens=1``, D streams it with P's
``kv_transfer_params``. The same requests (token-id prompts of the given lengths, in turn,
from one seed) go through every connector, ``--concurrency`` at a time; one warm-up request
first (the handshake), reported apart. Printed per connector, and written to
``OUT/serve.json`` and ``OUT/serve.png`` (matplotlib):

* time to first token at D (from sending D its request; median and p90) and P's time;
* total wall time of the N requests;
* host memory the connector stages KV through (pinned on a GPU): vLLM's host buffers, the
  arena, or none where NIXL reads the KV in place (vLLM's stock connector on a CPU);
* NIXL descriptors and bytes per READ (vLLM's ``vllm:nixl_*`` metrics on D, which the
  arena connector reports too) and D's prompt tokens by source (loaded, computed);
* whether D's tokens equal those of the first connector run, request by request;
* arena connectors, per request (the hooks' ``kvcopy_timeline``: ``time.monotonic()`` in
  P's and D's workers and here, one clock on one host): P's forward of the step where the
  prefill ended (``bind_connector_metadata`` to ``wait_for_save``), **prefill end**
  (``wait_for_save`` entered: the forward is done) to ``wait_for_save``'s return (the
  staging P does after its forward), prefill end to D's **KV ready** (D's READ and
  scatter completed), and, layer-wise, each layer's ``save_kv_layer`` time and unit
  copy start and end. ``OUT/serve_timeline.png`` draws one request of each arena
  connector (:mod:`serve_timeline`, matplotlib).

``--repeats R`` runs the connector list R times, the order reversed every other time (a
fresh pair each time: A B C, C B A, A B C ...), so that load changes on a shared machine
fall on every connector alike.

``--proxy concurrent`` sends each push connector's requests to P and D at once (vLLM's
push convention: one ``X-Request-Id``, D given P's engine id and side channel, configured
here), so D reserves while P computes; pull connectors stay sequential (D needs P's
answer to pull). The client's time to first token (``TTFT``, from sending the request,
P's leg included) is then the figure that compares the two; ``TTFT@D`` counts from
sending D its request (after P answered, when sequential).

The connectors: ``stock`` (vLLM's ``NixlConnector``), ``mirror`` (``KvcopyNixlConnector``
with ``host_buffer_on_cpu``: vLLM's host-buffer path, kvcopy's copies), ``arena``
(``KvcopyArenaConnector``), ``arena-layerwise`` (the same, P with ``layerwise``),
``arena-push`` (the same with D's ``transfer_mode: "push"``: P WRITEs),
``arena-push-layerwise`` (push, P staging layer by layer), ``arena-push-layerwise-nice19``
(the same, P's ``nixl_thread_nice`` 19: its NIXL and UCX threads yield P's CPU to the
forward), ``stock-push`` (vLLM's ``NixlPushConnector``). Descriptors and post times are read where the transfer is
posted: D's metrics for a READ, P's for a WRITE; before and after the timed requests P
is made to step once (:func:`flush_stats`), so that each WRITE counts in its own window.
``--bind nobind`` runs every engine with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` instead of vLLM's default binding (docs/vllm.md,
"With a real engine", says why the two differ for vLLM's NIXL worker). ``--bind split``
gives P's engine CPU 0 and D's CPU 1, every thread of each (its processes, OpenMP threads
and kvcopy's transfer threads: ``taskset``-like affinity, ``VLLM_CPU_OMP_THREADS_BIND``,
``KVCOPY_TRANSFER_CPUS``), as two one-core hosts would have them: D's engine steps while it
waits for KV no longer take P's core. The client and proxy threads (this process) stay
unbound.

``--link RATE`` (``1gbit``, ``200mbit``: a tc rate) puts P's engine and D's in two network
namespaces joined by a veth pair capped at RATE each way (:class:`kvcopy.bench.two_hosts.TwoHosts`,
made for the run and deleted on every exit: needs root, ``ip`` and ``tc``), as two hosts
joined by TCP: each engine's NIXL agent uses UCX's TCP transport on its veth only
(``UCX_TLS=tcp``, ``UCX_NET_DEVICES``), its side channel listens on its veth address (P
hands D that address in ``kv_transfer_params``; a pushing D names its own to P in each
reservation), and vLLM's ``VLLM_HOST_IP`` is that address. The client and the proxy
(this process's request threads) run in D's namespace, as a proxy beside D would: D's
HTTP on D's loopback, P's at P's veth address, so P's requests and its small answers
cross the link too, as do the side channels' questions and NIXL's notifications. Each row
gets ``link``: the bytes that left P's and D's veth (tc's counters) while the timed
requests ran, against ``prompt_kv_bytes`` (the prompts' KV): P's side carries the KV,
READ or WRITten. The hooks' timeline still runs on one clock (one host's monotonic clock).

A request that fails (an HTTP error, no answer within ``TIMEOUT_S``) is recorded as failed
(``failed_requests``, its error in ``results``) and the run goes on; the figures are over
the requests that completed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcopy.bench import two_hosts  # noqa: E402
from kvcopy.bench.output import Progress  # noqa: E402
from kvcopy.testing.engine.models import build_model, kv_bytes_per_token  # noqa: E402
from kvcopy.testing.engine.pd import (  # noqa: E402
    CONNECTORS, HOOKS, kv_transfer_config, link_side_env, random_prompts, side_channel_env,
)
from kvcopy.testing.engine.serve import (  # noqa: E402
    PrefillEngine, PrefillLeg, Server, metric_sum, metrics, post_json, prefill_body, rpc, stream_first_token,
)
from serve_timeline import PHASES, PUSH_PHASES, attach_events, phase_summary, plot_timeline  # noqa: E402

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
PUSH_VARIANTS = {"arena-push": ("arena", {"transfer_mode": "push"}),
                 "arena-push-layerwise": ("arena", {"transfer_mode": "push", "layerwise": True}),
                 "arena-push-layerwise-nice19": ("arena", {"transfer_mode": "push", "layerwise": True}),
                 "stock-push": ("stock", None)}
# kvcopy options given to P's engine only (D keeps its defaults): nixl_thread_nice is a
# P setting for a P whose D's all push (docs/vllm.md, the arena options)
P_OPTIONS = {"arena-push-layerwise-nice19": {"nixl_thread_nice": 19}}
KNOWN = CONNECTORS + tuple(PUSH_VARIANTS)
TIMEOUT_S = 300.0  # one HTTP request


def connector_config(connector: str):
    """vLLM's KVTransferConfig fields of a benchmark connector name (:data:`KNOWN`)."""
    if connector == "stock-push":
        return dict(kv_transfer_config("stock"), kv_connector="NixlPushConnector")
    base, opts = PUSH_VARIANTS.get(connector, (connector, None))
    return kv_transfer_config(base, **(opts or {}))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help=f"comma-separated: {', '.join(KNOWN)}")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--lengths", default="256,1024", help="prompt lengths in tokens, used in turn")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--bind", choices=("auto", "nobind", "split"), default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND; split: P on CPU 0, D on CPU 1 (module docstring)")
    ap.add_argument("--proxy", choices=("sequential", "concurrent"), default="sequential",
                    help="how push connectors are dispatched (pull connectors: always sequential)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2, help="the Llama's layers")
    ap.add_argument("--kv-heads", type=int, default=2, help="the Llama's KV heads (query heads: 2x, at least 4)")
    ap.add_argument("--head-dim", type=int, default=64, help="the Llama's head size")
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="P and D in two network namespaces over a veth capped at RATE (e.g. 1gbit; module docstring)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the connector list, in turn")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds an engine may take to start")
    ap.add_argument("--out", default="bench/out/serve")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    args.connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    bad = [c for c in args.connectors if c not in KNOWN]
    if bad or not args.connectors:
        ap.error(f"unknown connector(s) {bad}; known: {', '.join(KNOWN)}")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if any(n < 1 or n + args.new_tokens >= args.max_model_len for n in args.lengths) or args.requests < 1 \
            or args.layers < 1 or args.repeats < 1 or args.kv_heads < 1 or args.head_dim < 1:
        ap.error("each length must be >= 1 and leave room for --new-tokens below --max-model-len; "
                 "--requests, --layers, --repeats, --kv-heads, --head-dim >= 1")
    if args.link is not None:
        try:
            two_hosts.parse_rate(args.link)
        except ValueError as exc:
            ap.error(f"--link: {exc}")
        why = two_hosts.unavailable()
        if why:
            ap.error(f"--link needs network namespaces: {why}")
    return args


def one_request(p_url, d_url, prompt, new_tokens, prefill=None):
    """What the proxy does, timed: P's prefill, then D's streamed decode; with ``prefill``
    (P's coordinates) both at once (:class:`~kvcopy.testing.engine.serve.Proxy`'s two ways).
    ``ttft_s``: the client's time to first token (from sending the request, P's leg
    included); ``ttft_d_s``: from sending D its request."""
    t0 = time.monotonic()
    body = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "ignore_eos": True}
    if prefill is not None:
        rid = uuid.uuid4().hex
        leg = PrefillLeg(p_url, body, rid, TIMEOUT_S)
        t1 = time.monotonic()
        d = stream_first_token(d_url, prompt, new_tokens, TIMEOUT_S, prefill.decode_params(rid), rid)
        p = leg.wait(TIMEOUT_S)
        params, p_end = p["params"] or {}, p["at"]
    else:
        with post_json(p_url + "/v1/completions", prefill_body(body), TIMEOUT_S) as r:
            params = dict(json.loads(r.read())["kv_transfer_params"])
        params.pop("remote_prefill_cached_tokens", None)
        t1 = p_end = time.monotonic()
        d = stream_first_token(d_url, prompt, new_tokens, TIMEOUT_S, params)
    first = t1 + d["ttft_s"] if d["ttft_s"] is not None else None
    return {"p_s": p_end - t0, "ttft_d_s": d["ttft_s"], "ttft_s": None if first is None else first - t0,
            "d_s": d["total_s"], "token_ids": d["token_ids"], "tokens": len(prompt),
            "p_request": params.get("remote_request_id"), "d_sent": t1, "d_first": first}


def flush_stats(url):
    """One engine step on ``url`` (a 1-token prompt, nothing to transfer), so that its
    connector's figures recorded since its last step reach its metrics. A pushing P's
    WRITE ends on its housekeeping thread after P's step, and P's engine, idle, does not
    step again until its next request: the WRITE's figures (``get_kv_connector_stats``,
    taken once per step) would otherwise be counted with the next request's, the
    warm-up's in the timed window and the last timed request's out of it (seen: 3 WRITEs
    counted for 2 requests). vLLM records a step's stats before that step's outputs
    reach the HTTP handler, so they are in the metrics once this returns."""
    body = {"model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    with post_json(url + "/v1/completions", body, TIMEOUT_S) as r:
        r.read()


def try_request(p_url, d_url, prompt, new_tokens, prefill=None):
    """:func:`one_request`, or what failed: a run goes on past one request P or D did not answer."""
    try:
        return one_request(p_url, d_url, prompt, new_tokens, prefill)
    except Exception as exc:  # noqa: BLE001 -- any failure of one request is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "tokens": len(prompt), "token_ids": None,
                "p_request": None}


def engine_envs(args, env):
    """P's and D's environments and CPUs under ``--bind``."""
    if args.bind == "nobind":
        env = dict(env, VLLM_CPU_OMP_THREADS_BIND="nobind")
    if args.bind != "split":
        return (env, None), (env, None)
    return tuple((dict(env, VLLM_CPU_OMP_THREADS_BIND=str(cpu), KVCOPY_TRANSFER_CPUS=str(cpu)), [cpu])
                 for cpu in (0, 1))


def concurrent(args, connector) -> bool:
    """Whether ``connector`` runs behind the concurrent proxy: a push connector with
    ``--proxy concurrent`` (a pulling D needs P's answer first)."""
    return args.proxy == "concurrent" and connector in PUSH_VARIANTS


def link_bytes(net):
    """Bytes that left P's and D's veth so far (tc's counters), or None without a link."""
    return None if net is None else {side: net.sent_bytes(side) for side in ("p", "d")}


def run_connector(args, connector, model, prompts, progress, net=None):
    """One P/D pair through the requests; with ``net`` (a started ``TwoHosts``) P and D in
    its two namespaces and this thread (and the request threads it starts) in D's."""
    (p_env, p_cpus), (d_env, d_cpus) = engine_envs(args, {"VLLM_SERVER_DEV_MODE": "1"})
    if net is None:
        p_side, d_side, p_run, d_run = side_channel_env(), side_channel_env(), {}, {}
    else:  # P's HTTP on its veth address (the client reaches it over the link), D's on D's loopback
        p_side, d_side = link_side_env(net, "p"), link_side_env(net, "d")
        p_run = {"host": net.address("p"), "prefix": net.exec_prefix("p")}
        d_run = {"prefix": net.exec_prefix("d")}
    kv = connector_config(connector)
    extra = ["--worker-extension-cls", HOOKS]
    p_kv = dict(kv, engine_id=f"{connector}-P")  # P's id, known to the concurrent proxy
    if connector in P_OPTIONS:
        own = dict(kv["kv_connector_extra_config"]["kvcopy"], **P_OPTIONS[connector])
        p_kv["kv_connector_extra_config"] = dict(kv["kv_connector_extra_config"], kvcopy=own)
    p = Server(f"{connector}-P", model, os.path.join(args.out, f"{connector}-P.log"), p_kv,
               max_model_len=args.max_model_len, env=dict(p_env, **p_side), extra_args=extra, cpus=p_cpus, **p_run)
    prefill = PrefillEngine(p_kv["engine_id"], p_side["VLLM_NIXL_SIDE_CHANNEL_HOST"],
                            int(p_side["VLLM_NIXL_SIDE_CHANNEL_PORT"])) if concurrent(args, connector) else None
    d = Server(f"{connector}-D", model, os.path.join(args.out, f"{connector}-D.log"), kv,
               max_model_len=args.max_model_len, env=dict(d_env, **d_side), extra_args=extra, cpus=d_cpus, **d_run)
    with net.inside("d") if net is not None else contextlib.nullcontext():
        return _run_pair(args, connector, p, d, prefill, prompts, progress, net)


def _run_pair(args, connector, p, d, prefill, prompts, progress, net):
    try:
        p.start()
        d.start()
        p.wait_ready(args.start_timeout)
        d.wait_ready(args.start_timeout)
        warm = one_request(p.url, d.url, random_prompts([64], seed=99)[0], args.new_tokens, prefill)
        timed = connector.startswith("arena")
        if timed:  # the first call starts recording
            rpc(p.url, "kvcopy_timeline")
            rpc(d.url, "kvcopy_timeline")
        if connector in PUSH_VARIANTS:  # the warm-up's WRITE counted before the window (flush_stats)
            flush_stats(p.url)
        before, p_before = metrics(d.url), metrics(p.url)
        link0 = link_bytes(net)
        t0 = time.monotonic()
        pool = ThreadPoolExecutor(args.concurrency)
        try:
            futures = [pool.submit(try_request, p.url, d.url, q, args.new_tokens, prefill) for q in prompts]
            results = []
            for f in futures:
                results.append(f.result())
                progress.step(connector)
        finally:  # interrupted (SIGTERM, ^C): not waiting for requests in flight; killing P and D ends them
            pool.shutdown(wait=False, cancel_futures=True)
        wall = time.monotonic() - t0
        link1 = link_bytes(net)
        if connector in PUSH_VARIANTS:  # the last requests' WRITEs counted in the window
            flush_stats(p.url)
        after, p_after = metrics(d.url), metrics(p.url)
        staging = rpc(d.url, "kvcopy_staging_bytes")[0]
        if timed:
            p_timeline, d_timeline = rpc(p.url, "kvcopy_timeline")[0], rpc(d.url, "kvcopy_timeline")[0]
            attach_events(results, p_timeline, d_timeline)
            turns = {"p": p_timeline.get("turns"), "d": d_timeline.get("turns")}
            layerwise = rpc(p.url, "kvcopy_layerwise_stats")[0]
    finally:
        d.kill()
        p.kill()
    row = dict(summarize(connector, results, warm, wall, before, after, staging),
               proxy="concurrent" if prefill is not None else "sequential",
               prompt_kv_bytes=sum(len(q) for q in prompts) * args.kv_bytes_per_token)
    if net is not None:  # what crossed the link during the timed requests, each way
        row["link"] = {"rate": net.rate, "p_sent_bytes": link1["p"] - link0["p"],
                       "d_sent_bytes": link1["d"] - link0["d"]}
    if timed:
        row.update(phase_summary(results), layerwise=layerwise, housekeeping_turns_per_s={
            k: None if n is None else n / wall for k, n in turns.items()})
    if connector in PUSH_VARIANTS:  # WRITEs, posted and counted on P
        row.update(_transfers(p_before, p_after))
    return row


def _delta(before, after, name, **labels):
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def _transfers(before, after):
    reads = _delta(before, after, "vllm:nixl_num_descriptors_count")
    return {"reads": reads,
            "descriptors_per_read": _delta(before, after, "vllm:nixl_num_descriptors_sum") / reads if reads else None,
            "bytes_per_read": _delta(before, after, "vllm:nixl_bytes_transferred_sum") / reads if reads else None,
            "post_s_per_read": _delta(before, after, "vllm:nixl_post_time_seconds_sum") / reads if reads else None}


def summarize(connector, results, warm, wall, before, after, staging):
    done = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    if not done:
        raise RuntimeError(f"{connector}: no request completed: {results[0].get('error')}")
    ttft = sorted(r["ttft_d_s"] for r in done)
    client = sorted(r["ttft_s"] for r in done)
    return {
        "connector": connector, "requests": len(results), "failed_requests": len(results) - len(done), "wall_s": wall,
        "ttft_d_median_s": statistics.median(ttft), "ttft_d_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_median_s": statistics.median(client), "ttft_p90_s": client[int(0.9 * (len(client) - 1))],
        "p_median_s": statistics.median(r["p_s"] for r in done), "warmup_ttft_d_s": warm["ttft_d_s"],
        "staging_bytes": staging["bytes"], "staging_buffers": staging["buffers"],
        **_transfers(before, after),
        "failed_transfers": _delta(before, after, "vllm:nixl_num_failed_transfers_total"),
        "prompt_tokens": {s: _delta(before, after, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES},
        "ttft_d_s": [r["ttft_d_s"] for r in done], "token_ids": [r["token_ids"] for r in results],
        "results": [{k: v for k, v in r.items() if k != "token_ids"} for r in results],
    }


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def describe_model(args):
    """The model line above the table: its KV per token and per request of each length."""
    per = args.kv_bytes_per_token
    lengths = ", ".join(f"{n} tokens {per * n / 2**20:.2f} MiB" for n in args.lengths)
    line = (f"model: {args.layers}-layer float32 Llama, {args.kv_heads} KV heads x {args.head_dim}: "
            f"{per / 1024:g} KiB of KV per prompt token; per request: {lengths}")
    if args.link:
        line += (f"\nlink: P and D in two network namespaces over a veth capped at {args.link} each way "
                 "(client and proxy in D's namespace)")
    return line


def print_table(rows):
    ref = rows[0]["token_ids"]
    link = any("link" in r for r in rows)
    head = ("run", "connector", "proxy", "TTFT med", "p90", "TTFT@D med", "P med", "wall", "staging host mem",
            "desc/xfer", "MiB/xfer", "post ms/xfer", "loaded/computed tok", "failed", "= " + rows[0]["connector"])
    if link:
        head += ("prompt KV MiB", "link MiB P->D / D->P")
    lines = [head]
    for r in rows:
        same = sum(a is not None and a == b for a, b in zip(r["token_ids"], ref))
        pt = r["prompt_tokens"]
        lines.append((str(r.get("repeat", 0)), r["connector"], r.get("proxy", "sequential"),
                      f"{r['ttft_median_s']:.3f} s", f"{r['ttft_p90_s']:.3f} s", f"{r['ttft_d_median_s']:.3f} s",
                      f"{r['p_median_s']:.3f} s", f"{r['wall_s']:.1f} s",
                      f"{_mib(r['staging_bytes'])} ({r['staging_buffers']} buf)",
                      "-" if r["descriptors_per_read"] is None else f"{r['descriptors_per_read']:.0f}",
                      "-" if r["bytes_per_read"] is None else f"{r['bytes_per_read'] / 2**20:.2f}",
                      "-" if r["post_s_per_read"] is None else f"{r['post_s_per_read'] * 1e3:.2f}",
                      f"{pt['external_kv_transfer']:.0f}/{pt['local_compute']:.0f}", str(r.get("failed_requests", 0)),
                      f"{same}/{len(ref)}")
                     + ((f"{r['prompt_kv_bytes'] / 2**20:.2f}",
                         f"{r['link']['p_sent_bytes'] / 2**20:.2f} / {r['link']['d_sent_bytes'] / 2**20:.2f}")
                        if link else ()))
    _print_lines(lines)


def print_phases(rows):
    """The arena connectors' phases (:mod:`serve_timeline`), median per prompt length, per run."""
    timed = [r for r in rows if "phases" in r]
    if not timed:
        return
    print("\nper request, median per prompt length (ms); runs in the order they ran")
    head = ("run", "connector", "tokens", "timed") + tuple(label for _, label in PHASES) + ("last layer copy",)
    lines = [head]
    for r in timed:
        for n, ph in r["phases"].items():
            lines.append((str(r["repeat"]), r["connector"], n, str(r["timed"]))
                         + tuple(f"{ph[k] * 1e3:.2f}" if k in ph else "-" for k, _ in PHASES)
                         + (f"{ph['last_copy_s'] * 1e3:.2f}" if "last_copy_s" in ph else "-",))
    _print_lines(lines)
    push = [r for r in timed if any(k in ph for ph in r["phases"].values() for k, _ in PUSH_PHASES)]
    if push:
        print("\npushes, per request, median per prompt length (ms): where prefill end -> first token goes")
        lines = [("run", "connector", "tokens") + tuple(label for _, label in PUSH_PHASES)
                 + ("chunks", "chunk WRITE->D saw c", "last chunk")]
        for r in push:
            for n, ph in r["phases"].items():
                lines.append((str(r["repeat"]), r["connector"], n)
                             + tuple(f"{ph[k] * 1e3:.2f}" if k in ph else "-" for k, _ in PUSH_PHASES)
                             + (f"{ph['chunks']:g}" if "chunks" in ph else "-",)
                             + tuple(f"{ph[k] * 1e3:.2f}" if ph.get(k) is not None else "-"
                                     for k in ("chunk_write_s_median", "last_chunk_write_s")))
        _print_lines(lines)


def _print_lines(lines):
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(lines[0]))]
    for ln in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(ln, widths)))


def plot(rows, args, path):
    try:
        import matplotlib
    except ImportError as exc:
        return f"no plot ({exc}; pip install matplotlib, the kvcopy[plot] extra)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.boxplot([r["ttft_d_s"] for r in rows], tick_labels=[r["connector"] for r in rows])
    ax1.set_ylabel("time to first token at D (s)")
    ax1.set_title(f"{args.requests} requests, lengths {args.lengths}, concurrency {args.concurrency}")
    ax2.bar([r["connector"] for r in rows], [r["staging_bytes"] / 2**20 for r in rows])
    ax2.set_ylabel("host staging memory (MiB)")
    ax2.set_title("host memory KV is staged through")
    where = f", link {args.link}" if args.link else ""
    fig.suptitle(f"vLLM 0.33 P/D on the CPU ({args.layers}-layer Llama, bind={args.bind}{where})")
    fig.tight_layout()
    fig.savefig(path)
    return f"plot: {path}"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds: engines killed, the link's namespaces deleted


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    spec = build_model("llama", os.path.join(args.out, "model"), seed=0, num_layers=args.layers,
                       num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    args.kv_bytes_per_token = kv_bytes_per_token(spec)
    prompts = random_prompts([args.lengths[i % len(args.lengths)] for i in range(args.requests)], seed=7)
    progress = Progress(len(prompts) * len(args.connectors) * args.repeats, args.quiet)
    rows = []
    net = None
    if args.link:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        net = two_hosts.TwoHosts(rate=args.link).start()  # one link for the whole run, each pair on it in turn
    try:
        for rep in range(args.repeats):
            for c in (args.connectors if rep % 2 == 0 else args.connectors[::-1]):
                rows.append(dict(run_connector(args, c, spec.path, prompts, progress, net), repeat=rep))
                with open(os.path.join(args.out, "serve.json"), "w") as f:  # after every run: a later one may fail
                    json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=1)
    finally:
        if net is not None:
            net.close()
    print(describe_model(args))
    print_table(rows)
    print_phases(rows)
    print(plot(rows, args, os.path.join(args.out, "serve.png")))
    first = [r for r in rows if r["repeat"] == 0 and "phases" in r]
    print(plot_timeline(first, os.path.join(args.out, "serve_timeline.png"),
                    f"vLLM 0.33 P/D on the CPU, {args.layers}-layer Llama: one request per arena connector"))
    print(f"results: {os.path.join(args.out, 'serve.json')} (logs beside it)")


if __name__ == "__main__":
    main()
