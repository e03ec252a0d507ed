"""Which CPUs the arena connector's transfer threads run on in a vLLM CPU worker.

vLLM's CPU worker binds its process to the cores it gives the model's OpenMP threads
(``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by default), and every thread started in the
worker afterwards inherits that binding. Every engine on a machine binds the same way,
so P's and D's workers on one host share those cores (on 2 cores: both on CPU 0). The
threads a NIXL READ depends on then queue behind the workers' busy loops: P's UCX async
thread, which accepts D's connection, and P's NIXL progress thread, which answers D's
wireup, both run in P's worker while P's engine is idle. Measured on 2 cores with P and D
engines (``tests/engine/``): while D's worker stepped, waiting for its KV, on CPU 0, P's
runnable worker threads got no CPU for the whole 6 s sampled, P accepted D's connection
100 s after D's ``connect`` (UCX debug log), and a READ passed its deadline (mostly D's
first) within 8 batches of 6 requests in 6 of 6 runs with UCX's debug log on, 4 of 6
without.

vLLM's own NIXL worker reserves cores for transfer work: on the CPU platform it moves the
thread that builds it (the worker's engine thread, which then drives every transfer) to
the last physical core of each NUMA node (``CpuPlatform.discover_numa_topology``,
"reserve different cores for start_load_kv() from model_forward()"); its NIXL agent,
built just before, keeps the model's core and busy-polls there (poll delay 0; read back
from ``/proc`` in a stock engine: engine thread on CPU 1, agent and UCX threads on CPU 0).
The arena connector starts its transfer threads on those reserved cores:
:func:`transfer_cpus` names those cores, :func:`threads_on` runs the code that starts
threads (the NIXL agent with its progress thread and UCX's async thread, the side channel's
client thread with ZMQ's I/O thread, the housekeeping thread) with the calling thread moved
there and restores it after. The engine's own
threads keep vLLM's binding. With that, no READ stalled in 5 runs of 8 batches (UCX's
debug log on; the same 2-core machine, shared with other jobs), and with 2 busy processes
beside the engines (``bench/arena_stall.py --batches 8 --load 2``, run back to back):
0 of 40 loaded requests recomputed and every batch under 1.2 s, against 11 recomputed
and four batches of 28-31 s (READ deadlines) with the threads left on the model's core.

Nothing changes on other platforms (GPU workers bind nothing), or where the reserved
cores are the worker's own.

``KVCOPY_TRANSFER_CPUS`` overrides the choice: a CPU list (``"0"``, ``"2,3"``, ``"4-7"``)
names the transfer threads' cores, on any platform. The reserved cores are the machine's,
not the engine's: an engine confined to a subset of the host (``taskset``, or
``bench/serve_pd.py --bind split``, which gives P and D one core each as two one-core hosts
would have) would otherwise start its transfer threads on the other engine's core.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import FrozenSet, Iterator, Optional

# CPU numbers taken in a list: below this many times os.cpu_count() (room for sparse numbering)
CPU_ID_FACTOR = 8
logger = logging.getLogger("vllm.kvcopy")


def transfer_cpus() -> Optional[FrozenSet[int]]:
    """The cores vLLM's CPU platform reserves for KV transfer (the highest CPU of each
    NUMA node's last physical core, as vLLM's NIXL worker picks them), or None: not the
    CPU platform, no topology, or the calling thread is bound to exactly those already.
    ``KVCOPY_TRANSFER_CPUS``, when set, names them instead (module docstring)."""
    from vllm.platforms import current_platform

    named = os.environ.get("KVCOPY_TRANSFER_CPUS", "").strip()
    if named:
        return cpu_list(named, "KVCOPY_TRANSFER_CPUS")
    if current_platform.device_type != "cpu":
        return None
    cpus = frozenset(max(node) for node in current_platform.discover_numa_topology() if node)
    if not cpus or cpus == frozenset(os.sched_getaffinity(0)):
        return None
    return cpus


def cpu_list(text: str, what: str) -> FrozenSet[int]:
    """The CPUs of a list such as ``"0,2-3"``; ``ValueError`` naming ``what`` for anything
    else, and for a CPU number of :data:`CPU_ID_FACTOR` times the machine's CPU count or
    more (a typo such as ``0-4000000000`` would build a set of billions)."""
    ranges = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo, 10), int(hi, 10) if dash else int(lo, 10)
            if first < 0 or last < first:
                raise ValueError(part)
            ranges.append(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{what} must be a CPU list such as 0,2-3, got {text[:80]!r}") from None
    limit = CPU_ID_FACTOR * (os.cpu_count() or 1)
    top = max(r[-1] for r in ranges)
    if top >= limit:
        raise ValueError(f"{what}: CPU {top} is beyond this machine's {os.cpu_count()} CPUs "
                         f"(numbers below {limit} are taken), got {text[:80]!r}")
    return frozenset(c for r in ranges for c in r)


@contextlib.contextmanager
def threads_on(cpus: Optional[FrozenSet[int]]) -> Iterator[None]:
    """Run the body with the calling thread bound to ``cpus`` (threads it starts inherit
    that), then restore its binding. ``None``, or CPUs the kernel refuses (a cpuset
    without them), leave the binding as it is (the refusal is logged once per call)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("kvcopy: cannot bind transfer threads to CPUs %s (%s); they keep CPUs %s",
                       sorted(cpus), exc, sorted(before))
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
