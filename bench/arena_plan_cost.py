"""Host cost of D's ``plan_pull`` in arena mode, against one contiguous copy of the same bytes.

    python bench/arena_plan_cost.py                  # seeds2 preset, 6 groups (16 layers x 6, 36 MiB)
    python bench/arena_plan_cost.py --groups 1 --iters 100
    python bench/arena_plan_cost.py --profile        # cProfile of plan_pull + discard

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

Minimum, median and 90th percentile of ``--iters`` round-robin rounds
(:func:`kvcopy.bench.timing.measure`). The script checks once that
a pull + complete of a plan leaves D's KV equal to P's at the request's blocks. Compare
rows of one run only: on a loaded machine both move.
"""
from __future__ import annotations

import argparse
import cProfile
import io
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
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

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


if __name__ == "__main__":
    sys.exit(main())
