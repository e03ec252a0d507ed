"""Chunked push measured in vLLM's own connector classes: prefill end -> D's KV ready, per mode.

P and D are vLLM 0.33's ``Scheduler`` and the arena connector's worker with real NIXL
(UCX loopback), built as ``tests/vllm/vllm_arena_engines.py`` builds them, with a
Llama-like KV geometry (``--layers`` full-attention layers of 8 KV heads x 128,
float16, 16-token blocks). P's forward is played layer by layer on the main thread:
``--layer-ms`` of matmul (one torch thread: the model's core; several values are swept,
interleaved with the modes), then the layer's KV
written, then ``save_kv_layer``, as vLLM's attention decorator calls it; P's copy thread
runs on the other core. D steps while it has a request, as its engine does while a
request waits for remote KV. Requests go one at a time, dispatched concurrently (D gets
the request with P's coordinates when P does; P's step starts once its worker accepted
D's reservation).

Where D runs (``--placements``, interleaved request by request with the modes; P is
always this process):

* ``one``: D in P's process, stepped on a thread of its own (one interpreter, one GIL:
  ``--switch-ms`` hands the GIL over sooner than CPython's 5 ms);
* ``two``: D in a spawned process of its own (its own vLLM state and NIXL agent, as a
  deployment's D engine), driven over a pipe; it sends its KV-ready stamps and scatter
  events back over the pipe. ``time.monotonic`` is CLOCK_MONOTONIC on Linux, one clock
  for the whole machine, so D's stamps compare with P's;
* ``two-pinned``: the same with every thread of P's process on the first CPU and every
  thread of D's on the second (``os.sched_setaffinity``, set before such a request,
  reset before any other request), P's copy thread then sharing P's CPU with its forward.

Modes (same engines, same requests, interleaved):

* ``whole``: P stages the request at ``wait_for_save`` (one copy), one WRITE;
* ``layerwise-1write``: P stages layer by layer, one WRITE after staging, D scatters at ``f``;
* ``chunked``: layer-wise, units WRITten as their copies end (chunks of at least
  ``push_chunk_bytes``, 1 MiB; the last layer's unit rides in the final WRITE), D scatters each
  chunk on its ``c``;
* ``chunked-unit``: the same with a chunk per unit;
* ``chunked-unit-own-tail``: the same, the last layer's unit in a chunk WRITE of its own
  before the final WRITE (the record alone).

Per request: ``end_to_ready_ms`` (P's ``wait_for_save`` entered, the prefill end, to
D's KV ready: ``ArenaPushReceiver._finish``), ``last_layer_to_ready_ms`` (P's last
``save_kv_layer`` to KV ready), the tail's parts (the last layer's copy: how long it
waited behind the copy thread's backlog, when it ended; when the final WRITE was posted),
and per unit of ``chunked-unit`` the copy and the chunk WRITE's post (on UCX loopback
the post runs the WRITE's copy: UCX's ``cma`` put, process_vm_writev on the posting
thread) of one layer. The summary adds, per mode, the final WRITE's post returned ->
D's ``complete`` at ``f`` begins (P's poll, the notice over UCX's TCP loopback, D's step)
and D's ``complete``. ``--plot`` draws one request per placement, mode and setting.

Both processes freeze their heaps once their engines are built and warm (``gc.freeze``, as
vLLM's engine core does after its start): without it a full collection in a process holding
two engines took up to 0.34 s (P's and D's threads all stopped) inside a request now and then.

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 VENV_PY bench/push_chunks_serve.py \\
        [--modes whole,chunked-unit] [--layer-ms 4,8,16] [--placements one,two,two-pinned] \\
        --out bench/results/push-chunks-serve-....json
    ... --out FILE.json --plot PNG [--plot-modes chunked-unit]  # draw a saved run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "vllm")]  # the engines harness of the vLLM tests

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("whole", "layerwise-1write", "chunked", "chunked-unit", "chunked-unit-own-tail")
PLACEMENTS = ("one", "two", "two-pinned")


def _model_config(root: Path):
    from vllm_arena_engines import engine_process

    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
        "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
        "head_dim": 16}))
    return engine_process(model, root / "dist")


def _engine(mc, args, role, **opts):
    """P (``kv_producer``) or D of the bench's geometry: ``args.layers`` full-attention
    layers, room for two prompts of ``args.tokens`` in the KV cache, three spans in the arena."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_arena_engines import ArenaEngine

    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                                                    dtype=torch.float16) for i in range(args.layers)}
    span = args.layers * _layer_bytes(args)
    return ArenaEngine(mc, dict(block_size=16, specs=specs), role, os.environ.__setitem__,
                       num_blocks=2 * -(-args.tokens // 16) + 8, arena_bytes=3 * span,
                       nixl_thread_nice=args.nixl_thread_nice, **opts)


def _layer_bytes(args) -> int:
    return args.tokens * 8 * 128 * 2 * 2


class Events:
    """Monotonic times the wrapped methods log. ``time.monotonic`` is CLOCK_MONOTONIC on
    Linux, one clock for the whole machine, so D's process stamps compare with P's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.p_steps = []  # per P step: bind, layers [(name, t)], copies [(units, t0, t1)], fwd_end, saved
        self.final_posts = []  # (t0, t1, nbytes, descs)
        self.scatters = []  # D: (t0, t1, units)
        self.ready = {}  # D: request -> KV ready
        self.step = None

    def log(self, key, value):
        with self.lock:
            getattr(self, key).append(value)


def _instrument_p(p, ev: Events):
    pw = p.worker.arena_worker
    conn = p.worker
    real_bind, real_save = conn.bind_connector_metadata, conn.wait_for_save

    def bind(meta):
        ev.step = {"bind": time.monotonic(), "layers": [], "copies": [], "final": []}
        real_bind(meta)
        if pw.stager.layers is not None:
            ev.step["final"] = sorted(pw.stager.layers.final_parts)
        else:
            ev.step["final"] = sorted(getattr(meta, "stage", {}) or {})

    def save():
        ev.step["fwd_end"] = time.monotonic()
        real_save()
        ev.step["saved"] = time.monotonic()
        ev.log("p_steps", ev.step)
    conn.bind_connector_metadata, conn.wait_for_save = bind, save

    layers = pw.stager.layers
    real_copy, real_copied = layers._copy, layers.on_copied
    copied_at = []

    def copy(units, steps):  # the copy thread's turn: the copies, then the chunk post (on_copied)
        t0 = time.monotonic()
        copied_at.clear()
        real_copy(units, steps)
        ev.step["copies"].append((list(units), t0, copied_at[0] if copied_at else time.monotonic()))

    def on_copied(rid, units):
        copied_at.append(time.monotonic())
        real_copied(rid, units)
    layers._copy, layers.on_copied = copy, on_copied

    real_post = pw.manager.push_writes.post

    def post(token, record):
        t0 = time.monotonic()
        out = real_post(token, record)
        ev.log("final_posts", (t0, time.monotonic(), out[0], out[1]))
        return out
    pw.manager.push_writes.post = post


def _instrument_d(d, ev: Events):
    from kvcopy.nixl.modes import push_units
    from kvcopy.vllm.arena.push_recv import ArenaPushReceiver

    real_complete = d.manager.reservations.complete

    def complete(token):
        t0 = time.monotonic()
        out = real_complete(token)
        ev.log("scatters", (t0, time.monotonic(), ["complete"]))
        return out
    d.manager.reservations.complete = complete

    real_scatter = push_units.scatter

    def scatter(staging, order, us, units, summed, sums):
        t0 = time.monotonic()
        real_scatter(staging, order, us, units, summed, sums)
        ev.log("scatters", (t0, time.monotonic(), list(units)))
    push_units.scatter = scatter

    real_finish = ArenaPushReceiver._finish

    def finish(self, job):
        ev.ready[job.rid] = time.monotonic()
        return real_finish(self, job)
    ArenaPushReceiver._finish = finish


def _pin(cpus) -> None:
    """Every thread of this process onto ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


class LocalDecode:
    """D in P's process (one interpreter, one GIL): stepped on a thread of its own while it
    has requests, as its engine core does while a request waits for remote KV."""

    def __init__(self, d):
        self.d, self.lock, self.active, self.stop = d, threading.Lock(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
            if not self.active.wait(0.1):
                continue
            with self.lock:
                self.d.step()
                if not self.d.sched.has_requests():
                    self.active.clear()
            time.sleep(0.0002)

    def add(self, rid, tokens, params, max_tokens):
        with self.lock:
            self.d.add(rid, tokens, params, max_tokens=max_tokens)
            self.active.set()

    def ready(self, rid) -> bool:
        return rid in EVENTS.ready

    def finished(self, rid) -> bool:
        return rid in self.d.params

    def pin(self, cpus) -> None:
        pass  # P's process: pinned with it

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.d.close()


class DecodeProcess:
    """D in a spawned process of its own (:func:`decode_child`), driven over a pipe as
    ``tests/vllm/test_vllm_arena_flow.py`` drives its P process: ``("add", (rid, tokens, params,
    max_tokens))``, ``("pin", cpus)``, ``("stop", None)``; D reports ``("ready", rid, t,
    scatters)`` (its KV-ready stamp and the scatter/complete events since its last report)
    and ``("finished", rid)``."""

    def __init__(self, args, model_dir, root):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_child, args=(child, args, model_dir, root), daemon=True)
        self.proc.start()
        child.close()
        self.done = set()
        assert self.conn.poll(300) and self.conn.recv() == "started", "the D process did not start"

    def _drain(self):
        while self.conn.poll(0):
            msg = self.conn.recv()
            if msg[0] == "ready":
                EVENTS.ready[msg[1]] = msg[2]
                EVENTS.scatters.extend(msg[3])
            elif msg[0] == "finished":
                self.done.add(msg[1])
            elif msg[0] == "pinned":
                self.pinned = True

    def add(self, rid, tokens, params, max_tokens):
        self.conn.send(("add", (rid, tokens, params, max_tokens)))

    def ready(self, rid) -> bool:
        self._drain()
        return rid in EVENTS.ready

    def finished(self, rid) -> bool:
        self._drain()
        return rid in self.done

    def pin(self, cpus) -> None:
        self.pinned = False
        self.conn.send(("pin", cpus))
        deadline = time.monotonic() + 30
        while not self.pinned:
            assert time.monotonic() < deadline, "the D process did not pin"
            self._drain()
            time.sleep(0.001)

    def close(self):
        if self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(30)


def decode_child(conn, args, model_dir, root):
    """D's process: its engine stepped while it has requests, otherwise blocked on the
    pipe (as an engine core blocks on its input queue); see :class:`DecodeProcess`."""
    import torch

    from vllm_arena_engines import engine_process

    torch.set_num_threads(1)
    sys.setswitchinterval(args.switch_ms / 1e3)
    d = _engine(engine_process(model_dir, Path(root) / "dist-d"), args, "kv_consumer", transfer_mode="push")
    d.raw.fill_(0x5A)
    ev = Events()
    _instrument_d(d, ev)
    gc.freeze()  # as vLLM's engine core after its start (module docstring)
    conn.send("started")
    told, finished = set(), set()
    try:
        while True:
            if conn.poll(0 if d.sched.has_requests() else None):
                cmd, arg = conn.recv()
                if cmd == "stop":
                    break
                if cmd == "add":
                    d.add(*arg[:3], max_tokens=arg[3])
                elif cmd == "pin":
                    _pin(arg)
                    conn.send(("pinned",))
                continue
            d.step()
            for rid in ev.ready.keys() - told:
                with ev.lock:
                    scatters, ev.scatters = ev.scatters, []
                conn.send(("ready", rid, ev.ready[rid], scatters))
                told.add(rid)
            for rid in d.params.keys() - finished:
                conn.send(("finished", rid))
                finished.add(rid)
            time.sleep(0.0002)
    except EOFError:  # P's process is gone
        pass
    finally:
        d.close()
        os._exit(0)  # vLLM's and NIXL's threads


def _forward(rank, layer_ms: float):
    """P's layers: ``layer_ms`` of matmul, the layer's KV written, save_kv_layer."""
    import torch
    from vllm_arena_engines import _view

    a = torch.randn(256, 256)
    per = max(1, int(layer_ms / _matmul_ms(a)))

    def forward(conn):
        storage, truth = rank.raw.untyped_storage(), rank.truth.untyped_storage()
        for name, attention in rank.layers:
            for _ in range(per):
                torch.mm(a, a)
            _view(rank.caches, storage, name).copy_(_view(rank.caches, truth, name))
            if attention:
                EVENTS.step["layers"].append((name, time.monotonic()))
                conn.save_kv_layer(name, rank.caches[name], None)
    return forward


def _matmul_ms(a) -> float:
    import torch

    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, a)
    return (time.perf_counter() - t0) / 50 * 1e3


EVENTS = Events()


def run(args) -> dict:
    import torch

    from vllm_arena_engines import prompts

    torch.set_num_threads(1)
    # P and D share one interpreter in placement "one" (they are two processes in a deployment):
    # hand the GIL over sooner than CPython's 5 ms so D's stepping thread does not hold P's threads
    sys.setswitchinterval(args.switch_ms / 1e3)
    all_cpus = os.sched_getaffinity(0)
    root = Path(tempfile.mkdtemp(prefix="push-chunks-"))
    mc = _model_config(root)
    p = _engine(mc, args, "kv_producer", layerwise=True)
    pw = p.worker.arena_worker
    layers = pw.stager.layers
    _instrument_p(p, EVENTS)
    sides = {}
    try:
        _decode_sides(args, mc, p, root, sides)
        forwards = {ms: _forward(p.ranks[0], ms) for ms in args.layer_ms}
        p.ranks[0].forward = forwards[args.layer_ms[0]]
        warm = prompts(1, [32], 7)[0]
        template = None
        for side in _each(sides):  # one warm request per D: its handshakes
            rid = f"warm-{id(side)}"
            p.add(rid, warm, {"do_remote_decode": True})
            while rid not in p.params:
                p.step()
            template = template or p.params[rid]
            side.add(rid, warm, p.params[rid], 2)
            deadline = time.monotonic() + 120
            while not side.finished(rid):
                assert time.monotonic() < deadline, "D did not warm"
                time.sleep(0.01)
        gc.freeze()  # as vLLM's engine core after its start (module docstring)
        rows = []
        combos = [(ms, mode, place) for ms in args.layer_ms for mode in args.modes for place in args.placements]
        toks = prompts(len(combos) * args.repeats, [args.tokens] * len(combos) * args.repeats, 3)
        pinned = None
        for rep in range(args.repeats):
            for k, (ms, mode, place) in enumerate(combos if rep % 2 == 0 else reversed(combos)):
                rid, side = f"{mode}-{ms:g}-{place}-{rep}", sides[place]
                if pinned != (place == "two-pinned"):
                    pinned = place == "two-pinned"
                    p_cpu, d_cpu = sorted(all_cpus)[:2] if pinned else (None, None)
                    _pin({p_cpu} if pinned else all_cpus)
                    for side in _each(sides):
                        side.pin({d_cpu} if pinned else all_cpus)
                p.ranks[0].forward = forwards[ms]
                pw.stager.layers = None if mode == "whole" else layers
                pw.sender.chunks.min_bytes = {"chunked": type(pw.sender.chunks).min_bytes, "chunked-unit": 0,
                                              "chunked-unit-own-tail": 0}.get(mode, float("inf"))
                pw.sender.chunks.tail_in_final = mode != "chunked-unit-own-tail"
                n_steps = len(EVENTS.p_steps)
                tokens = toks[rep * len(combos) + k]
                p.add(rid, tokens, {"do_remote_decode": True})
                side.add(rid, tokens, dict(template, remote_request_id=rid), 2)
                deadline = time.monotonic() + 60
                while not pw.sender.tokens_for(rid):
                    assert time.monotonic() < deadline, "no reservation"
                    time.sleep(0.001)
                while not side.ready(rid):
                    assert time.monotonic() < deadline, "not loaded"
                    if p.sched.has_requests():
                        p.step()
                    else:
                        time.sleep(0.0005)
                step = next(s for s in EVENTS.p_steps[n_steps:] if rid in s["final"])
                rows.append(dict(_row(mode, rid, step, EVENTS), layer_ms=ms, placement=place))
                while not side.finished(rid):
                    assert time.monotonic() < deadline, "not finished"
                    time.sleep(0.005)
                print(json.dumps({k2: v for k2, v in rows[-1].items() if k2 != "events"}), flush=True)
        return {"rows": rows, "layers": args.layers, "tokens": args.tokens, "layer_ms": args.layer_ms,
                "placements": list(args.placements), "switch_ms": args.switch_ms,
                "nixl_thread_nice": args.nixl_thread_nice, "cpus": sorted(all_cpus),
                "layer_bytes": _layer_bytes(args), "min_chunk_bytes": type(pw.sender.chunks).min_bytes,
                "load": os.getloadavg()}
    finally:
        _pin(all_cpus)
        for side in _each(sides):
            side.close()
        pw.stager.layers = layers
        p.close()


def _decode_sides(args, mc, p, root, sides: dict) -> None:
    """``sides``: the D of each placement (P's KV poisoned, its forward's bytes drawn)."""
    from vllm_arena_engines import fill_layerwise

    if "one" in args.placements:
        d = _engine(mc, args, "kv_consumer", transfer_mode="push")
        _instrument_d(d, EVENTS)
        fill_layerwise(p, d, 1)
        sides["one"] = LocalDecode(d)
    else:
        fill_layerwise(p, SimpleNamespace(ranks=[]), 1)
    if {"two", "two-pinned"} & set(args.placements):
        if "two-pinned" in args.placements and len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--placements two-pinned needs two CPUs")
        sides["two"] = sides["two-pinned"] = DecodeProcess(args, root / "tiny-llama", root)


def _each(sides: dict) -> list:
    """The distinct D sides (``two`` and ``two-pinned`` are one process)."""
    return list({id(s): s for s in sides.values()}.values())


def _row(mode, rid, step, ev: Events) -> dict:
    ready = ev.ready[rid]
    chunks = [c for c in ev_chunks() if c[2] == rid]
    post = [f for f in ev.final_posts if step["fwd_end"] <= f[0] <= ready]
    scat = [s for s in ev.scatters if step["bind"] <= s[0] <= ready]
    last = step["layers"][-1][1] if step["layers"] else step["fwd_end"]
    return {"mode": mode, "request": rid, "end_to_ready_ms": (ready - step["fwd_end"]) * 1e3,
            "last_layer_to_ready_ms": (ready - last) * 1e3, "chunks": len(chunks),
            "copy_ms": [(c[2] - c[1]) * 1e3 for c in step["copies"]],
            "chunk_write_ms": [(c[1] - c[0]) * 1e3 for c in chunks],
            "events": {"bind": step["bind"], "fwd_end": step["fwd_end"], "saved": step["saved"], "ready": ready,
                       "layers": step["layers"], "copies": step["copies"], "chunks": chunks, "final": post,
                       "scatters": scat}}


def ev_chunks():
    from kvcopy.vllm.arena import push_chunks

    return push_chunks.EVENTS_SEEN


def summary(result: dict) -> dict:
    """Medians per placement of D (older files: ``one``), per matmul-per-layer setting, per mode."""
    out = {}
    for place in result.get("placements", ["one"]):
        for ms in sorted({r.get("layer_ms", result["layer_ms"]) for r in result["rows"]}):
            rows = [r for r in result["rows"] if r.get("layer_ms", result["layer_ms"]) == ms
                    and r.get("placement", "one") == place]
            out.setdefault(place, {})[f"{ms:g} ms/layer"] = _summary(rows)
    return out


def _summary(all_rows: list) -> dict:
    out = {}
    for mode in MODES:
        rows = [r for r in all_rows if r["mode"] == mode]
        if not rows:
            continue
        e = [r["events"] for r in rows]
        done = [(x, s) for x in e for s in x["scatters"] if s[2] == ["complete"]]
        out[mode] = {"end_to_ready_ms": statistics.median(r["end_to_ready_ms"] for r in rows),
                     "layer_interval_ms": _median([(b[1] - a[1]) * 1e3 for x in e
                                                   for a, b in zip(x["layers"], x["layers"][1:])]),
                     "last_layer_to_ready_ms": statistics.median(r["last_layer_to_ready_ms"] for r in rows),
                     # the tail, from the prefill end: the last layer's copy starts (behind the
                     # copy thread's backlog) and ends, P's final WRITE is posted
                     "last_copy_wait_ms": _median([(x["copies"][-1][1] - x["layers"][-1][1]) * 1e3 for x in e
                                                   if x["copies"] and x["layers"]]),
                     "last_copy_end_ms": _median([(x["copies"][-1][2] - x["fwd_end"]) * 1e3 for x in e
                                                  if x["copies"]]),
                     "final_post_at_ms": _median([(x["final"][0][0] - x["fwd_end"]) * 1e3 for x in e if x["final"]]),
                     "final_write_ms": _median([(f[1] - f[0]) * 1e3 for x in e for f in x["final"]]),
                     # the final post returned -> D's complete() at f starts (P's poll sees the WRITE
                     # DONE, f over NIXL, D's step takes it; across processes: one clock)
                     "final_to_complete_ms": _median([(s[0] - x["final"][-1][1]) * 1e3 for x, s in done
                                                      if x["final"]]),
                     # D's complete() at f (the trailer, what no chunk scattered, the sums)
                     "d_complete_ms": _median([(s[1] - s[0]) * 1e3 for _, s in done]),
                     "complete_to_ready_ms": _median([(x["ready"] - s[1]) * 1e3 for x, s in done]),
                     "chunks": statistics.median(r["chunks"] for r in rows), "requests": len(rows)}
    unit = [r for r in all_rows if r["mode"] == "chunked-unit"]
    copies = [c for r in unit for c in r["copy_ms"]]
    writes = [w for r in unit for w in r["chunk_write_ms"]]
    if copies and writes:
        one = statistics.median(copies) + statistics.median(writes)
        out["one_layer"] = {"copy_ms": statistics.median(copies), "write_ms": statistics.median(writes),
                            "copy_plus_write_ms": one,
                            "chunked_unit_end_to_ready_x": out["chunked-unit"]["end_to_ready_ms"] / one}
        if "chunked-unit-own-tail" in out:
            out["one_layer"]["own_tail_end_to_ready_x"] = out["chunked-unit-own-tail"]["end_to_ready_ms"] / one
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


def plot(result: dict, path: str, modes=MODES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # per placement, setting and mode, the request nearest the median
    places = result.get("placements", ["one"])
    for place in places:
        for lms in sorted({r.get("layer_ms", result["layer_ms"]) for r in result["rows"]}):
            for mode in modes:
                rows = [r for r in result["rows"] if r["mode"] == mode and r.get("placement", "one") == place
                        and r.get("layer_ms", result["layer_ms"]) == lms]
                if rows:
                    med = statistics.median(r["end_to_ready_ms"] for r in rows)
                    near = min(rows, key=lambda r: abs(r["end_to_ready_ms"] - med))
                    where = f"D: {place}, " if len(places) > 1 else ""
                    panels.append((f"{where}{mode}, {lms:g} ms/layer", lms, near))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.0 * len(panels)), squeeze=False)
    for ax, (mode, lms, r) in zip(axes[:, 0], panels):
        e = r["events"]

        def ms(t, t0=e["fwd_end"]):
            return (t - t0) * 1e3
        lanes = ["P layers", "P copies", "P WRITEs", "D scatters"]
        for _, t in e["layers"]:
            ax.plot([ms(t)] * 2, [3.6, 4.4], color="k", lw=0.8)
        for _, a, b in e["copies"]:
            ax.barh(2.95 + 0.05, ms(b) - ms(a), left=ms(a), height=0.6, color="tab:blue")
        for a, b, *_ in e["chunks"]:
            ax.barh(2, max(ms(b) - ms(a), 0.05), left=ms(a), height=0.6, color="tab:orange")
        for a, b, *_ in e["final"]:
            ax.barh(2, max(ms(b) - ms(a), 0.05), left=ms(a), height=0.6, color="tab:red")
        for a, b, units in e["scatters"]:  # dark: D's complete() at f (the trailer, the rest, the sums)
            ax.barh(1, max(ms(b) - ms(a), 0.05), left=ms(a), height=0.6,
                    color="darkgreen" if units == ["complete"] else "tab:green")
        ax.axvline(0, color="gray", ls="--", lw=0.8)
        ax.axvline(ms(e["ready"]), color="tab:purple", lw=1.2)
        ax.set_xlim(-3 * lms - 2, ms(e["ready"]) + 3)  # the last layers and the tail
        ax.set_yticks([4, 3, 2, 1], lanes)
        ax.set_title(f"{mode}: prefill end -> KV ready {r['end_to_ready_ms']:.1f} ms "
                     f"(last layer -> ready {r['last_layer_to_ready_ms']:.1f} ms, {r['chunks']} chunk WRITEs)",
                     fontsize=9)
    axes[-1, 0].set_xlabel("ms from P's prefill end (wait_for_save entered); purple: D's KV ready; "
                        "orange: chunk WRITEs, red: final WRITE; dark green: D's complete at f")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layer-ms", default="4", help="matmul per layer, ms; comma-separated: swept, interleaved")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, run interleaved")
    ap.add_argument("--placements", default="one",
                    help="where D runs, comma-separated, interleaved: one (P's process), two (its own process), "
                         "two-pinned (its own process on the second CPU, P's on the first)")
    ap.add_argument("--switch-ms", type=float, default=5.0, help="sys.setswitchinterval (CPython's default: 5)")
    ap.add_argument("--nixl-thread-nice", type=int, default=0, help="the arena option nixl_thread_nice, P and D")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None, help="draw a saved --out file (no run)")
    ap.add_argument("--plot-modes", default=",".join(MODES), help="the modes --plot draws")
    ap.add_argument("--summary", action="store_true", help="print a saved --out file's summary (no run)")
    args = ap.parse_args()
    args.modes = tuple(args.modes.split(","))
    args.layer_ms = [float(x) for x in args.layer_ms.split(",")]
    args.placements = tuple(args.placements.split(","))
    if not set(args.modes) <= set(MODES):
        ap.error(f"--modes: known ones are {MODES}")
    if not set(args.placements) <= set(PLACEMENTS):
        ap.error(f"--placements: known ones are {PLACEMENTS}")
    if args.summary:
        with open(args.out) as f:
            print(json.dumps(summary(json.load(f)), indent=1))
        return
    if args.plot:
        with open(args.out) as f:
            plot(json.load(f), args.plot, args.plot_modes.split(","))
        return
    from kvcopy.vllm.arena import push_chunks

    seen = push_chunks.EVENTS_SEEN = []
    real = push_chunks.ChunkPoster._post

    def logged(self, rid):
        n = len(self.events)
        real(self, rid)
        seen.extend(self.events[n:])
    push_chunks.ChunkPoster._post = logged
    result = run(args)
    result["summary"] = summary(result)
    print(json.dumps(result["summary"], indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # vLLM's and NIXL's threads


if __name__ == "__main__":
    main()
