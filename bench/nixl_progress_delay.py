"""What idle NIXL agents cost the copies beside them, by progress-thread poll delay.

    python bench/nixl_progress_delay.py                  # delays 0 and 100000 us, 0 and 4 idle agents
    python bench/nixl_progress_delay.py --delays 0 1000 100000 --idle 0 4 --mib 36

For each (delay, idle agents) setting, in a fresh child process: two agents A and B
built by :func:`kvcopy.nixl.agent.make_agent` with that progress-thread poll delay,
``--idle`` more agents with the same delay that do nothing, one ``--mib`` MiB DRAM
buffer registered on each of A and B. Rows, median of ``--iters`` rounds, the two
interleaved:

``READ``     B reads A's buffer in one descriptor (``initialize_xfer`` + ``transfer``
             + poll until DONE + release); the bytes are checked once
``memcpy``   one ``copy_`` of as many bytes between two touched CPU tensors

and the CPU time the process spends per second while idle for 1 s (the agents'
progress threads: a spinning one takes a core). NIXL's Python wrapper starts every
agent with delay 0 (busy polling); kvcopy's managers use 100000 us
(:data:`kvcopy.nixl.agent.PROGRESS_DELAY_US`). Compare rows of one setting, and
settings of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# The checkout this script is in, before any installed kvcopy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_setting(delay_us: int, idle: int, mib: int, iters: int) -> dict:
    import numpy as np
    import torch

    from kvcopy.nixl.agent import load_nixl, make_agent

    nixl = load_nixl()
    n = mib << 20
    a, b = (make_agent(nixl, f"pd-{side}", ["UCX"], delay_us) for side in "AB")
    others = [make_agent(nixl, f"pd-idle{i}", ["UCX"], delay_us) for i in range(idle)]
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    a.register_memory([(src.data_ptr(), n, 0, "")], "DRAM")
    b.register_memory([(dst.data_ptr(), n, 0, "")], "DRAM")
    peer = b.add_remote_agent(a.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = b.get_xfer_descs([(dst.data_ptr(), n, 0)], "DRAM")
    remote = b.get_xfer_descs([(src.data_ptr(), n, 0)], "DRAM")
    copy_dst = torch.zeros(n, dtype=torch.uint8)

    def read():
        h = b.initialize_xfer("READ", local, remote, peer, b"")
        state = b.transfer(h)
        while state == "PROC":
            state = b.check_xfer_state(h)
        b.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"READ ended {state}")

    def memcpy():
        copy_dst.copy_(src)

    read()
    if not torch.equal(dst, src):
        raise RuntimeError("the READ did not move the bytes")
    memcpy()
    times = {"READ": [], "memcpy": []}
    for _ in range(iters):
        for name, fn in (("READ", read), ("memcpy", memcpy)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    idle_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    del others
    return {"delay_us": delay_us, "idle_agents": idle, "mib": mib,
            "read_ms": float(np.median(times["READ"]) * 1e3), "memcpy_ms": float(np.median(times["memcpy"]) * 1e3),
            "idle_cpu_per_s": idle_cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 100_000])
    ap.add_argument("--idle", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--mib", type=int, default=36)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_setting(args.child[0], args.child[1], args.mib, args.iters)))
        return 0
    print(f"nixl_progress_delay: {args.mib} MiB, median of {args.iters}, one child process per setting")
    print(f"{'delay us':>9} {'idle agents':>11} {'READ ms':>8} {'memcpy ms':>9} {'idle CPU/s':>10}")
    for delay in args.delays:
        for idle in args.idle:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(delay), str(idle),
                                  "--mib", str(args.mib), "--iters", str(args.iters)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{delay:>9} {idle:>11} {r['read_ms']:>8.2f} {r['memcpy_ms']:>9.2f} {r['idle_cpu_per_s']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
