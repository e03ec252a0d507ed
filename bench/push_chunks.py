"""The fixed cost of one NIXL WRITE between two arenas, and what it means for chunked push.

A layer-wise P pushing in chunks (``kvcopy.nixl.push_writes``, ``post_units``) posts one WRITE per
chunk of units while its forward runs; the chunk size trades the WRITE's fixed cost
(post, completion seen by P's poll, the notice) against how much of the last layer's
bytes wait behind it. This measures, between two managers' arenas over UCX on loopback
(the connector's transport on CPU engines), per WRITE size: the post (``post_read_descs``
with ``op="WRITE"``), post -> DONE as P's poll sees it, and a ``torch`` copy of the same
bytes in one process (the memcpy the WRITE is), side by side in one run.

    PYTHONPATH=. python bench/push_chunks.py [--repeats 30] [--out bench/results/push-chunks-....json]

Reports medians (µs) and the size at which the fixed cost (DONE time at the smallest
size) is <= 10% of the WRITE's time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvcopy.testing.nixl.engines import build_case, one_torch_thread

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def measure(repeats: int):
    pe, de = build_case("one_group", 16), build_case("one_group", 16)
    arena = 64 << 20
    p = pe.manager("Pchunks", buffer="arena", arena_bytes=arena)
    d = de.manager("Dchunks", buffer="arena", arena_bytes=arena)
    try:
        target = p.add_target(d.metadata())
        agent = p._agent  # the manager's own agent: the WRITEs push_writes.post makes
        p_base, _ = p.arena.arena_range
        d_base, _ = d.info.arena
        src = torch.randint(0, 255, (max(SIZES),), dtype=torch.uint8)
        dst = torch.empty_like(src)
        rows = []
        import numpy as np
        for size in SIZES:
            post, done, copy = [], [], []
            for k in range(repeats + 2):
                local = np.array([[p_base + 4096, size, 0]], np.uint64)
                remote = np.array([[d_base + 4096, size, 0]], np.uint64)
                t0 = time.perf_counter()
                xfer, state, _ = agent.post_read_descs(local, "DRAM", target, remote, "DRAM", b"", op="WRITE")
                t1 = time.perf_counter()
                while state == "PROC":
                    state = agent.state(xfer)[0]
                t2 = time.perf_counter()
                assert state == "DONE", state
                xfer.release()
                t3 = time.perf_counter()
                dst[:size].copy_(src[:size])
                t4 = time.perf_counter()
                if k >= 2:  # two warm-ups per size
                    post.append((t1 - t0) * 1e6)
                    done.append((t2 - t0) * 1e6)
                    copy.append((t4 - t3) * 1e6)
            rows.append({"bytes": size, "post_us": statistics.median(post), "done_us": statistics.median(done),
                         "memcpy_us": statistics.median(copy)})
        return rows
    finally:
        p.close()
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with one_torch_thread():
        rows = measure(args.repeats)
    fixed = rows[0]["done_us"]
    print(f"{'bytes':>10} {'post us':>9} {'done us':>9} {'memcpy us':>10} {'fixed/done':>10}")
    for r in rows:
        r["fixed_share"] = fixed / r["done_us"]
        print(f"{r['bytes']:>10} {r['post_us']:>9.1f} {r['done_us']:>9.1f} {r['memcpy_us']:>10.1f} "
              f"{r['fixed_share']:>10.2f}")
    enough = next((r["bytes"] for r in rows if r["fixed_share"] <= 0.1), None)
    print(f"fixed cost (DONE of {rows[0]['bytes']} B) {fixed:.1f} us; <= 10% of the WRITE from {enough} bytes")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "fixed_us": fixed, "ten_percent_bytes": enough, "repeats": args.repeats,
                       "transport": "UCX loopback, DRAM -> DRAM, one process"}, f, indent=1)


if __name__ == "__main__":
    main()
