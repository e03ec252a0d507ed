"""Engines in their own processes (:mod:`.driver`), started, driven and killed from here.

Each engine is a process group of its own (vLLM's engine core and worker are children
of the driver), so :meth:`Engine.kill` ends all of it with one ``killpg``; every wait
has a deadline. Its log (vLLM's stdout and stderr) goes to a file the caller names,
read back by :meth:`Engine.log`.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Set

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


class EngineError(RuntimeError):
    """An engine did not start, died, did not answer in time, or its command failed."""


_HANDED_OUT: Set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 no socket holds now, and not handed out by this process
    before: the kernel can give one free port to two callers that have not bound it yet,
    and ``vllm serve`` binds with ``SO_REUSEPORT``, so a P and a D on one port share its
    connections (seen: D's requests reached P)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def read_log(path: str) -> str:
    """A process's log file as text ("" before it exists)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def engine_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment engines run in: the CPU platform, no hub, 1 GiB of KV cache, and
    this checkout's ``kvcopy`` first on the path."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env.update({
        "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
        "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "0",
    })
    env.update(extra or {})
    return env


class Engine:
    """One engine process; :meth:`start` returns at once, :meth:`wait_ready` waits for it."""

    def __init__(self, name: str, config: Dict[str, Any], log_path: str, env: Optional[Dict[str, str]] = None,
                 python: str = sys.executable, prefix: Sequence[str] = ()):
        self.name, self.config, self.log_path, self.python = name, config, log_path, python
        self.prefix = list(prefix)  # runs the driver through it (``TwoHosts.exec_prefix``: another namespace)
        self.env = engine_env(env)
        self.proc: Optional[subprocess.Popen] = None
        self._reply: Optional[int] = None  # the read end of the driver's reply pipe
        self._buf = b""
        self.startup_s: Optional[float] = None

    # ------------------------------------------------------------ life
    def start(self) -> "Engine":
        r, w = os.pipe()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.prefix + [self.python, "-m", "kvcopy.testing.engine.driver", json.dumps(self.config), str(w)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(w,), env=self.env,
                start_new_session=True)
        finally:
            os.close(w)
            log.close()
        self._reply = r
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Engine":
        msg = self._read(timeout, "start")
        if not msg.get("ready"):
            self.kill()
            raise EngineError(f"engine {self.name} did not start: {msg.get('error')}\n{msg.get('traceback', '')}"
                              f"{self.log_tail()}")
        self.startup_s = msg["startup_s"]
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (driver, engine core, worker)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._close_pipes()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to exit, then kill whatever of its group is left."""
        if self.alive():
            try:
                self._send({"op": "exit"})
                self._read(timeout, "exit")
            except (EngineError, OSError):
                pass
        self.kill()

    def _close_pipes(self) -> None:
        if self._reply is not None:
            os.close(self._reply)
            self._reply = None
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    # ------------------------------------------------------------ commands
    def call(self, cmd: Dict[str, Any], timeout: float = CALL_TIMEOUT_S) -> Dict[str, Any]:
        self._send(cmd)
        reply = self._read(timeout, cmd.get("op", "?"))
        if not reply.get("ok"):
            raise EngineError(f"engine {self.name}: {cmd.get('op')} failed: {reply.get('error')}\n"
                              f"{reply.get('traceback', '')}")
        return reply

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens, kv_transfer_params=None,
                 timeout: float = CALL_TIMEOUT_S, request_ids: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
        cmd = {"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
               "kv_transfer_params": kv_transfer_params}
        if request_ids is not None:
            cmd["request_ids"] = list(request_ids)
        return self.call(cmd, timeout)["outputs"]

    def metrics(self) -> Dict[str, float]:
        """vLLM's counters, keyed ``name{label=value,...}`` (labels sorted, engine left out)."""
        out = {}
        for name, labels, value in self.call({"op": "metrics"})["metrics"]:
            keep = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("engine", "model_name"))
            out[f"{name}{{{keep}}}" if keep else name] = value
        return out

    def rpc(self, method: str, *args, timeout: float = 60.0) -> List[Any]:
        return self.call({"op": "rpc", "method": method, "args": list(args), "timeout": timeout},
                         timeout + 10)["results"]

    def reset_prefix_cache(self) -> bool:
        return self.call({"op": "reset_prefix_cache"})["reset"]

    def log(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, n: int = 40) -> str:
        lines = self.log().splitlines()[-n:]
        return "\n--- " + self.name + " log tail ---\n" + "\n".join(lines) if lines else ""

    def _send(self, cmd: Dict[str, Any]) -> None:
        if not self.alive():
            raise EngineError(f"engine {self.name} is not running (exit {self.proc and self.proc.poll()})"
                              f"{self.log_tail()}")
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def _read(self, timeout: float, what: str) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"engine {self.name}: no answer to {what} within {timeout:g} s{self.log_tail()}")
            if self._reply is None:
                raise EngineError(f"engine {self.name}: closed")
            ready, _, _ = select.select([self._reply], [], [], min(left, 1.0))
            if not ready:
                if not self.alive():
                    raise EngineError(f"engine {self.name} died (exit {self.proc and self.proc.poll()}) "
                                      f"during {what}{self.log_tail()}")
                continue
            chunk = os.read(self._reply, 1 << 20)
            if not chunk:
                raise EngineError(f"engine {self.name} closed its reply pipe during {what}{self.log_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)
