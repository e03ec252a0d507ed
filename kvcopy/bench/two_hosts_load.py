"""A busy P for ``kvcopy-bench nixl --two-hosts``: pinning, a stand-in forward, thread priorities.

Over TCP, D's READ is a software GET: P's bytes leave only when P's UCX worker is
progressed, which in P's process is NIXL's progress thread (P's engine never calls into
the agent while D reads). Where P's forward fills the core that thread shares, the
thread's priority (``nixl_thread_nice``) decides how soon the READ is served.

``pin(server, cpus)``
    every thread of the process, and every thread it starts later (NIXL's, UCX's, the
    load's: Linux threads inherit their creator's affinity), on ``cpus``: P's NIXL
    threads share those cores with the load. (vLLM's NIXL worker on a CPU host pins the
    thread that builds its agent to the last core of each NUMA node, reserved for KV
    transfer, so NIXL's threads inherit that core; what else keeps it busy decides.)
``load_start(server, n)`` / ``load_stop(server)`` -> multiplies per second
    ``n`` threads at nice 0, each multiplying two 256 x 256 float32 matrices in a loop
    (``torch.mm`` on one thread, the GIL released while it computes: the engine's main
    thread in a CPU forward; on a GPU host the forward's CPU side is kernel launches,
    as busy); ``load_start`` returns once each thread multiplied once. The rate they
    kept is returned, so a priority that costs the forward shows too.
``threads(server)`` -> ``[(name, nice, cpus)]``
    every thread of the process: which ones NIXL and UCX started, at what nice.
"""
from __future__ import annotations

import os
import re
import threading
import time
from typing import List, Optional, Set, Tuple

MATRIX = 256  # one multiply: 2 x 256^3 flops, 0.35-0.7 ms on one core of the 2-core test machine


def parse_cpus(text: Optional[str]) -> Optional[List[int]]:
    """``"1"``, ``"0,1"`` or ``"0-3"`` as a sorted list of CPUs this process may use;
    None for None."""
    if text is None:
        return None
    allowed = os.sched_getaffinity(0)
    cpus: Set[int] = set()
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if m is None:
            raise ValueError(f"cpus must be a list such as 1, 0,1 or 0-3, got {text!r}")
        cpus.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    if not cpus or not cpus <= allowed:
        raise ValueError(f"cpus {text!r}: not all of them usable here (allowed: {sorted(allowed)})")
    return sorted(cpus)


def _tids() -> List[int]:
    return sorted(int(t) for t in os.listdir("/proc/self/task"))


def pin(server, cpus: List[int]) -> None:
    for tid in _tids():
        os.sched_setaffinity(tid, cpus)


def name_thread(name: str) -> None:
    """The calling thread's name as Linux shows it (``comm``: top -H, ``threads``);
    Python's thread names stay inside Python."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name[:15])


def load_start(server, n: int) -> None:
    import torch

    if server.scratch.get("load"):
        raise ValueError("a load runs already")
    stop, started = threading.Event(), threading.Semaphore(0)
    counts = [0] * n

    def burn(i: int) -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per thread: a new one would fork a team of all cores
        try:
            name_thread(f"p-load-{i}")
            a, b = torch.rand(MATRIX, MATRIX), torch.rand(MATRIX, MATRIX)
            torch.mm(a, b)
            counts[i] += 1
        finally:  # load_start returns once every thread multiplied once (or failed to)
            started.release()
        while not stop.is_set():
            torch.mm(a, b)
            counts[i] += 1

    workers = [threading.Thread(target=burn, args=(i,), name=f"p-load-{i}", daemon=True) for i in range(n)]
    server.scratch["load"] = (stop, workers, counts, time.monotonic())
    for w in workers:
        w.start()
    for _ in workers:  # returns once every thread runs, named, its first multiply done
        started.acquire()


def load_stop(server) -> float:
    """Stop the load; the multiplies per second all its threads kept together."""
    stop, workers, counts, t0 = server.scratch.pop("load")
    stop.set()
    for w in workers:
        w.join()
    return sum(counts) / max(time.monotonic() - t0, 1e-9)


def threads(server) -> List[Tuple[str, int, List[int]]]:
    out = []
    for tid in _tids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out.append((name, os.getpriority(os.PRIO_PROCESS, tid), sorted(os.sched_getaffinity(tid))))
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            pass
    return out
