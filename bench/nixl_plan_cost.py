"""Host cost of ``TransferManager.plan_pull`` and ``pull`` against a raw NIXL READ.

    python bench/nixl_plan_cost.py                       # 64 layers x 500 pages, 1 group
    python bench/nixl_plan_cost.py --layers 64 --pages 500 --groups 2 --ids contiguous
    python bench/nixl_plan_cost.py --profile             # cProfile of plan_pull and pull

Two managers (P and D) in one process, CPU tensors, NIXL UCX over DRAM, homogeneous
P/D (same groups, block and page sizes, TP 1), one peer. Each layer is its own tensor
``[num_pages, tokens, heads, head_size]`` fp16 (NHD, one chunk per page). A request
reads ``--pages`` pages per group into D, at P's and D's block ids drawn at random
(``--ids random``: no two adjacent, one NIXL descriptor per layer and page, the worst
case) or as one run (``--ids contiguous``).

Rows, median of ``--iters`` interleaved rounds (each round runs every row once):

``plan_pull``          ``TransferManager.plan_pull`` for the request
``raw READ``           ``make_prepped_xfer`` + ``transfer`` + poll to DONE + release,
                       with the manager's own prepared descriptor lists and the
                       plan's descriptor indices computed once (the floor for ``pull``)
``pull``               ``TransferManager.pull(plan)`` + ``poll`` until DONE
``pull+complete``      the same and ``complete`` (zero unread pages, masked h2d)
``complete only``      ``pull+complete`` minus ``pull`` (derived)

Rounds alternate the row order. Ratios are against ``raw READ``; ``pull`` overhead =
pull - raw READ, as medians, 20th percentiles and minima (the machine's noise is
milliseconds: UCX progress threads share the cores with the timed loop). The script
checks once that D holds P's bytes at the request's pages. Run it on an idle machine
when you can; on a loaded one compare rows of the same run only.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch


def build(args):
    from kvcopy.nixl import TransferManager

    rng = np.random.default_rng(args.seed)
    shape = (args.num_pages, args.tokens, args.heads, args.head_size)
    names = [f"model.layers.{i}.attn" for i in range(args.layers)]
    groups = [names[g::args.groups] for g in range(args.groups)]
    p_kv = {n: torch.randint(-2**15, 2**15 - 1, shape, dtype=torch.int16).view(torch.float16) for n in names}
    d_kv = {n: torch.zeros(shape, dtype=torch.float16) for n in names}
    # no page sums: the raw READ row, the floor, reads the pages alone
    P = TransferManager("cost-P", p_kv, groups, args.tokens, checksum=False)
    D = TransferManager("cost-D", d_kv, groups, args.tokens, checksum=False)
    peer = D.add_peer(P.metadata())

    def ids():
        if args.ids == "contiguous":
            start = int(rng.integers(0, args.num_pages - args.pages + 1))
            return list(range(start, start + args.pages))
        return [int(x) for x in rng.choice(args.num_pages, args.pages, replace=False)]

    p_ids = [ids() for _ in groups]
    d_ids = [ids() for _ in groups]
    P.save(p_ids)
    return P, D, peer, p_kv, d_kv, groups, p_ids, d_ids


def raw_indices(D, peer: str, plan):
    """The plan's NIXL descriptor indices, computed here from the region layout
    (chunk-major rows per region, see kvcopy.nixl.engine.regions), not by the manager."""
    from kvcopy.nixl.engine.regions import descriptor_table

    local_off = descriptor_table(D.info.regions)[1]
    remote_off = descriptor_table(D._peers[peer].peer.info.regions)[1]
    loc, rem = [], []
    for p in plan.pairs:
        lp = np.asarray(p.local_pages, np.int64)
        rp = np.asarray(p.remote_pages, np.int64)
        for c in range(p.local.num_chunks):
            loc.append(local_off[p.local.index] + c * p.local.num_pages + lp)
            rem.append(remote_off[p.remote.index] + c * p.remote.num_pages + rp)
    return np.concatenate(loc).astype(np.int32), np.concatenate(rem).astype(np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--pages", type=int, default=500, help="pages read per group per request")
    ap.add_argument("--num-pages", type=int, default=1024, help="pages per layer tensor")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per page (= per block)")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--ids", choices=("random", "contiguous"), default="random")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print cProfile of plan_pull and pull")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    P, D, peer, p_kv, d_kv, groups, p_ids, d_ids = build(args)
    try:
        tokens = args.pages * args.tokens
        plan_args = (peer, p_ids, tokens, d_ids)
        plan = D.plan_pull(*plan_args)
        agent = D._agent._agent
        ldl, rdl = D._local_dlist, D._dlists[peer].dlist  # the prepared list under kvcopy's RemoteList
        li, ri = raw_indices(D, peer, plan)

        def raw():
            h = agent.make_prepped_xfer("READ", ldl, li, rdl, ri, b"")
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            assert state == "DONE", state

        def pull(plan):
            h = D.pull(plan)
            while D.poll(h) == "PROC":
                pass
            assert h.state == "DONE", h.error
            return h

        def pull_complete(plan):
            c = D.complete(pull(plan))
            assert c.ok, c.error

        # correctness, once: D's KV equals P's at the request's pages
        pull_complete(plan)
        for g, names in enumerate(groups):
            for n in names:
                if not torch.equal(d_kv[n][d_ids[g]].view(torch.int16), p_kv[n][p_ids[g]].view(torch.int16)):
                    print(f"FAIL: layer {n}: D's pages differ from P's", file=sys.stderr)
                    return 1

        if args.profile:
            _profile({"plan_pull": lambda: D.plan_pull(*plan_args), "pull": lambda: pull(D.plan_pull(*plan_args))})

        new_plan = partial(D.plan_pull, *plan_args)  # one pull per plan: each timed pull gets its own
        rows: Dict[str, Tuple[Optional[Callable], Callable]] = {
            "plan_pull": (None, lambda _: new_plan()), "raw READ": (None, lambda _: raw()),
            "pull": (new_plan, pull), "pull+complete": (new_plan, pull_complete)}
        times = _time_rows(rows, args.iters)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        p20 = {k: float(np.percentile(v, 20)) * 1e3 for k, v in times.items()}
        low = {k: min(v) * 1e3 for k, v in times.items()}
        med["complete only"] = med["pull+complete"] - med["pull"]
        p20["complete only"] = low["complete only"] = float("nan")
        print(f"nixl_plan_cost: {args.layers} layers x {args.pages} pages x {args.groups} group(s), "
              f"{args.ids} ids, page {args.tokens}x{args.heads}x{args.head_size} fp16 "
              f"({plan.pairs[0].local.chunk_bytes} B), {len(li)} descriptors, {plan.num_bytes / 2**20:.1f} MiB; "
              f"median of {args.iters}")
        print(f"{'row':<16}{'median ms':>10}{'p20 ms':>9}{'min ms':>9}{'x raw':>8}")
        for k in ("plan_pull", "raw READ", "pull", "pull+complete", "complete only"):
            print(f"{k:<16}{med[k]:>10.2f}{p20[k]:>9.2f}{low[k]:>9.2f}{med[k] / med['raw READ']:>8.2f}")
        print(f"pull overhead over raw READ: median {med['pull'] - med['raw READ']:.2f} ms "
              f"({med['pull'] / med['raw READ']:.2f}x), p20 {p20['pull'] / p20['raw READ']:.2f}x, "
              f"min {low['pull'] / low['raw READ']:.2f}x")
        return 0
    finally:
        D.close()
        P.close()


def _profile(fns: Dict[str, Callable]) -> None:
    for label, fn in fns.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print(f"==== cProfile: {label} x5 (tottime)\n{out.getvalue()}")


def _time_rows(rows: Dict[str, Tuple[Optional[Callable], Callable]], iters: int) -> Dict[str, List[float]]:
    """Per row (setup, fn): ``fn(setup())`` with only ``fn`` timed (setup None: ``fn(None)``)."""
    times: Dict[str, List[float]] = {k: [] for k in rows}
    for setup, fn in rows.values():  # warm-up
        fn(setup() if setup else None)
    order = list(rows.items())
    for i in range(iters):  # every other round backwards: no row always follows the same one
        for k, (setup, fn) in (order if i % 2 == 0 else order[::-1]):
            arg = setup() if setup else None
            t0 = time.perf_counter()
            fn(arg)
            times[k].append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    sys.exit(main())
