"""Host cost of D's ``plan_pull`` in arena mode, against one contiguous copy of the same bytes.

    python bench/arena_plan_cost.py                  # seeds2 preset, 6 groups (16 layers x 6, 36 MiB)
    python bench/arena_plan_cost.py --groups 1 --iters 100
    python bench/arena_plan_cost.py --profile        # cProfile of plan_pull + discard
    python bench/arena_plan_cost.py --per-step       # P's layer-wise plans per step (below)

The scenario is built as ``kvcopy-bench nixl``'s arena rows build it
(:mod:`kvcopy.bench.nixl.measure`, ``_arena_rows``): the KV caches of the ``seeds2`` preset
(the model of the vLLM pull request that coalesced host-buffer copies; CPU tensors,
bf16 KV-first, 16-token blocks, 8 KV heads x 128) for P and D, two
``TransferManager(..., buffer="arena")`` over NIXL UCX in this process, ``add_peer``,
one ``save`` of the request on P. Then, interleaved per round:

``plan_pull``   D's ``plan_pull(peer, record, ...)`` + ``discard`` of the plan (D's span
                allocated and freed; no READ): a request of a shape seen before (the
                arena's shape cache and the planner's route cache hit)
``plan_pull cold``  the same after clearing D's shape cache (``arena.shapes.clear()``):
                a request of a new shape (page counts per group), which builds the
                virtual engines, pairs their layers and plans from scratch (left
                out on a kvcopy without the cache, so the script runs on older code)
``memcpy``      one contiguous ``copy_`` of the request's bytes (the span size) between
                two touched CPU buffers: the scale of a request's bytes on the host that runs it

``--per-step``: P's host cost of layer-wise staging per engine step (``--layers`` layers,
default 48, one group; ``--blocks`` blocks of 16 tokens per request; ``--order``): for
1, 2, 4, 8, 16 requests whose prefill ends in the step, ``settle`` = ``ArenaStaging.settle``
of each (what P's ``bind_connector_metadata`` runs before the forward: one checked plan
per copier and request, cut into one call per unit by ``BlockCopier.split``), against
``alone`` = the same calls planned unit by unit (each unit's ids checked alone, every
other triple's list empty: how ``settle`` planned before ``split``, the same calls),
``copies`` = running every unit of those plans (the
bytes the step stages, on this CPU), ``stage`` = the whole-request staging of the same
requests (``TransferManager.save``: one plan and one copy per request) and ``memcpy`` =
one contiguous copy of the same bytes. Spans are allocated (``begin``) untimed before
each ``settle`` and freed after.

Minimum, median and 90th percentile of ``--iters`` round-robin rounds
(:func:`kvcopy.bench.timing.measure`). The script checks once that
a pull + complete of a plan leaves D's KV equal to P's at the request's blocks. Compare
rows of one run only: on a loaded machine both move.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from dataclasses import replace

import torch

# The checkout this script is in, before any installed kvcopy (``python bench/...``
# puts bench/ on the path, not the repository root).
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from kvcopy.bench.nixl.request import d_block_ids, padded
    from kvcopy.bench.scenarios import PRESETS
    from kvcopy.bench.timing import measure
    from kvcopy.nixl import TransferManager

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=6, help="KV cache groups of the seeds2 preset")
    ap.add_argument("--order", choices=("token", "head"), default="token", help="P's arena_order")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="print cProfile of 10 plan_pull + discard")
    ap.add_argument("--per-step", action="store_true", help="P's layer-wise plans per step (module docstring)")
    ap.add_argument("--layers", type=int, default=48, help="--per-step: layers")
    ap.add_argument("--blocks", type=int, default=16, help="--per-step: blocks of 16 tokens per request")
    ap.add_argument("--json", help="--per-step: also write the medians to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.per_step:
        return per_step(args)

    sc = replace(PRESETS["seeds2"]["scenario"], num_groups=args.groups)
    if args.order == "head":
        sc = replace(sc, layout="kv_first_hnd")
    P, D = sc.build("cpu"), sc.build("cpu")
    counts = sc.blocks_per_group()
    num_blocks, _ = sc.block_ids()
    d_ids = padded(d_block_ids(sc, num_blocks, sc.seed), counts)
    tokens = max(counts) * sc.block_size
    kw = dict(block_dim=sc.block_dim(), kv_layout=sc.kv_layout())
    mp = TransferManager("arena-cost-P", P.dev, P.layer_groups, sc.block_size, sc.block_size, buffer="arena",
                         arena_bytes=1 << 28, arena_ttl_s=3600.0, arena_order=args.order, **kw)
    md = TransferManager("arena-cost-D", D.dev, D.layer_groups, sc.block_size, sc.block_size, buffer="arena",
                         arena_bytes=1 << 28, **kw)
    try:
        peer = md.add_peer(mp.metadata())
        record = mp.save(padded(P.ids, counts), num_tokens=tokens, request_id="cost", readers=1 << 62)

        def plan_pull():
            md.discard(md.plan_pull(peer, record, tokens, d_ids, request_id="cost"))

        # correctness, once: D's KV equals P's at the request's blocks
        plan = md.plan_pull(peer, record, tokens, d_ids, request_id="cost")
        n_desc, span = plan.num_descriptors, plan.span.nbytes
        h = md.pull(plan)
        while md.poll(h) == "PROC":
            pass
        c = md.complete(h)
        if not c.ok:
            print(f"FAIL: arena pull: {c.error}", file=sys.stderr)
            return 1
        for g, names in enumerate(P.layer_groups):
            src = torch.tensor(P.ids[g], dtype=torch.int64)
            dst = torch.tensor(d_block_ids(sc, num_blocks, sc.seed)[g], dtype=torch.int64)
            for n in names:
                a = P.dev[n].view(torch.int16).index_select(sc.block_dim(), src)
                b = D.dev[n].view(torch.int16).index_select(sc.block_dim(), dst)
                if not torch.equal(a, b):
                    print(f"FAIL: layer {n}: D's blocks differ from P's", file=sys.stderr)
                    return 1

        src_buf = torch.randint(0, 256, (span,), dtype=torch.uint8)
        dst_buf = torch.zeros(span, dtype=torch.uint8)

        def memcpy():
            dst_buf.copy_(src_buf)

        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [plan_pull() for _ in range(10)])
            pstats.Stats(prof, stream=(out := io.StringIO())).sort_stats("tottime").print_stats(18)
            print(f"==== cProfile: plan_pull + discard x10, a shape seen before (tottime)\n{out.getvalue()}")

        def plan_pull_cold():
            md.arena.shapes.clear()
            plan_pull()

        rows = {"plan_pull": plan_pull, "plan_pull cold": plan_pull_cold, "memcpy": memcpy}
        if getattr(md.arena, "shapes", None) is None:  # a kvcopy without the shape cache: nothing to clear
            del rows["plan_pull cold"]
        timings = measure(rows, "cpu", args.iters, warmup=1, budget_s=60.0)  # round-robin, one thread
        print(f"arena_plan_cost: seeds2, {args.groups} group(s), {len(P.layer_groups[0])} layers each, "
              f"{args.order} order, span {span / 2**20:.1f} MiB, {n_desc} descriptor(s); "
              f"median of {args.iters}")
        print(f"{'row':<16}{'min ms':>9}{'median ms':>10}{'p90 ms':>9}")
        for k, t in timings.items():
            st = t.stats()
            print(f"{k:<16}{st['min_us'] / 1e3:>9.2f}{st['median_us'] / 1e3:>10.2f}{st['p90_us'] / 1e3:>9.2f}")
        return 0
    finally:
        md.close()
        mp.close()


def plan_units_alone(arena, part, ids) -> list:
    """``--per-step``'s ``alone`` row: every unit's calls of ``part`` (all its pages settling
    at once, none missing) planned unit by unit, each checking its own ids."""
    import numpy as np

    from kvcopy.nixl.planning.plan import expand_blocks

    cps, info = arena.span_copiers(part.order), part.info
    pages = [expand_blocks(np.asarray(a, np.int64), info.tokens_per_block[g] // info.tokens_per_page[g])[:n]
             for g, (a, n) in enumerate(zip(ids, part.counts))]
    ids_of = cps.ids(part.span.offset, part.segs, part.counts, pages, [np.arange(n) for n in part.counts])
    calls = []
    for copier, (dev, host), (_, unit, _, _, _) in zip(cps.copiers, ids_of, cps.index):
        for u in np.unique(unit).tolist():
            keep = (unit == u).tolist()
            calls.append(copier.plan("d2h", [d if m else [] for d, m in zip(dev, keep)],
                                     [h if m else [] for h, m in zip(host, keep)]))
    return calls


def per_step(args) -> int:
    """``--per-step`` (module docstring)."""
    from kvcopy.bench.nixl.request import padded
    from kvcopy.bench.scenarios import PRESETS
    from kvcopy.bench.timing import measure
    from kvcopy.nixl import TransferManager

    sc = replace(PRESETS["seeds2"]["scenario"], num_layers=args.layers, num_groups=1,
                 blocks_per_request=args.blocks)
    if args.order == "head":
        sc = replace(sc, layout="kv_first_hnd")
    P = sc.build("cpu")
    counts = sc.blocks_per_group()
    tokens = counts[0] * sc.block_size
    ids = padded(P.ids, counts)
    sizes = (1, 2, 4, 8, 16)
    span_guess = tokens * args.layers * 2 * sc.num_kv_heads * sc.head_size * 2  # K and V, bf16
    mp = TransferManager("layerwise-cost-P", P.dev, P.layer_groups, sc.block_size, sc.block_size, buffer="arena",
                         arena_bytes=max(sizes) * span_guess * 5 // 4 + (64 << 20), arena_ttl_s=3600.0,
                         arena_order=args.order, block_dim=sc.block_dim(), kv_layout=sc.kv_layout())
    arena, info = mp.arena, mp.info
    parts: list = []
    steps: list = []

    def fresh(n: int, planned: bool, begun: bool = True):
        def make():
            for part in parts:
                arena.abandon(part)
            for rid in arena.staged:
                arena.release(rid)
            parts[:] = [arena.begin(info, tokens, f"r{i}", 1) for i in range(n)] if begun else []
            steps[:] = [arena.settle(part, ids, tokens) for part in parts] if planned else []
        return make

    def settle():
        steps[:] = [arena.settle(part, ids, tokens) for part in parts]

    def alone():
        for part in parts:
            plan_units_alone(arena, part, ids)

    def copies():
        for step in steps:
            for u in step.units:
                step.run(u)

    rows, before = {}, {}
    units = 0
    try:
        fresh(1, True)()
        units, span = len(steps[0].units), parts[0].span.nbytes
        for n in sizes:
            src = torch.randint(0, 256, (n * span,), dtype=torch.uint8)
            dst = torch.zeros(n * span, dtype=torch.uint8)
            rows[f"settle {n}"], before[f"settle {n}"] = settle, fresh(n, False)
            rows[f"alone {n}"], before[f"alone {n}"] = alone, fresh(n, False)
            rows[f"copies {n}"], before[f"copies {n}"] = copies, fresh(n, True)
            rows[f"stage {n}"] = lambda n=n: [mp.save(ids, num_tokens=tokens, request_id=f"s{i}") for i in range(n)]
            before[f"stage {n}"] = fresh(n, False, False)
            rows[f"memcpy {n}"] = lambda dst=dst, src=src: dst.copy_(src)
        timings = measure(rows, "cpu", args.iters, warmup=1, budget_s=120.0, before=before)
    finally:
        for part in parts:
            arena.abandon(part)
        mp.close()
    report(args, units, tokens, span, sizes, timings)
    return 0


def report(args, units: int, tokens: int, span: int, sizes, timings) -> None:
    """``--per-step``'s table (and ``--json``)."""
    print(f"arena_plan_cost --per-step: seeds2 geometry, {args.layers} layers ({units} units), {args.order} order, "
          f"{tokens} tokens per request ({span / 2**20:.1f} MiB span); median of {args.iters} rounds, ms")
    print(f"{'requests':>8}{'settle':>9}{'us/unit+req':>12}{'alone':>9}{'us/unit+req':>12}{'copies':>9}{'stage':>9}"
          f"{'memcpy':>9}{'settle/stage':>14}")
    out = {}
    for n in sizes:
        med = {k: timings[f"{k} {n}"].stats()["median_us"] / 1e3
               for k in ("settle", "alone", "copies", "stage", "memcpy")}
        out[n] = med
        print(f"{n:>8}{med['settle']:>9.2f}{med['settle'] * 1e3 / (n * units):>12.1f}{med['alone']:>9.2f}"
              f"{med['alone'] * 1e3 / (n * units):>12.1f}{med['copies']:>9.2f}{med['stage']:>9.2f}"
              f"{med['memcpy']:>9.2f}{med['settle'] / med['stage']:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "arena_plan_cost --per-step", "layers": args.layers, "units": units,
                       "order": args.order,
                       "tokens_per_request": tokens, "span_bytes": span, "iters": args.iters,
                       "median_ms": out}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
