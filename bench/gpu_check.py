#!/usr/bin/env python3
"""The steps of ``bench/gpu_check.sh``: one shot on a lent GPU machine, nothing wasted.

    python bench/gpu_check.py STEP --limit S   # one step (the shell runs each under `timeout`)
    python bench/gpu_check.py mark STEP --rc N # the shell saw STEP time out or crash: say so
    python bench/gpu_check.py summary          # the short summary printed last; exit 1 if a step failed
    python bench/gpu_check.py save DIR [--results bench/results]
                                               # a fetched run's step files -> kvcopy-bench JSONs

Steps, most informative first (each a fresh process, so a hang costs one step):

``facts``    GPU, driver, CUDA, PCIe generation/width (current and max), NUMA node,
             glibc, compilers, ``Python.h``, ``libcuda`` in ``ldconfig -p``, package
             versions, each native library loaded with ctypes (ABI and runtime versions,
             the GLIBC it needs), and which launcher each backend will use.
``build``    nothing when the carried libraries load; else CMake into a scratch folder
             (never over ``kvcopy/_lib``), and which library was rebuilt and why.
``smoke``    one bit-exact copy per backend and direction, at most 10 s each; the first
             exception is printed whole.
``tests``    ``pytest -m gpu`` over the test files that hold GPU tests, ``--maxfail``,
             ``--durations``.
``ladder``   one large contiguous copy, ``max_ctas`` 1, 2, 4, 8, 16, 32 and uncapped, per
             kernel backend, no verify: GB/s against bytes in flight gives the link's
             ceiling and its latency (Little's law: latency = bytes in flight / rate
             while the rate is still growing with the CTAs).
``sweep``    ``kvcopy-bench sweep`` at 2 KiB, 8 KiB, 32 KiB, 128 KiB, 512 KiB, 2 MiB
             chunks, both directions, verified up to 32 KiB.
``scenario`` the per-call host path stubbed and real (``kvcopy-bench overhead``), host
             overhead per call at 48 layers x 6 groups (real launches), the kernels with
             and without checksums side by side (the ``seeds2`` preset, 6 groups: goal
             >= 95% of the kernel without), KV offloading jobs (``bench/offload_bench.py``:
             store and load of 32 layers x 16 blocks at 4, 16, 28 and 64 KiB pages, kvcopy
             with and without checksums, the copy engines with one descriptor per page
             and the Triton kernel on 12 CTAs, vLLM's own worker where vLLM is installed,
             each as x memcpy; goal >= 0.90, checksums <= 1.05x), then ``seeds2`` (the benchmark of the vLLM
             pull request that coalesced host-buffer copies; 1 and 6 groups) with launch
             counts and the profiler's device time beside the wall time.

Files: ``GPU_CHECK_OUT`` (the shell sets it: ``$OUT`` on the device runner, else a
temporary folder) holds ``gpu_check.log`` (everything, as it happens) and one JSON per
step, ``01-facts.json`` .. ``07-scenario.json``: 8 files, the most the device runner
returns. Each step file is rewritten after every case, so a step cut short by its
timeout still leaves what it finished (``status`` says ``timeout``). The sweep's file,
and the seeds2 and overhead parts of the scenario's, are ``kvcopy-bench`` results;
``save`` turns them into ``bench/results/<gpu>-<date>-*.json`` for ``bench/report.py``.
Scratch (build tree, partial sub-results, pytest's XML) goes to ``GPU_CHECK_WORK``.

``KVCOPY_DEVICE=cpu`` runs every step with tiny sizes on the CPU (``cpu``, ``torch``
and Triton's interpreter): the rehearsal ``tests/bench/test_gpu_check.py`` runs in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("facts", "build", "smoke", "tests", "ladder", "sweep", "scenario")
FILES = {name: f"{i + 1:02d}-{name}.json" for i, name in enumerate(STEPS)}
LOG_NAME = "gpu_check.log"
FAILED = ("failed", "timeout", "crashed")
SMOKE_CASE_S = 10
LADDER_CAPS = (1, 2, 4, 8, 16, 32, 0)  # 0: uncapped
SWEEP_CHUNKS = "2K,8K,32K,128K,512K,2M"
# Bytes one CTA keeps in flight: cuda, 16 warps x 32 lanes x 4 x 16 B loads
# (kernels/block_copy.cuh); triton, one 16 x 2 KiB tile (kernels/triton_copy.py).
INFLIGHT_PER_CTA = {"cuda": 32 << 10, "triton": 32 << 10}


def device() -> str:
    return os.environ.get("KVCOPY_DEVICE", "cuda")


def on_gpu() -> bool:
    return device() != "cpu"


# Sizes per device: the GPU's give the numbers the README needs; the CPU's only prove
# that every step runs (the rehearsal), in seconds.
SIZES = {
    "gpu": dict(
        smoke=dict(num_layers=4, num_groups=2, blocks_per_request=3, block_size=16),
        smoke_backends=("cuda", "triton", "ce", "auto"),
        ladder_bytes=256 << 20, ladder_page=2 << 20, ladder_iters=10, ladder_backends=("cuda", "triton", "ce"),
        sweep=["--num-groups", "6", "--backends", "cuda,triton,ce,auto", "--max-ctas", "0,16",
               "--iters", "20", "--warmup", "2", "--budget", "0.2", "--max-call-bytes", "64M"],
        seeds2=["--num-groups", "1,6", "--backends", "vllm,coalesced,cuda,triton,ce,auto",
                "--iters", "30", "--budget", "0.3"],
        overhead=["--backends", "cuda,triton,ce,auto", "--iters", "100", "--budget", "0.3"],
        host_path=["--backends", "cuda,triton", "--calls", "2000"],
        convert512=["--backends", "cuda,triton,ce,auto", "--iters", "50", "--budget", "0.3"],
        checksum=["--num-groups", "6", "--backends", "cuda,triton", "--checksum", "--iters", "50",
                  "--budget", "0.3"],
        offload=["--device", "cuda", "--pages-kib", "4,16,28,64", "--layers", "32", "--blocks", "16", "--iters", "20",
                 "--budget", "0.15"],
    ),
    "cpu": dict(
        smoke=dict(num_layers=2, num_groups=2, blocks_per_request=2, block_size=16),
        smoke_backends=("cpu", "torch", "triton", "auto"),
        ladder_bytes=64 << 10, ladder_page=8 << 10, ladder_iters=2, ladder_backends=("cpu", "triton"),
        ladder_caps=(1, 2, 0),  # the interpreter: ~0.1 s per call on a busy core
        test_files=1,  # the collection of every GPU test file costs CI ~15 s to skip them all
        sweep=["--num-layers", "2", "--num-groups", "1", "--layout", "nhd", "--backends", "cpu,torch",
               "--iters", "3", "--budget", "0.05", "--max-call-bytes", "256K", "--threads", "1"],
        seeds2=["--num-layers", "4", "--num-groups", "1,2", "--backends", "vllm,cpu", "--iters", "3",
                "--budget", "0.05", "--threads", "1"],
        overhead=["--backends", "cpu", "--iters", "20", "--budget", "0.1", "--threads", "1"],
        host_path=["--backends", "cuda,triton", "--calls", "200"],
        convert512=["--num-layers", "2", "--backends", "cpu", "--iters", "3", "--budget", "0.05", "--threads", "1"],
        checksum=["--num-layers", "4", "--num-groups", "2", "--backends", "cpu", "--checksum", "--iters", "3",
                  "--budget", "0.05", "--threads", "1"],
        offload=["--device", "cpu", "--pages-kib", "4", "--layers", "2", "--blocks", "2", "--iters", "3",
                 "--budget", "0.05"],
    ),
}


def sizes() -> dict:
    return SIZES["gpu" if on_gpu() else "cpu"]


def out_dir() -> Path:
    env = os.environ.get("GPU_CHECK_OUT")
    d = Path(env) if env else Path(tempfile.gettempdir()) / "gpu_check"
    d.mkdir(parents=True, exist_ok=True)
    return d


def work_dir() -> Path:
    env = os.environ.get("GPU_CHECK_WORK")
    d = Path(env) if env else out_dir().parent / (out_dir().name + ".work")
    d.mkdir(parents=True, exist_ok=True)
    return d


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    """Whole file or nothing: a step killed mid-write leaves the previous checkpoint."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def log(text: str) -> None:
    with open(out_dir() / LOG_NAME, "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")


class Step:
    """One step's record: checkpointed to its JSON file, lines to stdout and the log."""

    def __init__(self, name: str, limit: float):
        self.name, self.limit = name, limit
        self.path = out_dir() / FILES[name]
        self.t0 = time.perf_counter()
        self.data: dict = {"step": name, "status": "running", "device": device(), "started": now(),
                           "limit_s": limit}
        self.save()

    def left(self) -> float:
        return self.limit - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 2)
        write_json(self.path, self.data)

    def say(self, line: str) -> None:
        print(line, flush=True)
        log(line)


def run_logged(cmd: List[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """A child process whose output goes to the log; returns it with its text."""
    log(f"$ {' '.join(cmd)}")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), **kw)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log(out + f"\n(timed out after {timeout:.0f} s)")
        return subprocess.CompletedProcess(cmd, 124, out, "")
    except OSError as exc:
        log(f"({exc})")
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))
    log(p.stdout + p.stderr)
    return p


def first_line(cmd: List[str]) -> Optional[str]:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        p = subprocess.run([exe] + cmd[1:], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{exe}: {exc}"
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    return lines[0].strip() if lines else exe


# ------------------------------------------------------------------------ facts
def nvidia_smi() -> dict:
    fields = ["name", "driver_version", "memory.total", "pci.bus_id", "pcie.link.gen.current",
              "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max", "clocks.sm",
              "clocks.max.sm", "compute_cap"]
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not on PATH"}
    for fs in (fields, fields[:-1]):  # old drivers know no compute_cap
        p = run_logged([exe, f"--query-gpu={','.join(fs)}", "--format=csv,noheader,nounits"], 15)
        if p.returncode == 0:
            gpus = [dict(zip(fs, (c.strip() for c in line.split(",")))) for line in p.stdout.splitlines()
                    if line.strip()]
            for g in gpus:
                g["numa_node"] = numa_node(g.get("pci.bus_id", ""))
            return {"gpus": gpus}
    return {"error": (p.stdout + p.stderr).strip()[-300:]}


def numa_node(bus_id: str) -> Optional[str]:
    """The NUMA node of a PCI device from sysfs (nvidia-smi's 00000000:19:00.0 form)."""
    m = re.match(r"^(?:[0-9A-Fa-f]{4})?([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$", bus_id.strip()[-12:])
    if not m:
        return None
    try:
        return Path(f"/sys/bus/pci/devices/{m.group(1).lower()}/numa_node").read_text().strip()
    except OSError:
        return None


def ldconfig_libcuda() -> dict:
    """Where ``ldconfig -p`` finds libcuda.so.1: how Triton's launcher finds the driver."""
    exe = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig")
                                            if os.path.exists(p)), None)
    out: Dict[str, object] = {"ldconfig": exe, "TRITON_LIBCUDA_PATH": os.environ.get("TRITON_LIBCUDA_PATH")}
    if exe:
        try:
            p = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10)
            out["libcuda"] = [l.strip() for l in p.stdout.splitlines() if "libcuda.so" in l][:4]
        except (OSError, subprocess.SubprocessError) as exc:
            out["error"] = str(exc)
    return out


def glibc_needed(path: Path) -> Optional[str]:
    """The newest GLIBC_x.y symbol version a library asks for (read from its bytes)."""
    try:
        found = set(re.findall(rb"GLIBC_(\d+)\.(\d+)", path.read_bytes()))
    except OSError:
        return None
    if not found:
        return None
    major, minor = max((int(a), int(b)) for a, b in found)
    return f"{major}.{minor}"


LIB_SYMBOLS = {
    "kvcopy_cpu": ("kvcopy_cpu_abi_version", "kvcopy_cpu_entry_fields", "kvcopy_cpu_copy", "kvcopy_plan_call"),
    "kvcopy_cuda": ("kvcopy_cuda_abi_version", "kvcopy_cuda_entry_fields", "kvcopy_cuda_runtime_version",
                    "kvcopy_cuda_copy",
                    "kvcopy_cuda_store_words", "kvcopy_ce_copy", "kvcopy_ce_batch_abi"),
}


def probe_library(stem: str, path: Optional[Path]) -> dict:
    """Load one native library with ctypes: loads?, symbols, ABI/runtime versions."""
    if path is None or not path.is_file():
        return {"path": str(path) if path else None, "loads": False, "error": "not found"}
    info: Dict[str, object] = {"path": str(path), "bytes": path.stat().st_size, "glibc_needed": glibc_needed(path)}
    from kvcopy import native

    try:
        lib, _ = native.probe(stem, path)  # every signature declared that the library has
    except OSError as exc:
        info.update(loads=False, error=str(exc))
        return info
    missing = [s for s in LIB_SYMBOLS[stem] if not hasattr(lib, s)]
    info.update(loads=not missing, missing_symbols=missing)
    if missing:
        info["error"] = f"out of date: no {', '.join(missing)}"
    for fn in ("kvcopy_cpu_abi_version", "kvcopy_cpu_entry_fields", "kvcopy_cpu_has_openmp",
               "kvcopy_cuda_abi_version", "kvcopy_cuda_entry_fields",
               "kvcopy_cuda_runtime_version", "kvcopy_cuda_threads", "kvcopy_cuda_inline_words",
               "kvcopy_cuda_params_bytes") + (("kvcopy_ce_batch_abi",) if on_gpu() else ()):
        if hasattr(lib, fn):  # constants compiled in (the batch ABI asks the driver: GPU only)
            info[fn.replace("kvcopy_", "")] = getattr(lib, fn)()
    return info


def backend_facts() -> dict:
    """Each backend: available or why not, and the launcher it will use."""
    import kvcopy
    from kvcopy import copy_backends as bk

    out: Dict[str, dict] = {}
    for name, why in kvcopy.available_copy_backends().items():
        d: Dict[str, object] = {"available": why is None}
        if why:
            d["reason"] = why
        out[name] = d
    if out.get("cuda", {}).get("available"):
        out["cuda"]["launcher"] = bk.get_backend("cuda").launcher_kind
    if "triton" in out:
        from kvcopy.copy_backends.triton_backend import interpreting

        out["triton"]["launcher"] = "interpreter" if interpreting() else "compiled (JIT: cc, Python.h, libcuda)"
    if out.get("ce", {}).get("available"):
        from kvcopy import native

        lib, _ = native.load("kvcopy_cuda")
        abi = lib.kvcopy_ce_batch_abi() if lib is not None else 0
        out["ce"]["launcher"] = f"cudaMemcpyBatchAsync (ABI {abi})" if abi else "per-segment cudaMemcpyAsync loop"
    if on_gpu():
        try:
            from kvcopy.copy_backends.calibration import device_key, load_table, table_path

            table = load_table(device_key(0))
            out["auto"] = {"rule": f"calibrated ({table_path()})" if table else "built-in default (uncalibrated)"}
        except Exception as exc:  # facts never fail on a detail
            out["auto"] = {"rule": f"unknown ({type(exc).__name__}: {exc})"}
    else:
        out["auto"] = {"rule": "first of cpu, torch"}
    return out


def step_facts(s: Step) -> str:
    f = s.data
    f["gpu"] = nvidia_smi()
    s.save()
    f["glibc"] = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    f["compilers"] = {c: first_line([c, "--version"]) for c in ("cc", "gcc", "g++", "clang", "nvcc", "cmake")}
    if f["compilers"]["nvcc"]:
        f["compilers"]["nvcc"] = (subprocess.run(["nvcc", "--version"], capture_output=True, text=True)
                                  .stdout.strip().splitlines() or [""])[-1]
    inc = sysconfig.get_paths().get("include", "")
    f["python"] = {"version": sys.version.split()[0], "executable": sys.executable, "include": inc,
                   "Python.h": os.path.isfile(os.path.join(inc, "Python.h"))}
    f["libcuda"] = ldconfig_libcuda()
    s.save()
    from importlib.metadata import PackageNotFoundError, version

    pk = {}
    for dist in ("torch", "triton", "numpy", "cupy-cuda13x", "cupy-cuda12x", "nixl", "nixl-cu12", "nixl-cu13",
                 "pytest", "cmake", "setuptools"):
        try:
            pk[dist] = version(dist)
        except PackageNotFoundError:
            pass
    f["packages"] = pk
    import torch

    t = {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if t["available"]:
        p = torch.cuda.get_device_properties(0)
        t.update(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                 memory_gib=round(p.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
        from kvcopy.bench.timing import cuda_driver_version

        t["driver_cuda"] = cuda_driver_version()
    f["torch"] = t
    s.save()
    from kvcopy import native

    f["native"] = {stem: probe_library(stem, native.find(stem)) for stem in LIB_SYMBOLS}
    s.save()
    f["backends"] = backend_facts()
    s.save()
    s.say(facts_line(f))
    return "ok"


def facts_line(f: dict) -> str:
    gpus = f.get("gpu", {}).get("gpus") or []
    g = gpus[0] if gpus else {}
    t = f.get("torch", {})
    parts = [g.get("name") or t.get("name") or "no GPU"]
    if g:
        parts.append(f"driver {g.get('driver_version')} (CUDA {t.get('driver_cuda')})")
        parts.append(f"PCIe gen {g.get('pcie.link.gen.current')}/{g.get('pcie.link.gen.max')} "
                     f"x{g.get('pcie.link.width.current')}/{g.get('pcie.link.width.max')} (current/max)")
        parts.append(f"NUMA {g.get('numa_node')}")
    parts.append(f"torch {t.get('version')} cuda {t.get('cuda')}")
    pk = f.get("packages", {})
    parts.append(f"triton {pk.get('triton')}")
    parts.append(f"glibc {f.get('glibc', '?').split()[-1] if f.get('glibc') else '?'}")
    cc = [c for c in ("gcc", "clang") if (f.get("compilers") or {}).get(c)]
    parts.append(f"cc {'/'.join(cc) or 'NONE'}, Python.h {'yes' if f.get('python', {}).get('Python.h') else 'NO'}")
    parts.append(f"libcuda in ldconfig {'yes' if f.get('libcuda', {}).get('libcuda') else 'NO'}")
    libs = []
    for stem, p in (f.get("native") or {}).items():
        v = [f"abi {p[k]}" for k in ("cpu_abi_version", "cuda_abi_version") if k in p]
        v += [f"runtime {p['cuda_runtime_version']}"] if "cuda_runtime_version" in p else []
        v += [f"ce batch {p['ce_batch_abi']}"] if "ce_batch_abi" in p else []
        v += [f"needs glibc {p['glibc_needed']}"] if p.get("glibc_needed") else []
        libs.append(f"{stem} {'ok' if p.get('loads') else 'NO: ' + str(p.get('error'))[:80]}"
                    + (f" ({', '.join(v)})" if v else ""))
    launch = []
    for name, b in (f.get("backends") or {}).items():
        if "launcher" in b or "rule" in b:
            launch.append(f"{name}={b.get('launcher') or b.get('rule')}")
        elif not b.get("available"):
            launch.append(f"{name}=unavailable")
    return ("  " + ", ".join(parts) + "\n  libs: " + "; ".join(libs) + "\n  backends: " + "; ".join(launch))


# ------------------------------------------------------------------------ build
def step_build(s: Step) -> str:
    from kvcopy import native

    need = ["kvcopy_cpu"] + (["kvcopy_cuda"] if on_gpu() else [])
    carried = {stem: probe_library(stem, native.find(stem)) for stem in need}
    s.data["carried"] = carried
    bad = [stem for stem in need if not carried[stem]["loads"]]
    if not bad:
        s.data["action"] = "none: the carried libraries load"
        s.say("  no rebuild: " + ", ".join(f"{k} loads from {v['path']}" for k, v in carried.items()))
        return "ok"
    s.data["action"] = "build: " + "; ".join(f"{k} ({carried[k].get('error')})" for k in bad)
    s.say("  rebuilding, since " + s.data["action"][len("build: "):])
    s.save()
    cmake = shutil.which("cmake")
    if cmake is None:
        try:
            import cmake as cmake_pkg  # the cmake wheel

            cmake = str(Path(cmake_pkg.CMAKE_BIN_DIR) / "cmake")
        except ImportError:
            s.data["error"] = "no cmake (PATH or the cmake package)"
            s.say(f"  build FAILED: {s.data['error']}")
            return "failed"
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.isfile(p)), None)
    build, lib_dir = work_dir() / "build", work_dir() / "lib"
    args = [cmake, "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", f"-DKVCOPY_OUTPUT_DIR={lib_dir}"]
    args += [f"-DCMAKE_CUDA_COMPILER={nvcc}"] if (nvcc and on_gpu()) else ["-DKVCOPY_WITH_CUDA=OFF"]
    for cmd in (args, [cmake, "--build", str(build), "-j", str(os.cpu_count() or 2)]):
        p = run_logged(cmd, s.left() - 3)
        if p.returncode != 0:
            s.data["error"] = f"{Path(cmd[0]).name} exit {p.returncode}: " + (p.stdout + p.stderr).strip()[-400:]
            s.say(f"  build FAILED ({s.data['error'][:300]})")
            return "failed"
    built = {stem: probe_library(stem, lib_dir / f"lib{stem}.so") for stem in need}
    s.data["built"] = built
    still = [k for k in need if not built[k]["loads"]]
    if still:
        s.say(f"  rebuilt, but {', '.join(still)} still does not load: {built[still[0]].get('error')}")
        return "failed"
    # Later steps find the rebuilt libraries first (KVCOPY_LIB_DIR), the carried ones stay as they were.
    (work_dir() / "lib_dir").write_text(str(lib_dir))
    abi = built.get("kvcopy_cuda", {}).get("ce_batch_abi")
    s.say(f"  rebuilt {', '.join(bad)} into {lib_dir}" + (f" (ce batch ABI {abi}: 0 means the ce loop)"
                                                           if abi is not None else ""))
    return "ok"


# ------------------------------------------------------------------------ smoke
class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_box(seconds: int):
    """SIGALRM after ``seconds``: a slow case raises; a hung C call is left to the shell's timeout."""
    def fire(signum, frame):
        raise CaseTimeout(f"more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def step_smoke(s: Step) -> str:
    if not on_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import kvcopy
    from kvcopy.bench.scenarios import Scenario

    sz = sizes()
    sc = Scenario(**sz["smoke"])
    point = sc.build(device())
    avail = kvcopy.available_copy_backends()
    cases: List[dict] = []
    s.data.update(scenario=sc.describe(), cases=cases)
    printed = False
    expected = {}
    try:
        for b in sz["smoke_backends"]:
            for d in ("h2d", "d2h"):
                case = {"backend": b, "direction": d}
                cases.append(case)
                if b != "auto" and avail.get(b):
                    case.update(status="unavailable", reason=avail[b])
                    s.save()
                    continue
                t0 = time.perf_counter()
                try:
                    with time_box(SMOKE_CASE_S):
                        if d not in expected:
                            expected[d] = point.expected(d)
                        fn = point.method(b, d)
                        err = point.check(fn, d, expected[d])
                        copier = point.copiers.get(f"{b}@None")
                        if copier is not None:
                            case["chosen"] = copier.copy_backends()["to_host" if d == "d2h" else "to_device"]
                    case.update(status="ok" if err is None else "FAIL", **({"error": err} if err else {}))
                except Exception as exc:  # the point of a smoke test: show what broke
                    tb = traceback.format_exc()
                    log(tb)
                    case.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=tb[-4000:])
                    if not printed:
                        printed = True
                        s.say(f"  first exception ({b} {d}):\n" + "\n".join(
                            "    " + l for l in tb.strip().splitlines()[-14:]))
                case["seconds"] = round(time.perf_counter() - t0, 2)
                s.save()
    finally:
        point.close()
    ran = [c for c in cases if c["status"] != "unavailable"]
    good = [c for c in ran if c["status"] == "ok"]
    s.say(f"  {len(good)}/{len(ran)} bit-exact: " + ", ".join(
        f"{c['backend']} {c['direction']} {c['status']}" for c in cases if c["status"] != "unavailable"))
    missing = [c["backend"] for c in cases if c["status"] == "unavailable" and c["direction"] == "h2d"]
    if missing:
        s.say("  unavailable: " + "; ".join(f"{c['backend']}: {str(c['reason'])[:120]}" for c in cases
                                             if c["status"] == "unavailable" and c["direction"] == "h2d"))
    # On a GPU every GPU backend must run; on the CPU the GPU ones are not even asked.
    return "ok" if len(good) == len(ran) and (not on_gpu() or not missing) else "failed"


# ------------------------------------------------------------------------ tests
def gpu_test_files() -> List[str]:
    """Every test file under tests/ (subfolders included: tests mirror modules) that marks a test ``gpu``."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def step_tests(s: Step) -> str:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        s.data["reason"] = "pytest is not installed for this python"
        s.say(f"  skipped: {s.data['reason']}")
        return "skipped"
    files = gpu_test_files()
    if sizes().get("test_files"):  # the rehearsal: the smallest files only
        files = sorted(files, key=lambda f: (ROOT / f).stat().st_size)[: sizes()["test_files"]]
    xml = work_dir() / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *files, "-q", "-rfE", "--maxfail=5",
           "--durations=10", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    s.data.update(files=files, command=" ".join(cmd[1:]))
    s.save()
    p = run_logged(cmd, s.left() - 3, cwd=str(ROOT))
    s.data["exit_code"] = p.returncode
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: List[str] = []
    try:
        suite = ET.parse(xml).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in counts}
        counts["time_s"] = float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:200]}")
    except (OSError, ET.ParseError) as exc:
        s.data["xml_error"] = str(exc)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    s.data.update(counts=counts, failed=failed)
    tail = [l for l in p.stdout.splitlines() if l.strip()][-6:]
    s.say(f"  {counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
          f"{counts['skipped']} skipped (exit {p.returncode})" + "".join(f"\n    {l[:200]}" for l in tail[-3:]))
    for line in failed[:3]:
        s.say(f"  FAILED {line}")
    if p.returncode == 124:
        return "timeout"
    return "ok" if p.returncode in (0, 5) and not failed else "failed"


# ------------------------------------------------------------------------ ladder
def step_ladder(s: Step) -> str:
    if not on_gpu():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import kvcopy
    from kvcopy import BlockCopier
    from kvcopy.bench.timing import measure

    sz = sizes()
    dev, gpu = device(), on_gpu()
    if not gpu:
        torch.set_num_threads(1)  # a busy CI core: torch's peer threads make copies swing 10x
    size, page = sz["ladder_bytes"], sz["ladder_page"]
    nb = size // page
    d_t = torch.randint(0, 256, (nb, page), dtype=torch.uint8, device=dev)
    h_t = torch.empty((nb, page), dtype=torch.uint8, pin_memory=gpu)
    flat_d = torch.empty(size, dtype=torch.uint8, device=dev)
    flat_h = torch.empty(size, dtype=torch.uint8, pin_memory=gpu)
    ids = [list(range(nb))]  # one run: one contiguous segment of `size` bytes
    avail = kvcopy.available_copy_backends()
    copiers: Dict[str, object] = {}
    s.data.update(bytes=size, description=f"one contiguous {size >> 10} KiB copy ({nb} pages of {page >> 10} KiB, "
                                          "one run), no verify", rows=[])
    sms = torch.cuda.get_device_properties(0).multi_processor_count if gpu else None
    for b in sz["ladder_backends"]:
        if avail.get(b):
            s.data.setdefault("unavailable", {})[b] = avail[b]
            continue
        for cap in (sz.get("ladder_caps", LADDER_CAPS) if b in INFLIGHT_PER_CTA else (0,)):
            try:
                copiers[f"{b}@{cap}" if b in INFLIGHT_PER_CTA else b] = BlockCopier(
                    {"l": d_t}, {"l": h_t}, [["l"]], copy_backend=b, block_dim=0, max_ctas=cap or None)
            except Exception as exc:
                s.data.setdefault("errors", {})[f"{b}@{cap}"] = f"{type(exc).__name__}: {exc}"
    per_method = max(0.02, (s.left() - 10) / 2 / max(1, len(copiers) + 1) / 2)
    try:
        for direction in ("h2d", "d2h"):
            src, dst = (flat_h, flat_d) if direction == "h2d" else (flat_d, flat_h)
            fns: Dict[str, Callable[[], None]] = {"memcpy": lambda src=src, dst=dst: dst.copy_(src, non_blocking=gpu)}
            for key, c in copiers.items():
                fns[key] = (lambda c=c: c.to_device(ids)) if direction == "h2d" else (lambda c=c: c.to_host(ids))
            timing = measure(fns, dev, sz["ladder_iters"], 1, budget_s=per_method, min_iters=2)
            mem = timing["memcpy"].stats().get("median_us")
            for key in fns:
                st = timing[key].stats()
                b, _, cap = key.partition("@")
                row = {"direction": direction, "method": b, "max_ctas": int(cap) if cap and cap != "0" else None,
                       **st}
                if st.get("median_us"):
                    row["gbps"] = size / (st["median_us"] * 1e-6) / 1e9
                    row["pct_of_memcpy"] = 100.0 * mem / st["median_us"] if mem else None
                grid = ladder_grid(copiers.get(key), b, size, sms, row["max_ctas"])
                if grid:
                    row["ctas"] = grid
                    row["inflight_bytes"] = min(size, grid * INFLIGHT_PER_CTA[b])
                    if row.get("gbps"):  # Little's law, meaningful while the rate still grows
                        row["latency_us"] = row["inflight_bytes"] / (row["gbps"] * 1e9) * 1e6
                s.data["rows"].append(row)
            s.save()
    finally:
        for c in copiers.values():
            c.close()
    derive_ladder(s.data)
    s.say(ladder_text(s.data))
    return "ok"


def ladder_grid(copier, backend: str, size: int, sms: Optional[int], cap: Optional[int]) -> Optional[int]:
    """CTAs (programs) the backend launches for this copy."""
    if copier is None or backend not in INFLIGHT_PER_CTA:
        return None
    tables = copier.tables("h2d")
    if backend == "cuda":
        from kvcopy.copy_backends import kernel_inputs

        return kernel_inputs.grid_size(size, sms, cap)
    st = tables.backend_state.get("triton")
    from kvcopy.kernels import triton_copy

    return triton_copy.grid_size(size, st.cfg, st.max_ctas) if st else None


def derive_ladder(data: dict) -> None:
    """Ceiling (best GB/s) and latency (median Little's-law latency of the 1-4 CTA rows)."""
    out = {}
    for d in ("h2d", "d2h"):
        rows = [r for r in data["rows"] if r["direction"] == d and r.get("gbps")]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["gbps"])
        lat = sorted(r["latency_us"] for r in rows if r.get("latency_us") and r.get("ctas", 99) <= 4)
        out[d] = {"ceiling_gbps": best["gbps"], "ceiling_method": best["method"] + (
            f"@{best['max_ctas']}" if best.get("max_ctas") else ""),
            "latency_us": lat[len(lat) // 2] if lat else None}
    data["derived"] = out


def ladder_text(data: dict) -> str:
    lines = []
    for d in ("h2d", "d2h"):
        rows = [r for r in data["rows"] if r["direction"] == d]
        by: Dict[str, List[str]] = {}
        for r in rows:
            uncapped = r.get("max_ctas") is None and r["method"] in INFLIGHT_PER_CTA
            label = "uncapped" if uncapped else str(r.get("max_ctas") or "")
            val = f"{r['gbps']:.3g}" if r.get("gbps") else "-"
            by.setdefault(r["method"], []).append(f"{label}:{val}" if label else val)
        dv = data.get("derived", {}).get(d, {})
        lat = dv.get("latency_us")
        lines.append(f"  {d} GB/s by CTAs: " + " | ".join(f"{m} {' '.join(v)}" for m, v in by.items()))
        if dv:
            lines.append(f"      ceiling {dv['ceiling_gbps']:.1f} GB/s ({dv['ceiling_method']})"
                         + (f", latency ~{lat:.1f} us (bytes in flight / rate, 1-4 CTAs)" if lat else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------ sweep / scenario
def bench(argv: List[str]) -> int:
    """``kvcopy-bench`` in this process, its table into the log (not stdout)."""
    from kvcopy.bench.cli import main

    log("$ kvcopy-bench " + " ".join(argv))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
        finally:
            log(buf.getvalue())
    return rc


def step_sweep(s: Step) -> str:
    path = s.path
    limit = max(5.0, s.left() - 15)  # building the points costs too; the CLI stops starting new ones
    argv = ["sweep", "--device", device(), "--chunk-sizes", SWEEP_CHUNKS, "--verify-max-chunk", "32K",
            "--time-limit", f"{limit:.0f}", "--json", str(path), "--quiet"] + sizes()["sweep"]
    rc = bench(argv)
    res = read_json(path) or {}
    res.update({k: v for k, v in s.data.items() if k not in ("status", "seconds")})
    s.data = res
    s.say(sweep_text(res))
    fails = [r for r in res.get("results", []) if str(r.get("verify", "")).startswith("FAIL")]
    return "ok" if rc == 0 and not fails else "failed"


def sweep_text(res: dict) -> str:
    rows = res.get("results") or []
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "memcpy"]
    lines = []
    for d in dict.fromkeys(r["direction"] for r in rows):
        by = {(r["chunk_bytes"], r["method"]): r for r in rows if r["direction"] == d}
        lines.append(f"  {d} % of memcpy: chunk, memcpy GB/s, " + ", ".join(methods))
        for c in sorted({c for c, _ in by}):
            cells = [f"{by.get((c, 'memcpy'), {}).get('gbps', 0):6.1f}"]
            for m in methods:
                r = by.get((c, m)) or {}
                pct = r.get("pct_of_memcpy")
                bad = str(r.get("verify")).startswith("FAIL")
                cells.append(("-" if pct is None else f"{pct:.0f}") + ("!" if bad else ""))
            lines.append(f"    {c >> 10:>5}K " + " ".join(f"{x:>6}" for x in cells))
    for note in res.get("notes", []):
        lines.append(f"  note: {note[:200]}")
    return "\n".join(lines) or "  no sweep rows"


def step_scenario(s: Step) -> str:
    sz = sizes()
    dev = device()
    status = "ok"
    # The two short host-cost runs first: the seeds2 run takes what is left, and a cut
    # seeds2 run still leaves its finished points (checkpointed, merged by `mark`).
    parts = [
        ("host_path", ["overhead", "--layers", "48", "--groups", "6"] + sz["host_path"]
         + (["--real"] if on_gpu() else [])),
        ("overhead", ["run", "--device", dev, "--num-layers", "48", "--num-groups", "6", "--blocks-per-request", "1",
                      "--block-size", "1"] + sz["overhead"]),
        ("checksum", ["run", "--device", dev] + sz["checksum"]),
        ("seeds2", ["run", "--device", dev, "--op-counts"] + sz["seeds2"]),
    ]
    from kvcopy.bench.scenarios import PRESETS

    if "convert512" in PRESETS:  # issue 10's layout-converting copy, where this tree has it
        parts.append(("convert512", ["run", "--device", dev, "--preset", "convert512"] + sz["convert512"]))
    parts.insert(3, ("offload", ["offload"] + sz["offload"]))
    for name, argv in parts:
        path = work_dir() / f"scenario-{name}.json"
        left = s.left() - 5
        if left < 3:
            s.data[name] = {"error": "no time left in the step"}
            status = "failed"
            continue
        if argv[0] == "run":
            # the seeds2 run's profiler passes are not under --time-limit: leave them a third
            share = {"seeds2": 0.5 if parts[-1][0] != "seeds2" else 0.6, "convert512": 0.6,
                     "checksum": 0.25}.get(name, 0.5)
            argv = argv + ["--time-limit", f"{max(2.0, left * share):.0f}"]
        try:
            if argv[0] == "offload":  # bench/offload_bench.py, in its own process
                p = run_logged([sys.executable, str(ROOT / "bench" / "offload_bench.py"), *argv[1:], "--json",
                                str(path)], max(8.0, left * 0.35), cwd=str(ROOT))
                rc = p.returncode
            else:
                rc = bench(argv + ["--json", str(path), "--quiet"] if argv[0] == "run" else argv + ["--json",
                                                                                                   str(path)])
        except Exception as exc:
            log(traceback.format_exc())
            rc = 1
            s.data[name] = {"error": f"{type(exc).__name__}: {exc}"}
        res = read_json(path)
        if res is not None:
            s.data[name] = res
        if rc != 0:
            status = "failed"
        s.save()
    s.say(scenario_text(s.data))
    return status


SCENARIO_PARTS = ("host_path", "overhead", "checksum", "offload", "seeds2", "convert512")


def offload_lines(res: dict) -> List[str]:
    """bench/offload_bench.py's rows: per page size and direction, each row as x memcpy
    (kvcopy's offloading goal: >= 0.90 at every page size, checksums <= 1.05x)."""
    by: Dict[tuple, Dict[str, dict]] = {}
    for r in (res or {}).get("results", []):
        by.setdefault((r["page_bytes"], r["direction"]), {})[r["method"]] = r
    lines = []
    for (page, direction), rows in sorted(by.items()):
        mem = rows.get("memcpy", {})
        cells = [f"{m} {r['x_memcpy']:.2f}x" for m, r in rows.items() if m != "memcpy"]
        plain, sums = rows.get("kvcopy"), rows.get("kvcopy+sums")
        cost = f", sums {sums['median_us'] / plain['median_us']:.2f}x" if plain and sums else ""
        lines.append(f"  offload {page // 1024} KiB {direction}: memcpy {mem.get('gbps', 0):.1f} GB/s; "
                     + ", ".join(cells) + cost)
    return lines


def checksum_lines(res: dict) -> List[str]:
    """Each kernel with checksums against itself without (same run): the goal is >= 95%."""
    rows = {(r["direction"], r["method"]): r for r in (res or {}).get("results", [])}
    lines = []
    for (direction, method), r in rows.items():
        plain = rows.get((direction, method[: -len("+sum")])) if method.endswith("+sum") else None
        if plain and r.get("median_us") and plain.get("median_us"):
            pct = 100.0 * plain["median_us"] / r["median_us"]
            lines.append(f"  checksum {direction} {method}: {r.get('gbps', 0):.1f} GB/s, {pct:.0f}% of "
                         f"{plain['method']} ({plain.get('gbps', 0):.1f} GB/s; goal >= 95%)"
                         + ("" if r.get("verify") in ("ok", "n/a", None) else f"  {r['verify'][:60]}"))
    return lines


def scenario_text(data: dict) -> str:
    lines = []
    rows = [("seeds2", r) for r in (data.get("seeds2") or {}).get("results", [])]
    rows += [("convert512", r) for r in (data.get("convert512") or {}).get("results", [])]
    for what, r in rows:
        if r["method"] == "memcpy":
            lines.append(f"  {what} {r['groups']} groups {r['direction']} ({r['bytes'] / 2**20:.1f} MiB): memcpy "
                         f"{r.get('median_us', 0) / 1e3:.2f} ms")
            continue
        dev_us = r.get("device_us")
        lines.append(f"    {r['method']:<10} {r.get('x_memcpy') or 0:5.2f}x  ops/call {r.get('ops_per_call', '-')}"
                     + (f"  device {dev_us / 1e3:.2f} ms" if dev_us else "")
                     + (f"  host {r['host_us']:.0f} us" if r.get("host_us") else "")
                     + ("" if r.get("verify") in ("ok", "n/a", None) else f"  {r['verify'][:60]}"))
    lines += checksum_lines(data.get("checksum") or {})
    lines += offload_lines(data.get("offload") or {})
    over = data.get("overhead") or {}
    per = [f"{r['method']} {r['direction']} {r['host_us']:.1f}" for r in over.get("results", [])
           if r.get("host_us") is not None and r["method"] != "memcpy"]
    if per:
        lines.append("  host us per call, real launches, 48 layers x 6 groups (goal < 20): " + ", ".join(per))
    hp = data.get("host_path") or {}
    if hp.get("rows"):
        lines.append("  host us per call, launch replaced by a no-op (stubbed), 48 x 6: " + ", ".join(
            f"{r['label']} {r['median_us']:.1f}" for r in hp["rows"]))
    for name in SCENARIO_PARTS:
        if (data.get(name) or {}).get("error"):
            lines.append(f"  {name}: {data[name]['error'][:200]}")
    return "\n".join(lines) or "  no scenario rows"


# ------------------------------------------------------------------------ mark / summary / save
def cmd_mark(step: str, rc: int) -> None:
    """After the shell saw a step end with ``rc``: a step that never wrote its status gets one."""
    path = out_dir() / FILES[step]
    data = read_json(path) or {"step": step, "device": device()}
    if step == "scenario":  # what the sub-runs finished before the cut
        for name in SCENARIO_PARTS:
            part = read_json(work_dir() / f"scenario-{name}.json")
            if part is not None and name not in data:
                data[name] = part
    if data.get("status") in (None, "running") or (rc not in (0, 1) and data.get("status") == "ok"):
        data["status"] = "timeout" if rc in (124, 137) else "crashed"
        data["exit_code"] = rc
        data.setdefault("step", step)
        write_json(path, data)
        log(f"step {step}: {data['status']} (exit {rc})")


STEP_TEXT = {"facts": facts_line, "sweep": sweep_text, "scenario": scenario_text, "ladder": ladder_text}


def summary() -> int:
    out = out_dir()
    lines = [f"== gpu_check summary: device {device()}, files in {out}"]
    failed = []
    for step in STEPS:
        data = read_json(out / FILES[step])
        status = (data or {}).get("status", "not run")
        if status in FAILED or status == "not run":
            failed.append(step)
        secs = (data or {}).get("seconds")
        lines.append(f"{step:<9} {status.upper() if status in FAILED else status:<8}"
                     + (f" {secs:.0f}s" if isinstance(secs, (int, float)) else ""))
        if data is None:
            continue
        if step == "build":
            lines.append(f"  {data.get('action', '')}" + (f"; {data['error'][:200]}" if data.get("error") else ""))
        elif step == "smoke":
            cases = data.get("cases", [])
            bad = [c for c in cases if c.get("status") not in ("ok", "unavailable")]
            ok = [c for c in cases if c.get("status") == "ok"]
            lines.append(f"  {len(ok)} bit-exact of {len(ok) + len(bad)} run"
                         + "".join(f"\n  {c['backend']} {c['direction']}: {str(c.get('error'))[:200]}"
                                   for c in bad[:4]))
        elif step == "tests":
            c = data.get("counts") or {}
            lines.append(f"  {c.get('passed', '?')} passed, {c.get('failures', '?')} failed, {c.get('errors', '?')} "
                         f"errors, {c.get('skipped', '?')} skipped"
                         + (f" ({data['reason']})" if data.get("reason") else "")
                         + "".join(f"\n  FAILED {f[:200]}" for f in (data.get("failed") or [])[:3]))
        elif step in STEP_TEXT and status != "running":
            try:
                lines.append(STEP_TEXT[step](data))
            except Exception as exc:  # a partial record: say so, do not hide the rest
                lines.append(f"  (cannot summarize: {type(exc).__name__}: {exc})")
    lines.append(f"result: {'FAILED steps: ' + ', '.join(failed) if failed else 'every step ok'}")
    text = "\n".join(l for l in lines if l)
    print(text, flush=True)
    log(text)
    return 1 if failed else 0


def gpu_tag(facts: Optional[dict]) -> str:
    f = facts or {}
    gpus = (f.get("gpu") or {}).get("gpus") or []
    name = (gpus[0].get("name") if gpus else None) or (f.get("torch") or {}).get("name") or (
        "cpu" if f.get("device") == "cpu" else "gpu")
    stamp = re.sub(r"[^0-9T]", "", (f.get("started") or now())[:19]) + "Z"
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", name.lower())).strip("-") + "-" + stamp


def save(src: Path, results: Path) -> List[Path]:
    """Step files of one run -> ``results/<gpu>-<date>-{sweep,seeds2,overhead,convert512,checksum,ladder,
    host-path}.json``."""
    facts = read_json(src / FILES["facts"])
    tag = gpu_tag(facts)
    results.mkdir(parents=True, exist_ok=True)
    written = []
    sweep = read_json(src / FILES["sweep"])
    scen = read_json(src / FILES["scenario"]) or {}
    items = [("sweep", sweep), ("seeds2", scen.get("seeds2")), ("overhead", scen.get("overhead")),
             ("convert512", scen.get("convert512")), ("checksum", scen.get("checksum")),
             ("ladder", read_json(src / FILES["ladder"])),
             ("host-path", scen.get("host_path"))]
    for name, data in items:
        if not data or data.get("error"):
            continue
        data = {k: v for k, v in data.items() if k not in ("step", "limit_s", "started")}
        path = results / f"{tag}-{name}.json"
        write_json(path, data)
        written.append(path)
    return written


# ------------------------------------------------------------------------ entry
STEP_FUNCS = {"facts": step_facts, "build": step_build, "smoke": step_smoke, "tests": step_tests,
              "ladder": step_ladder, "sweep": step_sweep, "scenario": step_scenario}


def run_step(name: str, limit: float) -> int:
    s = Step(name, limit)
    try:
        status = STEP_FUNCS[name](s)
    except Exception as exc:
        tb = traceback.format_exc()
        log(tb)
        s.data.update(error=f"{type(exc).__name__}: {exc}", traceback=tb[-4000:])
        s.say(f"  {name} raised {type(exc).__name__}: {str(exc)[:300]}\n" + "\n".join(
            "    " + l for l in tb.strip().splitlines()[-8:]))
        status = "failed"
    s.data["status"] = status
    s.save()
    return 1 if status in FAILED else 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=STEPS + ("mark", "summary", "save"))
    p.add_argument("step_or_dir", nargs="?", help="mark: the step; save: the folder of a run's files")
    p.add_argument("--limit", type=float, default=60.0, help="seconds this step may take (the shell's timeout)")
    p.add_argument("--rc", type=int, default=0, help="mark: the step's exit status")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"), help="save: where the JSONs go")
    a = p.parse_args(argv)
    if a.command == "mark":
        cmd_mark(a.step_or_dir, a.rc)
        return 0
    if a.command == "summary":
        return summary()
    if a.command == "save":
        for path in save(Path(a.step_or_dir or out_dir()), Path(a.results)):
            print(f"wrote {path}")
        return 0
    return run_step(a.command, a.limit)


if __name__ == "__main__":
    sys.exit(main())
