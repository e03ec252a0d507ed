"""Timing, device-op counting and environment facts for ``kvcopy-bench``.

Timing: on a GPU each call is bracketed by CUDA events on the current stream and the
host waits for the end event (a request-sync, as vLLM's pull request that coalesced
host-buffer copies measured it); the host time of the call alone (Python + launches,
before the wait) is recorded beside it. On the CPU each call is timed with
``time.perf_counter``.

Methods are measured round by round, one timed call of each per round, the round
starting one method further each time, so every ratio comes from the same seconds of
the same run and no method always follows the same neighbour. With ``settle=N`` each
timed call follows N untimed calls of the same method: whatever ran before it (the
comparison rows fill the caches with their own temporaries), a row is timed with its
own bytes as warm as every other row's. Without that, a contiguous memcpy of 6 MiB
measured 1.8-2.3x slower after the vLLM-style rows than beside the ``cpu`` row alone,
while ``cpu``, timed right after ``torch`` had touched the very same blocks, did not
move. One untimed call is not enough on the CPU, and how many are depends on the size:
after the ``torch`` row, the floor's 6 MiB copies took 717, 663, then 447-484 us (after
the ``cpu`` row: 500, 464, 447 us); its 18 MiB copies took 3.3, 3.0, 2.6, 2.3, 1.9,
1.7, 1.5 ms, seven calls to settle (after ``cpu``: 2.6 ms down to 1.5), and ``cpu``
after ``torch`` the same; as if the last-level cache kept a line only once it was read
again. With 3 the 18 MiB point alternated between 1.5-1.8 and 2.4-2.7 ms; stopping
once a call was less than 5% faster than the one before stopped too early as often
(spread 110%). So the CPU run settles with 6 untimed calls (18 MiB floor: spread
18-22%, ``cpu`` 1.00x of it), a GPU run with 1 (its copies do not go through the
host's caches). A method that exceeds its time budget
leaves the rotation after ``min_iters``.

Statistics per method: min, p10, median and p90 of the timed calls, and the spread
``p90 / p10 - 1``: how wide the middle 80% of the calls are. Not ``p90 / min``: the min
is the one luckiest call, lower the more calls a row gets, so a spread against it grows
with the run's length (a 6 MiB memcpy timed alone 200 times: min 446, p10 466, p90
529 us: 19% against the min, 14% against p10). A ratio of medians is only as good as
the wider spread of its two rows (:func:`noisy`).

Op counts come from ``torch.profiler``: on a GPU, device activities (kernels, memcpys,
memsets) per call, the counts that pull request quoted; on the CPU, the outermost
data-moving torch operators per call (a native backend's C call is invisible there).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np
import torch

from ..copy_backends.cpu import cpuinfo, default_stream_bytes

# A row whose p90 is more than this fraction above its p10 is too noisy for its ratio
# to be read as a result (on an idle machine every row of the default run stays under it).
NOISE_SPREAD = 0.25


@dataclass
class Timing:
    times_s: List[float] = field(default_factory=list)  # per call, wall/GPU
    host_s: List[float] = field(default_factory=list)  # per call, host side only (GPU)

    def stats(self) -> dict:
        """``iters``, and with at least one call ``min_us``, ``median_us``, ``p90_us``,
        ``p10_us``, ``spread`` (p90 / p10 - 1); ``host_us`` on a GPU."""
        t = np.asarray(self.times_s) * 1e6
        out: Dict[str, float] = {"iters": int(t.size)}
        if t.size:
            p10, p90 = (float(x) for x in np.percentile(t, [10, 90]))
            out.update(min_us=float(t.min()), p10_us=p10, median_us=float(np.median(t)), p90_us=p90,
                       spread=p90 / p10 - 1.0 if p10 > 0 else 0.0)
        if self.host_s:
            out["host_us"] = float(np.median(np.asarray(self.host_s) * 1e6))
        return out


def noisy(stats: Mapping[str, float], limit: float = NOISE_SPREAD) -> bool:
    """Whether a row's own spread says its median is noise (too few calls count too)."""
    return stats.get("iters", 0) < 3 or stats.get("spread", 0.0) > limit


def measure(methods: Dict[str, Callable[[], None]], device: str, iters: int, warmup: int,
            budget_s: float = 10.0, min_iters: int = 5, settle: int = 0,
            before: Optional[Mapping[str, Callable[[], None]]] = None,
            flush: Optional[Callable[[], None]] = None) -> Dict[str, Timing]:
    """Round-robin timing of every method; see the module doc. ``settle`` untimed calls
    of a method precede each of its timed calls; ``before[name]``, when given, runs
    untimed before every call of ``name`` (warm-up, settling and timed: e.g. to make the
    plan the call consumes); ``flush``, untimed, right before every timed call (after
    ``before``: e.g. to evict the call's bytes from the caches). The budget counts the
    untimed calls too."""
    on_gpu = device != "cpu"
    out = {name: Timing() for name in methods}
    spent = {name: 0.0 for name in methods}
    for name, fn in methods.items():
        for _ in range(warmup):
            _call(fn, before, name)
    if on_gpu:
        torch.cuda.synchronize()
    active = list(methods)
    for i in range(iters):
        k = i % len(active)
        for name in active[k:] + active[:k]:
            t_in = time.perf_counter()
            fn = methods[name]
            for _ in range(settle):
                _call(fn, before, name)
            if before is not None and name in before:
                before[name]()
            if flush is not None:
                flush()
            _timed_call(fn, on_gpu, out[name])
            spent[name] += time.perf_counter() - t_in
            if spent[name] > budget_s and i + 1 >= min_iters:
                active.remove(name)
        if not active:
            break
    return out


def _call(fn: Callable[[], None], before: Optional[Mapping[str, Callable[[], None]]], name: str) -> None:
    """An untimed call, after its ``before`` hook."""
    if before is not None and name in before:
        before[name]()
    fn()


def _timed_call(fn: Callable[[], None], on_gpu: bool, into: Timing) -> None:
    """One call of ``fn`` timed (GPU: events, from an idle stream to the end of its work)."""
    if on_gpu:
        torch.cuda.synchronize()  # the untimed calls' work ends before the timed one starts
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        dt = start.elapsed_time(end) / 1e3
        into.host_s.append(t1 - t0)
    else:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    into.times_s.append(dt)


# Outermost torch operators that move block bytes (CPU op counts).
_MOVING_OPS = {
    "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_select",
    "aten::index_copy_", "aten::copy_", "aten::gather", "aten::scatter_", "aten::_to_copy",
}


def op_counts(fn: Callable[[], None], device: str, calls: int = 3) -> Dict[str, float]:
    """Per-call op counts of ``fn``, by kind, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device != "cpu"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    fn()  # first-call work (tables, compiles) outside the profile
    if on_gpu:
        torch.cuda.synchronize()
    with _quiet_stderr(), profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
    counts: Dict[str, float] = {}
    device_us = 0.0
    events = prof.events()
    if on_gpu:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name
                kind = ("memcpy" if "memcpy" in name.lower() else
                        "memset" if "memset" in name.lower() else "kernel")
                counts[kind] = counts.get(kind, 0) + 1
                device_us += e.time_range.elapsed_us()
    else:
        for e in events:
            if e.name not in _MOVING_OPS:
                continue
            parent, nested = e.cpu_parent, False
            while parent is not None:
                if parent.name in _MOVING_OPS:
                    nested = True
                    break
                parent = parent.cpu_parent
            if not nested:
                counts[e.name] = counts.get(e.name, 0) + 1
    per_call = {k: v / calls for k, v in counts.items()}
    per_call["total"] = sum(per_call.values())
    if on_gpu:  # the device activities' own time, beside the events' wall time
        per_call["device_us"] = device_us / calls
    return per_call


@contextlib.contextmanager
def _quiet_stderr():
    """Drop the profiler's C++ start/stop log lines; pass anything else through."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(("USDT:", "INFO:", "STAGE:")):
                    sys.stderr.write(line)


# ---------------------------------------------------------------------- environment
def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def git_commit() -> str:
    env = os.environ.get("KVCOPY_COMMIT")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def cuda_driver_version() -> Optional[str]:
    try:
        import ctypes

        from .. import native

        v = ctypes.c_int()
        if native.driver().cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        pass
    return None


def _load_average() -> Optional[float]:
    """1-minute load average when the run starts: a busy machine explains noisy ratios."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cpu_model() -> Optional[str]:
    """The CPU's model name and its vector extensions the copy loops pick from (Linux's
    /proc/cpuinfo; None elsewhere): a checksummed cpu copy costs 2-5x more without
    AVX-512."""
    fields = cpuinfo()
    flags = set(fields.get("flags", "").split())
    simd = [f for f in ("avx2", "avx512f", "avx512dq") if f in flags]
    model = fields.get("model name")
    return f"{model} ({', '.join(simd) or 'no AVX2'})" if model else None


# The environment variables that change what a copy does or how fast (recorded by env_info;
# those naming files, KVCOPY_LIB_DIR and KVCOPY_CALIBRATION, are left out: a result file
# carries no path of the machine it ran on).
SETTINGS = ("KVCOPY_CPU_SIMD", "KVCOPY_CPU_STREAM_BYTES", "KVCOPY_CPU_SUM_PIECE_BYTES", "KVCOPY_CPU_THREADS",
            "KVCOPY_CTAS_PER_SM", "KVCOPY_MIN_BYTES_PER_WARP", "KVCOPY_CUDA_NVRTC", "KVCOPY_CE_MODE",
            "KVCOPY_CE_HOST_ANY")


def env_info(device: str) -> dict:
    """What a result needs to be read later: machine, versions, commit, date."""
    from .. import __version__

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "kvcopy": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": _load_average(),
        "numpy": np.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy"),
        "nixl": _version("nixl-cu12") or _version("nixl-cu13") or _version("nixl"),
        "device": device,
        # the knobs the run was made with: named ones only (a key's variable, which the
        # user names, must never reach a result file)
        "kvcopy_settings": {k: os.environ[k] for k in SETTINGS if k in os.environ},
        # the threshold the cpu backend streams from when KVCOPY_CPU_STREAM_BYTES is unset
        # (it depends on the CPU's vendor)
        "cpu_stream_bytes_default": default_stream_bytes(),
    }
    if device != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_sms=props.multi_processor_count,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda_runtime=torch.version.cuda, cuda_driver=cuda_driver_version())
    return info
