"""pytest-benchmark over the main scenarios: every method of ``kvcopy-bench`` side by side.

Each benchmark group is one (scenario, direction) and holds the contiguous memcpy of the
same bytes, the two baselines (vLLM's per-group loop, and its coalesced variant since
vLLM coalesced host-buffer copies across groups) and every kvcopy backend the host runs;
``extra_info`` carries the bytes per call so GB/s can be read from the JSON
(``--benchmark-json``). Each method is checked bit-exact against the reference once
before it is timed. On a GPU a call includes the wait for the stream (a request-sync,
as vLLM's coalescing pull request timed it).
"""
import os

import pytest
import torch

from kvcopy import available_copy_backends
from kvcopy.bench.scenarios import PRESETS
from dataclasses import replace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE != "cpu"

SCENARIOS = {
    "seeds2-g1": replace(PRESETS["seeds2"]["scenario"], num_groups=1),
    "seeds2-g6": replace(PRESETS["seeds2"]["scenario"], num_groups=6),
    "hybrid7": PRESETS["hybrid7"]["scenario"],
    "dense": PRESETS["dense"]["scenario"],
    "mla": PRESETS["mla"]["scenario"],
}
METHODS = ["memcpy", "vllm", "coalesced", "torch", "cpu", "triton", "cuda", "ce", "auto"]

_points = {}


@pytest.fixture(scope="module")
def points():
    yield _points
    for p in _points.values():
        p.close()
    _points.clear()


def _point(points, name: str):
    if name not in points:
        points[name] = SCENARIOS[name].build(DEVICE)
    return points[name]


def _skip_reason(method: str):
    if method in ("memcpy", "vllm", "coalesced", "auto"):
        return None
    if method == "cpu" and GPU:
        return "cpu backend copies CPU tensors only"
    if method == "triton" and not GPU and not os.environ.get("TRITON_INTERPRET"):
        return "triton on CPU only under TRITON_INTERPRET=1 (slow)"
    return available_copy_backends().get(method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_copy(benchmark, points, scenario, direction, method):
    why = _skip_reason(method)
    if why:
        pytest.skip(why)
    point = _point(points, scenario)
    try:
        fn = point.method(method, direction)
    except (ValueError, TypeError) as exc:
        pytest.skip(f"{method}: {exc}")
    if method != "memcpy":
        err = point.check(fn, direction, point.expected(direction))
        assert err is None, err
    call = fn
    if GPU:
        def call():
            fn()
            torch.cuda.synchronize()
    benchmark.group = f"{scenario} {direction}"
    benchmark.extra_info.update(bytes=point.total_bytes, scenario=SCENARIOS[scenario].describe(),
                                device=DEVICE)
    benchmark(call)
    if benchmark.stats is None:  # --benchmark-disable: the call ran once, unmeasured
        return
    median = benchmark.stats.stats.median
    if median:
        benchmark.extra_info["gbps"] = point.total_bytes / median / 1e9
