"""Test configuration.

* GPU tests (``@pytest.mark.gpu``) skip here, in one place, when there is no CUDA device.
* ``--require-gpu`` (or ``KVCOPY_REQUIRE_GPU=1``) turns the skip of every GPU test, for
  whatever reason (no device, no NVRTC, a library not built), into a failure: a GPU
  runner that lost its GPU cannot pass green (.github/workflows/gpu.yml sets it).
* The run ends with one line saying why tests were skipped (``-q`` only counts them):
  ``skipped: 542 need a CUDA device, 2 need vLLM 0.33 ...``.
"""
import os
from collections import Counter

import pytest
import torch

NEEDS_CUDA = "needs a CUDA device"


def pytest_addoption(parser):
    parser.addoption("--require-gpu", action="store_true", default=False,
                     help="fail, not skip, every test marked gpu that does not run (also KVCOPY_REQUIRE_GPU=1)")


def require_gpu(config) -> bool:
    return bool(config.getoption("--require-gpu")) or os.environ.get("KVCOPY_REQUIRE_GPU", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" in item.keywords and require_gpu(item.config) and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        report.outcome = "failed"  # reported as an error when the skip came at setup (the marker)
        report.longrepr = f"--require-gpu / KVCOPY_REQUIRE_GPU=1: this GPU test was skipped ({reason})"


def _reason(report) -> str:
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


def _about_vllm(reason: str) -> bool:
    """A skip for want of vLLM (its importorskip's message, or ours), not any mention of it."""
    low = reason.lower()
    return "vllm" in low and any(k in low for k in ("not installed", "no module named", "could not import"))


def pytest_terminal_summary(terminalreporter):
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reasons[_reason(report)] += 1
    if not reasons:
        return
    cuda = sum(n for r, n in reasons.items() if r == NEEDS_CUDA)
    vllm = sum(n for r, n in reasons.items() if _about_vllm(r))
    parts = ([f"{cuda} need a CUDA device"] if cuda else []) + (
        [f"{vllm} need vLLM 0.33 (README: 'Set up and test' runs them)"] if vllm else [])
    other = [(r, n) for r, n in reasons.most_common() if r != NEEDS_CUDA and not _about_vllm(r)]
    parts += [f"{n} {r}" for r, n in other[:4]]
    if len(other) > 4:
        parts.append(f"{sum(n for _, n in other[4:])} for {len(other) - 4} other reasons (-rs lists them)")
    terminalreporter.write_line("skipped: " + "; ".join(parts))


@pytest.fixture
def prefill():
    """A prefill engine in a child process, driven over a pipe (kvcopy.testing.nixl.engines)."""
    from kvcopy.testing.nixl.engines import PrefillProcess, one_torch_thread

    proc = PrefillProcess()
    with one_torch_thread():
        yield proc
    proc.stop()
