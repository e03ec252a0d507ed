"""The NIXL wrapper: import by any wheel name, set-up errors raised, transfer errors as values."""
import sys
import types

import numpy as np
import pytest

from kvcopy.nixl import _agent
from kvcopy.nixl._agent import Agent, NixlError


@pytest.fixture
def fresh_import(monkeypatch):
    monkeypatch.setattr(_agent, "_module", None)
    return monkeypatch


def test_meta_package_api_module_is_found(fresh_import):
    real = pytest.importorskip("nixl_cu12._api")  # the wheel this environment installs
    meta = types.ModuleType("nixl")  # the meta package: API under nixl._api only
    meta_api = types.ModuleType("nixl._api")
    meta_api.nixl_agent, meta_api.nixl_agent_config = real.nixl_agent, real.nixl_agent_config
    fresh_import.setitem(sys.modules, "nixl", meta)
    fresh_import.setitem(sys.modules, "nixl._api", meta_api)
    assert _agent.load_nixl() is meta_api


def test_missing_nixl_says_what_to_install(fresh_import):
    for name in ("nixl", "nixl_cu12", "nixl_cu13"):
        fresh_import.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install nixl-cu12"):
        _agent.load_nixl()
    assert "pip install" in _agent.nixl_available()


def test_setup_errors_raise_and_transfer_errors_are_values():
    with pytest.raises(ValueError, match="non-empty name"):
        Agent("")
    with pytest.raises(NixlError, match="unavailable"):
        Agent("agent-no-backend", ("NO_SUCH_BACKEND",))
    a = Agent("agent-errors")
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        a.register([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
        local = a.prep_local(np.array([[buf.ctypes.data, 1024, 0]], dtype=np.uint64), "DRAM")
        with pytest.raises(NixlError, match="rejected 1 peer 'nobody'"):
            a.prep_remote("nobody", np.array([[1 << 40, 1024, 0]], dtype=np.uint64), "DRAM")
        with pytest.raises(NixlError, match="loading the peer"):
            a.add_remote(b"garbage")
        handle, state, reason = a.post_read(local, np.array([0], np.int32), local, np.array([5], np.int32), b"")
        assert (handle, state) == (None, "ERR") and "NIXL rejected the transfer" in reason
        assert a.send_notification("nobody", b"x") is not None  # unknown peer: reason, no raise
        Agent.release_dlist(local)
    finally:
        a.close()


def test_nixl_info_lines_are_off_by_default():
    """A new agent prints nothing to stdout (NIXL logs an INFO line per agent and backend)."""
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("nixl_cu12")
    code = "from kvcopy.nixl._agent import Agent\na = Agent('quiet-probe')\na.close()\nprint('end')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "KVCOPY_VERBOSE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout == "end\n"


def test_verbose_or_nixl_log_level_keeps_nixl_logging(monkeypatch):
    import logging

    logger = logging.getLogger("nixl")
    monkeypatch.setattr(logger, "level", logging.INFO)
    for var in ("KVCOPY_VERBOSE", "NIXL_LOG_LEVEL"):
        monkeypatch.setenv(var, "1" if var == "KVCOPY_VERBOSE" else "INFO")
        _agent._quiet_nixl_logging()
        assert logger.level == logging.INFO, var
        monkeypatch.delenv(var)
    _agent._quiet_nixl_logging()
    assert logger.level == logging.WARNING
