"""``vllm serve`` engines and the small P/D proxy in front of them, as users run them.

* :class:`Server`: one ``vllm serve`` process group (OpenAI API on 127.0.0.1, or on
  ``host`` in another network namespace: ``prefix``), its log in a file;
  :meth:`Server.wait_ready` polls ``/health``.
* :class:`Proxy`: what a P/D proxy does for ``POST /v1/completions``, in one of two ways.
  **Sequential** (vLLM's toy proxies): the request goes to P with
  ``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``, P's returned
  ``kv_transfer_params`` go to D with the request as the client sent it, and D's answer
  (streamed through when the client asked for a stream) goes back. **Concurrent**
  (vLLM's push convention, given P's coordinates: :class:`PrefillEngine`): the request
  goes to P and to D at once, both with one ``X-Request-Id``, D's with
  :meth:`PrefillEngine.decode_params` (P's engine id and side channel, no block ids:
  P has not answered), so D can get ready for P's KV while P computes it. vLLM's
  engines add a random suffix to that id (``-`` and 8 hex digits), different on P and
  D; push connectors match the two by the id without it (vLLM's ``get_base_request_id``).
* :func:`complete`: an HTTP client call (``urllib``), token-id prompt in, token ids out;
  :func:`stream_first_token` the same streamed, timed to its first token.
* :func:`metrics`: a server's Prometheus counters; :func:`rpc`: ``/collective_rpc`` on a
  server started with ``VLLM_SERVER_DEV_MODE=1`` (the test hooks).
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Dict, List, Optional, Sequence

from .process import engine_env, free_port, read_log

SERVED_NAME = "tiny"


def post_json(url: str, body: Dict[str, Any], timeout: float, request_id: Optional[str] = None):
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class PrefillEngine:
    """P as a concurrent proxy knows it beforehand: its ``KVTransferConfig.engine_id``
    and its NIXL side channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``)."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1

    def decode_params(self, request_id: str) -> Dict[str, Any]:
        """D's ``kv_transfer_params`` before P answered. ``remote_request_id`` is the
        proxy's id, not P's (which only P's engine knows): vLLM 0.33's push scheduler
        needs the key (``NixlConnectorMetadata.add_new_req_to_recv`` reads it) and uses
        it for heartbeats only; the arena connector's D names its own id instead."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
                "remote_request_id": request_id}


def prefill_body(body: Dict[str, Any]) -> Dict[str, Any]:
    """P's part of a client's completion request: one token, not streamed, KV kept for D."""
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    out.pop("stream_options", None)
    return out


class PrefillLeg:
    """P's request of a concurrent dispatch, on its own thread: :meth:`wait` gives P's
    ``kv_transfer_params`` and the ``time.monotonic()`` P answered, or raises P's error."""

    def __init__(self, prefill_url: str, body: Dict[str, Any], request_id: str, timeout: float):
        self._out: Dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(prefill_url, body, request_id, timeout),
                                        name="pd-proxy-prefill", daemon=True)
        self._thread.start()

    def _run(self, url: str, body: Dict[str, Any], request_id: str, timeout: float) -> None:
        try:
            with post_json(url + "/v1/completions", prefill_body(body), timeout, request_id) as r:
                self._out["params"] = json.loads(r.read()).get("kv_transfer_params")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._out["error"] = exc
        self._out["at"] = time.monotonic()

    def wait(self, timeout: float) -> Dict[str, Any]:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"P did not answer within {timeout:g} s")
        if "error" in self._out:
            raise self._out["error"]
        return self._out


class Server:
    """``vllm serve MODEL`` for a tiny random-weight model (token ids only, greedy-ready)."""

    def __init__(self, name: str, model: str, log_path: str, kv_transfer_config: Optional[Dict[str, Any]] = None,
                 block_size: int = 32, max_model_len: int = 1024, dtype: str = "float32",
                 env: Optional[Dict[str, str]] = None, extra_args: Sequence[str] = (), python: str = sys.executable,
                 cpus: Optional[Sequence[int]] = None, host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        self.name, self.log_path = name, log_path
        self.cpus = frozenset(cpus) if cpus else None  # the process group's CPUs (every thread it starts)
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        vllm = os.path.join(os.path.dirname(python), "vllm")
        # prefix: e.g. ``TwoHosts.exec_prefix(side)``, vllm serve in that namespace, on ``host`` there
        self.argv = list(prefix) + [vllm, "serve", model, "--host", host, "--port", str(self.port),
                     "--served-model-name", SERVED_NAME, "--skip-tokenizer-init", "--dtype", dtype,
                     "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--enforce-eager",
                     "--max-num-seqs", "16", "--enable-prompt-tokens-details"]
        if kv_transfer_config is not None:
            self.argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.argv += list(extra_args)
        self.env = engine_env(env)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Server":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True, preexec_fn=self._bind)
        return self

    def _bind(self) -> None:
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def wait_ready(self, timeout: float = 300.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve {self.name} exited ({self.proc and self.proc.poll()}): "
                                   f"{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"vllm serve {self.name} not healthy within {timeout:g} s: {self.log()[-3000:]}")

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def log(self) -> str:
        return read_log(self.log_path)


class Proxy:
    """A P/D proxy on 127.0.0.1 (module docstring); :attr:`url` is its address. With
    ``prefill`` (P's coordinates) it dispatches concurrently, else sequentially."""

    def __init__(self, prefill_url: str, decode_url: str, timeout: float = 300.0,
                 prefill: Optional[PrefillEngine] = None):
        self.prefill_url, self.decode_url, self.timeout = prefill_url, decode_url, timeout
        self.prefill = prefill
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 -- http.server's name
                if self.path != "/v1/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                try:
                    proxy._serve(self, body)
                except (urllib.error.URLError, OSError, ValueError) as exc:
                    self.send_error(502, f"proxy: {exc}")

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-proxy", daemon=True)
        self._thread.start()

    def _serve(self, handler, body: Dict[str, Any]) -> None:
        if self.prefill is not None:
            request_id = uuid.uuid4().hex
            leg = PrefillLeg(self.prefill_url, body, request_id, self.timeout)
            self._relay(handler, dict(body, kv_transfer_params=self.prefill.decode_params(request_id)), request_id)
            leg.wait(self.timeout)  # P's answer is not needed; its failure is D's (recomputed) load failure
            return
        with post_json(self.prefill_url + "/v1/completions", prefill_body(body), self.timeout) as r:
            params = json.loads(r.read()).get("kv_transfer_params")
        if not params:
            raise ValueError("P returned no kv_transfer_params")
        params = dict(params)
        params.pop("remote_prefill_cached_tokens", None)  # D reports its own cached tokens
        self._relay(handler, dict(body, kv_transfer_params=params))

    def _relay(self, handler, body: Dict[str, Any], request_id: Optional[str] = None) -> None:
        """D's answer to ``body``, streamed back to the client as it comes."""
        with post_json(self.decode_url + "/v1/completions", body, self.timeout, request_id) as r:
            handler.send_response(r.status)
            handler.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            handler.end_headers()
            while True:
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not chunk:
                    break
                handler.wfile.write(chunk)
                handler.wfile.flush()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def complete(url: str, prompt: Sequence[int], max_tokens: int, timeout: float = 300.0) -> Dict[str, Any]:
    """One greedy completion of a token-id prompt; returns the choice (``token_ids``) and
    the response's ``usage``."""
    body = {"model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    with post_json(url + "/v1/completions", body, timeout) as r:
        data = json.loads(r.read())
    choice = data["choices"][0]
    return {"token_ids": list(choice.get("token_ids") or []), "usage": data.get("usage") or {}}


def stream_first_token(url: str, prompt: Sequence[int], max_tokens: int, timeout: float = 300.0,
                       kv_transfer_params: Optional[Dict[str, Any]] = None,
                       request_id: Optional[str] = None) -> Dict[str, Any]:
    """A streamed completion (with ``request_id`` as its ``X-Request-Id``): seconds to the
    first token and to the end, and the token ids."""
    body = {"model": SERVED_NAME, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    t0 = time.monotonic()
    first: Optional[float] = None
    tokens: List[int] = []
    with post_json(url + "/v1/completions", body, timeout, request_id) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            got = [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])]
            if got and first is None:
                first = time.monotonic() - t0
            tokens += got
    return {"ttft_s": first, "total_s": time.monotonic() - t0, "token_ids": tokens}


def metrics(url: str, timeout: float = 30.0) -> Dict[str, float]:
    """A server's Prometheus samples (``/metrics``), keyed ``name{labels}`` as written."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(samples: Dict[str, float], name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def rpc(url: str, method: str, timeout: float = 60.0) -> List[Any]:
    """``LLM.collective_rpc`` over HTTP (vLLM's dev endpoint): each worker's result."""
    with post_json(url + "/collective_rpc", {"method": method, "timeout": timeout}, timeout + 10) as r:
        return json.loads(r.read()).get("results", [])
