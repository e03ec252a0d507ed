"""pytest plugin: vLLM's own NIXL connector tests with kvcopy's connector substituted.

    cd vllm-0.33.0 && python -m pytest -p vllm_substitute -m cpu_test \\
        tests/v1/kv_connector/unit/test_nixl_connector.py ...

(with this directory on ``PYTHONPATH``; ``tests/vllm/run_vllm_nixl_suite.sh`` does it all).
Before vLLM's test modules import them, every public name of vLLM's pull connector
and pull worker (``NixlConnector``, ``NixlPullConnector``, ``NixlConnectorWorker``,
``NixlPullConnectorWorker``) is pointed at :class:`kvcopy.vllm.KvcopyNixlConnector` /
:class:`kvcopy.vllm.KvcopyNixlWorker`, in the ``nixl`` package, its modules and the
connector factory's lookups, so the tests construct, patch and drive kvcopy's classes.
"""
from __future__ import annotations

import importlib
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import kvcopy.vllm as kv  # noqa: E402

_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_NAMES = {
    "NixlConnector": kv.KvcopyNixlConnector,
    "NixlPullConnector": kv.KvcopyNixlConnector,
    "NixlConnectorWorker": kv.KvcopyNixlWorker,
    "NixlPullConnectorWorker": kv.KvcopyNixlWorker,
}


def pytest_configure(config):
    replaced = 0
    for mod_name in (_PKG, f"{_PKG}.connector", f"{_PKG}.worker", f"{_PKG}.pull_worker"):
        mod = importlib.import_module(mod_name)
        for name, cls in _NAMES.items():
            if hasattr(mod, name):
                setattr(mod, name, cls)
                replaced += 1
    config.stash_kvcopy_replaced = replaced


def pytest_report_header(config):
    return (f"kvcopy substitution: NixlConnector -> kvcopy.vllm.KvcopyNixlConnector, "
            f"NixlConnectorWorker -> KvcopyNixlWorker ({config.stash_kvcopy_replaced} names)")
