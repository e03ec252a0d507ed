"""The benchmark suite (pytest-benchmark). Not part of ``pytest`` from the repo root, whose
testpaths is ``tests``; run it explicitly:

    pytest bench/ --benchmark-columns=median,iqr,rounds --benchmark-group-by=group
"""
import pytest

pytest.importorskip("pytest_benchmark", reason="pip install pytest-benchmark")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
