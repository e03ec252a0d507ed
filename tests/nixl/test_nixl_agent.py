"""The NIXL wrapper: import by any wheel name, set-up errors raised, transfer errors as values."""
import sys
import types

import numpy as np
import pytest

from kvcopy.nixl import agent as _agent
from kvcopy.nixl.agent import Agent, NixlError


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
    code = "from kvcopy.nixl.agent import Agent\na = Agent('quiet-probe')\na.close()\nprint('end')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "KVCOPY_VERBOSE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
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


def _threads() -> set:
    import os

    return set(os.listdir("/proc/self/task"))


def _runnable_fraction(threads: set, seconds: float = 0.5, samples: int = 50) -> float:
    """Fraction of samples in which one of ``threads`` (Linux thread ids) is running or
    runnable (state ``R``). A busy-polling thread is ``R`` whether or not it holds a
    core, a sleeping one ``S``: unlike its CPU time, this does not depend on how many
    other processes compete for the cores (measured: a delay-0 agent got 0.24 CPU/s
    on the 2-core development machine beside three busy processes)."""
    import time

    hits = 0
    for _ in range(samples):
        for tid in threads:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # the thread ended
                continue
            if state == "R":
                hits += 1
                break
        time.sleep(seconds / samples)
    return hits / samples


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_idle_agents_sleep_and_delay_zero_busy_polls():
    """With the default progress delay the threads of two idle agents sleep; with NIXL's
    own delay 0 one idle agent's progress thread busy-polls (the behaviour the delay
    exists to avoid). Thread states, not CPU time: see :func:`_runnable_fraction`."""
    import time

    before = _threads()
    quiet = [Agent(f"agent-idle-{i}") for i in range(2)]
    try:
        time.sleep(0.2)  # past the first progress pass of each thread
        assert _runnable_fraction(_threads() - before) < 0.2
    finally:
        for a in quiet:
            a.close()
    before = _threads()
    busy = Agent("agent-busy", progress_delay_us=0)
    try:
        assert _runnable_fraction(_threads() - before) > 0.8
    finally:
        busy.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_nixl_thread_nice_lowers_only_the_threads_the_agent_started():
    """The threads that appear while an agent is built (NIXL's progress thread, UCX's
    async thread) get ``nixl_thread_nice``; the caller's and the process's other threads
    keep theirs; an agent built without it leaves its threads at the caller's."""
    import os

    def nice_of(tids):
        out = {}
        for tid in tids:
            try:
                out[tid] = os.getpriority(os.PRIO_PROCESS, int(tid))
            except ProcessLookupError:
                pass
        return out
    before = _threads()
    others = nice_of(before)
    low = Agent("agent-nice-low", nixl_thread_nice=17)
    try:
        started = nice_of(_threads() - before)
        assert started and set(started.values()) == {17}, started
        assert nice_of(before) == others  # this thread and the rest untouched
        mid = _threads()
        plain = Agent("agent-nice-plain")
        try:
            assert set(nice_of(_threads() - mid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}
        finally:
            plain.close()
    finally:
        low.close()


@pytest.mark.parametrize("bad", [-1, 20, 1.0, True, "5"])
def test_nixl_thread_nice_is_checked(bad):
    with pytest.raises(ValueError, match="nixl_thread_nice"):
        Agent("agent-bad-nice", nixl_thread_nice=bad)


@pytest.mark.parametrize("bad", [-1, 10_000_001, 1.5, True, "100"])
def test_progress_delay_is_checked(bad):
    with pytest.raises(ValueError, match="progress_delay_us"):
        Agent("agent-bad-delay", progress_delay_us=bad)


def test_sleeping_agents_still_read_and_notify():
    """A READ between two agents whose progress threads sleep completes bit-exact, and
    its notification reaches the target (woken by UCX's event fd, not by the timeout)."""
    import time

    src = Agent("agent-sleep-src", progress_delay_us=10_000_000)
    dst = Agent("agent-sleep-dst", progress_delay_us=10_000_000)
    try:
        a = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        b = np.full(1 << 20, 0xA5, dtype=np.uint8)
        src.register([(a.ctypes.data, a.nbytes, 0)], "DRAM")
        dst.register([(b.ctypes.data, b.nbytes, 0)], "DRAM")
        peer = dst.add_remote(src.metadata())
        src.add_remote(dst.metadata())
        rows = np.array([[b.ctypes.data, b.nbytes, 0]], np.uint64)
        local = dst.prep_local(rows, "DRAM")
        remote = dst.prep_remote(peer, np.array([[a.ctypes.data, a.nbytes, 0]], np.uint64), "DRAM")
        idx = np.array([0], np.int32)
        handle, state, reason = dst.post_read(local, idx, remote, idx, b"done-1")
        t0 = time.monotonic()
        while state == "PROC" and time.monotonic() - t0 < 60:
            state, reason = dst.state(handle)
        assert state == "DONE", reason
        assert np.array_equal(a, b)
        got = {}
        while not got and time.monotonic() - t0 < 60:
            got = src.notifications()
        assert got == {"agent-sleep-dst": [b"done-1"]}
        # Woken by the event, not by the 10 s timeout (one timeout alone would take >= 10 s).
        assert time.monotonic() - t0 < 9
        dst.release(handle)
        Agent.release_dlist(local)
        Agent.release_dlist(remote)
    finally:
        dst.close()
        src.close()


def _fake_wrapper(calls_binding: bool, fail: bool = False):
    """A NIXL-like wrapper module whose agent is built through ``nixlBind.nixlAgent``
    (or not), recording the configs the binding saw."""
    seen = []
    bind = types.SimpleNamespace(nixlAgentConfig=lambda: types.SimpleNamespace(pthrDelay=0))

    def binding_agent(name, config):
        seen.append(config.pthrDelay)
        if fail:
            raise RuntimeError("NIXL_ERR_BACKEND")
        return name

    bind.nixlAgent = binding_agent
    mod = types.ModuleType("fake_nixl_api")

    class nixl_agent:  # noqa: N801 (NIXL's name)
        def __init__(self, name, conf):
            cfg = bind.nixlAgentConfig()
            self.agent = bind.nixlAgent(name, cfg) if calls_binding else name

    mod.nixl_agent, mod.nixl_agent_config, mod.nixlBind = nixl_agent, (lambda backends: None), bind
    nixl_agent.__module__ = mod.__name__
    return mod, bind, binding_agent, seen


def test_make_agent_sets_the_delay_and_restores_the_binding(monkeypatch):
    mod, bind, original, seen = _fake_wrapper(True)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    _agent.make_agent(mod, "a", ["UCX"], 1234)
    assert seen == [1234] and bind.nixlAgent is original
    mod, bind, original, seen = _fake_wrapper(True, fail=True)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with pytest.raises(RuntimeError, match="NIXL_ERR_BACKEND"):
        _agent.make_agent(mod, "a", ["UCX"], 1234)
    assert seen == [1234] and bind.nixlAgent is original  # restored after a failed build


def test_make_agent_warns_when_the_wrapper_bypasses_the_binding(monkeypatch, caplog):
    import logging

    mod, bind, original, seen = _fake_wrapper(False)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with caplog.at_level(logging.WARNING, logger="kvcopy.nixl"):
        _agent.make_agent(mod, "a", ["UCX"], 1234)
    assert seen == [] and bind.nixlAgent is original
    assert "busy polling" in caplog.text and "progress_delay_us=1234" in caplog.text


class _Pair:
    """Two agents, D with P loaded and a READ of P's 4 KiB buffer prepared."""

    def __init__(self, tag: str):
        self.p, self.d = Agent(f"agent-{tag}-p"), Agent(f"agent-{tag}-d")
        self.src = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
        self.dst = np.zeros(4096, dtype=np.uint8)
        self.p.register([(self.src.ctypes.data, 4096, 0)], "DRAM")
        self.d.register([(self.dst.ctypes.data, 4096, 0)], "DRAM")
        self.peer = self.d.add_remote(self.p.metadata())
        self.dlists = [self.d.prep_local(np.array([[self.dst.ctypes.data, 4096, 0]], np.uint64), "DRAM"),
                       self.d.prep_remote(self.peer, np.array([[self.src.ctypes.data, 4096, 0]], np.uint64), "DRAM")]

    def read(self):
        """Post the READ and wait for it to end; (state, reason)."""
        import time

        idx = np.array([0], np.int32)
        xfer, state, reason = self.d.post_read(self.dlists[0], idx, self.dlists[1], idx, b"")
        end = time.monotonic() + 30
        while state == "PROC" and time.monotonic() < end:
            state, reason = self.d.state(xfer)
        if xfer is not None:
            Agent.release(xfer)
        return state, reason

    def release_dlists(self):
        for dlist in self.dlists:
            Agent.release_dlist(dlist)
        self.dlists = []

    def close(self):
        self.release_dlists()
        self.d.close()
        self.p.close()


def _until_disconnected(attempt, peer_gone):
    """Repeat ``attempt`` until its reason names a failed connection: D's agent learns
    that P closed from a message its progress thread handles some time after."""
    import time

    end = time.monotonic() + 30
    while True:
        reason = attempt()
        if reason is not None and _agent.DISCONNECTED in reason:
            return reason
        assert time.monotonic() < end, f"NIXL never reported {peer_gone!r}'s connection failed: {reason}"
        time.sleep(0.02)


def test_a_peer_whose_connection_failed_is_unloaded_not_parked():
    """A live peer released is parked; one whose READ NIXL ended with
    NIXL_ERR_REMOTE_DISCONNECT is unloaded, so its metadata would be loaded anew."""
    failed, live = _Pair("failed"), _Pair("live")
    try:
        assert failed.read() == ("DONE", None) and np.array_equal(failed.src, failed.dst)
        assert not failed.d.connection_failed(failed.peer)
        failed.p.close()
        _until_disconnected(lambda: failed.read()[1], failed.peer)
        assert failed.d.connection_failed(failed.peer)
        failed.release_dlists()
        failed.d.release_remote(failed.peer)
        assert failed.peer not in failed.d.parked and not failed.d.has_remote(failed.peer)
        assert not failed.d.connection_failed(failed.peer)
        live.release_dlists()
        live.d.release_remote(live.peer)  # alive: parked (unloading it would leak its sockets)
        assert live.peer in live.d.parked and live.d.has_remote(live.peer)
    finally:
        failed.close()
        live.close()


def test_a_parked_peer_whose_connection_failed_is_loaded_anew():
    """The failure is reported after the peer was parked (here by a notification; in the
    manager, by a READ given up on): ``add_remote`` of the same metadata does not take
    the parked agent up, it unloads it and loads the metadata again."""
    pair = _Pair("parked")
    d, peer = pair.d, pair.peer
    try:
        metadata = pair.p.metadata()
        pair.release_dlists()
        d.release_remote(peer)
        assert peer in d.parked
        assert d.add_remote(metadata) == peer and peer not in d.parked  # alive: taken up again
        d.release_remote(peer)
        pair.p.close()
        _until_disconnected(lambda: d.send_notification(peer, b"done"), peer)
        assert peer in d.parked and d.connection_failed(peer)
        loads = []
        real = d._agent.add_remote_agent
        d._agent.add_remote_agent = lambda md: loads.append(md) or real(md)
        try:
            d.add_remote(metadata)
        except NixlError:
            pass  # P is gone: loading its metadata may fail; it was tried, not taken from the park
        assert loads == [metadata] and not d.connection_failed(peer)
    finally:
        pair.close()


def test_a_disconnect_from_an_earlier_load_is_not_charged_to_the_new_one():
    """A READ of an unloaded load of the peer (given up on, ending later) says nothing
    about the connection its metadata was loaded again with."""
    pair = _Pair("loads")
    d, peer = pair.d, pair.peer
    try:
        first = d._load_of[peer]
        pair.release_dlists()
        d.unload_remote(peer)
        assert d.add_remote(pair.p.metadata()) == peer
        d._charge(peer, first, f"transfer failed: {_agent.DISCONNECTED}")
        assert not d.connection_failed(peer)
        d._charge(peer, d._load_of[peer], f"transfer failed: {_agent.DISCONNECTED}")
        assert d.connection_failed(peer)
    finally:
        pair.close()
