"""Real vLLM engines on the CPU (kvcopy.testing.engine): run in the engine environment
that ``bench/engine_env.sh`` builds, from the repository root:

    VLLM_TARGET_DEVICE=cpu ENV/bin/python -m pytest -q tests/engine

Elsewhere (no vLLM with its CPU ops) every test here skips, saying so;
``KVCOPY_REQUIRE_ENGINE=1`` (CI) turns that into a failure. Engines are module- or
session-scoped processes (about 20-40 s to start on 2 cores), each in its own process
group, killed at the end; their logs are in the session's temporary folder.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE = os.environ.get("KVCOPY_REQUIRE_ENGINE", "") not in ("", "0")


def _engine_env_missing():
    if importlib.util.find_spec("vllm") is None:
        return "vLLM 0.33 not installed: the engine tests run in the engine environment (bench/engine_env.sh)"
    if importlib.util.find_spec("vllm._C") is None:
        return ("vLLM has no CPU ops (vllm._C) here: the engine tests run in the engine environment "
                "(bench/engine_env.sh), not the vLLM test environment")
    return None


MISSING = _engine_env_missing()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not MISSING or not mine:
        return
    if REQUIRE:
        raise pytest.UsageError(f"KVCOPY_REQUIRE_ENGINE=1 and {len(mine)} engine tests cannot run: {MISSING}")
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory):
    """Models and engine logs of this session."""
    return str(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def model(engine_dir):
    """``model(family, seed)``: the tiny model's folder, built once per session."""
    from kvcopy.testing.engine.models import build_model

    built = {}

    def get(family: str, seed: int = 0) -> str:
        key = (family, seed)
        if key not in built:
            built[key] = build_model(family, os.path.join(engine_dir, f"{family}-{seed}"), seed=seed).path
        return built[key]
    return get


@pytest.fixture(scope="session")
def single(engine_dir, model):
    """``single(family, seed=0, **config)``: a plain engine (no connector) on that model,
    started once per session and configuration: the reference every case is compared with."""
    from kvcopy.testing.engine.pd import engine_config
    from kvcopy.testing.engine.process import Engine

    engines = {}

    def get(family: str, seed: int = 0, **cfg):
        key = (family, seed, tuple(sorted(cfg.items())))
        if key not in engines:
            name = f"single-{family}-{seed}-{len(engines)}"
            e = Engine(name, engine_config(model(family, seed), **cfg), os.path.join(engine_dir, name + ".log"))
            engines[key] = e.start()
            e.wait_ready()
        return engines[key]
    yield get
    for e in engines.values():
        e.close()
