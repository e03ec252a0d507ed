"""The P/D proxy of :mod:`kvcopy.testing.engine.serve` in its two ways, in front of stub P
and D servers on loopback (``http.server``): what each leg gets, that the concurrent way
has both legs in flight at once under one ``X-Request-Id``, and D's answer relayed."""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from kvcopy.testing.engine.serve import PrefillEngine, Proxy, complete

P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
            "remote_request_id": "cmpl-x-0-abcdef12", "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_block_ids": [[1, 2]], "tp_size": 1, "remote_prefill_cached_tokens": 0}


class _Stub:
    """A completions server that records each request (its ``X-Request-Id`` and body)
    and answers ``answer``, after ``wait_for`` is set when given (10 s at most)."""

    def __init__(self, answer, wait_for=None):
        self.got, self.arrived, self.waited = [], threading.Event(), None
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 -- http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.got.append((self.headers.get("X-Request-Id"), body))
                stub.arrived.set()
                if wait_for is not None:
                    stub.waited = wait_for.wait(10)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs():
    d = _Stub({"choices": [{"token_ids": [7, 8, 9]}], "usage": {"prompt_tokens": 4}})
    p = _Stub({"choices": [{"token_ids": [7]}], "kv_transfer_params": P_PARAMS}, wait_for=d.arrived)
    yield p, d
    p.close()
    d.close()


def test_concurrent_dispatch_sends_both_legs_at_once_under_one_request_id(stubs):
    p, d = stubs
    px = Proxy(p.url, d.url, timeout=30, prefill=PrefillEngine("p-engine", "10.0.0.1", 5601, 2))
    try:
        out = complete(px.url, [1, 2, 3, 4], 3)
    finally:
        px.close()
    assert out["token_ids"] == [7, 8, 9]  # D's answer relayed
    assert p.waited is True  # P answered only once D had its request: both in flight at once
    ((p_id, p_body),), ((d_id, d_body),) = p.got, d.got
    assert p_id and p_id == d_id
    assert (p_body["max_tokens"], p_body["stream"], p_body["kv_transfer_params"]) == (1, False,
                                                                                     {"do_remote_decode": True})
    assert (d_body["prompt"], d_body["max_tokens"]) == ([1, 2, 3, 4], 3)
    assert d_body["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
        "remote_host": "10.0.0.1", "remote_port": 5601, "tp_size": 2, "remote_request_id": p_id}


def test_sequential_dispatch_hands_d_ps_answer():
    d = _Stub({"choices": [{"token_ids": [7, 8, 9]}], "usage": {"prompt_tokens": 4}})
    p = _Stub({"choices": [{"token_ids": [7]}], "kv_transfer_params": P_PARAMS})
    px = Proxy(p.url, d.url, timeout=30)
    try:
        out = complete(px.url, [1, 2, 3, 4], 3)
        assert d.got and p.got and p.got[0][1]["kv_transfer_params"] == {"do_remote_decode": True}
    finally:
        px.close()
        p.close()
        d.close()
    assert out["token_ids"] == [7, 8, 9]
    want = {k: v for k, v in P_PARAMS.items() if k != "remote_prefill_cached_tokens"}
    assert d.got[0][1]["kv_transfer_params"] == want  # P's answer, less what would overwrite D's own count
